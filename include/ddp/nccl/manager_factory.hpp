#pragma once
/// @file nccl/manager_factory.hpp
/// @brief `ddp::nccl::manager_factory`: the fault-tolerant `Manager` over NCCL. For each quorum,
/// the NCCL unique id goes through the quorum's store namespace and a fresh NCCL communicator is
/// created for the quorum's members.
///
/// Failure and re-formation. When a collective fails, or before a new quorum forms, the Manager
/// calls `abort()` on the current communicator, which for NCCL is `ncclCommAbort` (it stops
/// kernels blocked on dead peers and frees the communicator), then builds the next quorum's
/// communicator through this factory: a new unique id, a new clique. `ncclCommRevoke` and
/// `ncclCommShrink` (`nccl::communicator::revoke` / `shrink`, under `DDP_NCCL_HAS_REVOKE` /
/// `DDP_NCCL_HAS_SHRINK`) are not used by the Manager: rebuilding works on every supported NCCL
/// version and also admits new replicas, which a shrink cannot.
///
/// @code
/// ddp::Manager m(store, ddp::nccl::manager_factory(local_gpu, {.timeout = 30s}), state, opts);
/// @endcode

#include <memory>
#include <string>
#include <utility>

#include <cuda_runtime_api.h>

#include <ddp/any_communicator.hpp>
#include <ddp/cuda/runtime.hpp>
#include <ddp/device.hpp>
#include <ddp/device_runtime.hpp>
#include <ddp/manager.hpp>
#include <ddp/nccl/communicator.hpp>
#include <ddp/nccl/device.hpp>
#include <ddp/nccl/error.hpp>
#include <ddp/nccl/options.hpp>
#include <ddp/nccl/unique_id.hpp>

namespace ddp::nccl {

/// A replica's stream on its GPU, on which every quorum's NCCL communicator runs
/// (`manager_factory(const replica_stream&, ...)`), and the runtime its device queue names. Give
/// `queue()` to `manager_options::device_queue`: a Bucketer built over the Manager then keeps its
/// device buckets and events on this stream across quorums. Outlives the Manager. Move-only.
class replica_stream {
 public:
  /// A new stream on CUDA device `device`, blocking as a communicator's own (`cudaStreamCreate`):
  /// ordered after work on the legacy default stream.
  /// @throws usage_error without that device; communication_error when CUDA fails
  explicit replica_stream(int device, int rank = -1) : device_(device), rt_(std::make_unique<cuda::runtime>(rank)) {
    require_device(rank, device, "nccl::replica_stream");
    device_guard on_device(device, rank, "nccl::replica_stream");
    check_cuda(cudaStreamCreate(&stream_), rank, "nccl::replica_stream", "cudaStreamCreate");
  }
  /// Takes over the stream and runtime; the source may only be destroyed.
  replica_stream(replica_stream&& o) noexcept
      : device_(o.device_), rt_(std::move(o.rt_)), stream_(std::exchange(o.stream_, nullptr)) {}
  replica_stream& operator=(replica_stream&&) = delete;
  replica_stream(const replica_stream&) = delete;
  replica_stream& operator=(const replica_stream&) = delete;
  /// Destroys the stream once its work completed.
  ~replica_stream() {
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }

  /// The CUDA device ordinal.
  [[nodiscard]] int device() const noexcept { return device_; }
  /// The stream.
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }
  /// For `manager_options::device_queue`.
  [[nodiscard]] ddp::device_queue queue() const noexcept {
    return {rt_.get(), cuda::stream(stream_), ddp::device::cuda(device_)};
  }

 private:
  int device_;
  std::unique_ptr<cuda::runtime> rt_;  // stable address: the queue points at it
  cudaStream_t stream_ = nullptr;
};

/// A `communicator_factory` for `ddp::Manager`: for each quorum, rank 0 of the quorum publishes a
/// fresh unique id under "nccl_unique_id" in `quorum_info::store` (a namespace of its own for
/// every generation), the others wait for it (up to `opts.timeout`, and no later than the quorum's
/// deadline), and every member calls
/// `communicator::create(id, q.rank, q.size, device, opts)`. The result keeps its device queue
/// through `any_communicator`, so the Manager heals and hashes device state on its stream. Each
/// communicator has a stream of its own (unless `opts.stream` names one): for a Bucketer over the
/// Manager, use the `replica_stream` form.
/// @param device  CUDA device ordinal of this replica
/// @param opts    options of every communicator created (a caller's `opts.stream` is shared by all)
[[nodiscard]] inline communicator_factory manager_factory(int device, options opts = {}) {
  return [device, opts = std::move(opts)](const quorum_info& q) -> any_communicator {
    const unique_id id = share_unique_id(q.store, q.rank, "nccl_unique_id", q.connect_time_left(opts.timeout));
    // The set-up ends with the quorum's connect deadline: a member that died after the id was
    // shared costs the others that long, never more (options::bounded_init).
    options mine = opts;
    mine.bounded_init = true;
    mine.init_timeout = q.connect_time_left(opts.timeout);
    q.store.set("nccl_arrived/" + std::to_string(q.rank), as_bytes(std::string("1")));
    try {
      return any_communicator(communicator::create(id, q.rank, q.size, device, mine));
    } catch (const timeout_error& e) {  // name the members that never arrived
      std::string missing;
      for (int r = 0; r < q.size; ++r) {
        if (!q.store.get("nccl_arrived/" + std::to_string(r)))
          missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      throw timeout_error(q.rank, e.operation(),
                          e.message() + "; quorum ranks that never reached the set-up: " +
                              (missing.empty() ? std::string("none (one died during it)") : missing));
    }
  };
}

/// The factory whose every communicator runs on `replica`'s stream (which must outlive it), so
/// that the Manager's device queue stays the same across quorums:
/// @code
/// ddp::nccl::replica_stream gpu(local_gpu);
/// ddp::manager_options o{.replica_id = id, .device_queue = gpu.queue()};
/// ddp::Manager m(store, ddp::nccl::manager_factory(gpu, {.timeout = 30s}), state, o);
/// ddp::Bucketer<ddp::bucketing::fixed> grads(m);  // device gradients, buckets on gpu's stream
/// @endcode
/// Only compiled so far: no GPU has run it (docs/gpu-validation.md).
[[nodiscard]] inline communicator_factory manager_factory(const replica_stream& replica, options opts = {}) {
  opts.stream = replica.stream();
  return manager_factory(replica.device(), std::move(opts));
}

}  // namespace ddp::nccl
