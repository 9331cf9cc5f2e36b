#pragma once
/// @file communicator.hpp
/// @brief `ddp::nccl::communicator`: the NCCL backend, modelling `ddp::communicator` for tensors
/// in CUDA memory.
///
/// Stream semantics. Collectives are enqueued on the communicator's stream and return at once;
/// the returned `work` completes when the collective completed on the device. Nothing in a
/// trainer has to block the host: `stream_wait(compute)` makes a compute stream wait for the
/// collectives issued so far, `enqueue_after(producer)` makes later collectives wait for the work
/// queued on a producer stream (e.g. the backward pass that wrote the gradients).
///
/// Threading. One communicator per rank and device; call it from one thread at a time (or from
/// several threads that agree on the order). `abort()` may be called from any thread, e.g. a
/// watchdog, and unblocks collectives waiting for dead peers.
///
/// @code
/// ddp::mpi::environment env(argc, argv);
/// auto world = ddp::mpi::communicator::world();
/// auto gpu = ddp::nccl::communicator::bootstrap(world, local_rank);  // id sent over MPI
/// gpu.enqueue_after(backward_stream);
/// ddp::work w = gpu.allreduce(grads, ddp::reduce_op::avg);  // grads: tensors on cuda:local_rank
/// gpu.stream_wait(optimizer_stream);                      // optimizer kernels run after it
/// @endcode

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/backend_contract.hpp>
#include <ddp/communicator.hpp>
#include <ddp/error.hpp>
#include <ddp/nccl/collective_work.hpp>
#include <ddp/nccl/comm_state.hpp>
#include <ddp/nccl/device.hpp>
#include <ddp/nccl/error.hpp>
#include <ddp/nccl/event.hpp>
#include <ddp/nccl/features.hpp>
#include <ddp/nccl/group_guard.hpp>
#include <ddp/nccl/options.hpp>
#include <ddp/nccl/types.hpp>
#include <ddp/nccl/unique_id.hpp>
#include <ddp/reduce_op.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp::nccl {

#if DDP_NCCL_HAS_SHRINK
/// What `communicator::shrink` does with collectives still in flight on the old communicator.
enum class shrink_mode : unsigned char {
  wait,           ///< NCCL_SHRINK_DEFAULT: there must be none (or the communicator was revoked)
  abort_pending,  ///< NCCL_SHRINK_ABORT: terminate them first (the old communicator is unusable afterwards)
};
#endif

/// One rank's NCCL communicator: owns an `ncclComm_t` bound to one CUDA device, and a stream
/// (unless `options::stream` supplies one). Move-only.
class communicator {
 public:
  /// Creates this rank's communicator (`ncclCommInitRankConfig`, blocking until all `size`
  /// ranks called it with the same id). Collective over the clique.
  /// @pre every rank passes the same `id` and a distinct `rank` in [0, size)
  /// @throws usage_error when no CUDA device is visible ("no CUDA device visible on rank r: ..."),
  ///         `device` is out of range, or rank/size are inconsistent
  /// @throws communication_error when CUDA or NCCL fails
  [[nodiscard]] static communicator create(const unique_id& id, int rank, int size, int device, options opts = {}) {
    const char* const operation = "nccl::communicator::create";
    if (size < 1 || rank < 0 || rank >= size) {
      throw usage_error(rank, operation,
                        "rank " + std::to_string(rank) + " is not in [0, size) for size " + std::to_string(size));
    }
    require_device(rank, device, operation);
    device_guard on_device(device, rank, operation);
    auto state = std::make_shared<detail::comm_state>(rank, size, device, std::move(opts));
    state->acquire(operation);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 1;
    if (!state->opts.name.empty()) config.commName = state->opts.name.c_str();
    // Kept out of `state` until it succeeded: a failed init is cleaned up by NCCL itself.
    ncclComm_t comm = nullptr;
    check_nccl(ncclCommInitRankConfig(&comm, size, id.native, rank, &config), rank, operation,
               "ncclCommInitRankConfig");
    state->comm = comm;
    return communicator(std::move(state));
  }

  /// Creates an NCCL communicator with the ranks of `over` (any ddp backend: MPI, gloo, local):
  /// first all ranks agree that each has a usable `device`, so a rank without a GPU fails
  /// everywhere with a clear error instead of leaving the others blocked in NCCL's
  /// initialisation; then rank 0's unique id is broadcast over `over`; then `create`.
  /// Collective over `over`.
  /// @throws usage_error on every rank when some rank has no usable device
  [[nodiscard]] static communicator bootstrap(communicator_ref over, int device, options opts = {}) {
    const char* const operation = "nccl::communicator::bootstrap";
    const std::string problem = device_problem(over.rank(), device, visible_devices());
    std::array<std::int32_t, 1> ranks_without_device{problem.empty() ? 0 : 1};
    over.allreduce(ranks_without_device, reduce_op::sum).wait();
    if (!problem.empty()) throw usage_error(over.rank(), operation, problem);
    if (ranks_without_device[0] > 0) {
      throw usage_error(over.rank(), operation,
                        std::to_string(ranks_without_device[0]) +
                            " rank(s) have no usable CUDA device (see their errors); NCCL communicator not created");
    }
    const unique_id id = share_unique_id(over, 0);
    return create(id, over.rank(), over.size(), device, std::move(opts));
  }

  /// Takes over the communicator; the source may only be destroyed or assigned to.
  communicator(communicator&&) noexcept = default;
  /// Releases the replaced communicator as the destructor does, then takes over the source's.
  communicator& operator=(communicator&&) noexcept = default;
  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;
  /// Releases the communicator once no work handle refers to it any more: `ncclCommDestroy` if
  /// healthy (waits for in-flight collectives), `ncclCommAbort` otherwise. Call `abort()` first
  /// to tear down without waiting.
  ~communicator() = default;

  /// This rank in the clique.
  [[nodiscard]] int rank() const { return state_->rank; }
  /// Ranks in the clique.
  [[nodiscard]] int size() const { return state_->size; }
  /// CUDA device ordinal of this rank.
  [[nodiscard]] int device() const noexcept { return state_->device; }
  /// Stream the collectives are enqueued on.
  [[nodiscard]] cudaStream_t stream() const noexcept { return state_->stream; }
  /// Deadline of `work::wait()` (`options::timeout`).
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return state_->opts.timeout; }
  /// The NCCL handle, for calls this class does not wrap (null after abort()).
  [[nodiscard]] ncclComm_t native_handle() const noexcept { return state_->comm; }
  /// Number of collectives this rank has issued.
  [[nodiscard]] std::uint64_t issued() const noexcept { return seq_; }

  /// In-place allreduce; several tensors are coalesced into one NCCL group (one launch).
  /// Tensors of one call may have different dtypes. `avg` uses `ncclAvg`.
  /// @pre every tensor is CUDA memory on `device()`
  /// @throws usage_error on a tensor elsewhere, or after abort()
  work allreduce(std::span<const tensor_view> ts, reduce_op op) {
    const op_info info = contract::check_allreduce(caller(), ts, op);
    return issue(info, [&](ncclComm_t comm, const std::string& what) {
      each_in_group(ts, what, comm, [&](const tensor_view& t) {
        check_nccl(ncclAllReduce(t.data, t.data, t.count, to_nccl(t.type), to_nccl(op), comm, stream()), rank(), what,
                   "ncclAllReduce", comm);
      });
    });
  }

  /// In-place broadcast from `root`; several tensors are coalesced into one NCCL group.
  /// @throws usage_error on a bad root, a tensor elsewhere, or after abort()
  work broadcast(std::span<const tensor_view> ts, int root) {
    const op_info info = contract::check_broadcast(caller(), ts, root);
    return issue(info, [&](ncclComm_t comm, const std::string& what) {
      each_in_group(ts, what, comm, [&](const tensor_view& t) {
        check_nccl(ncclBroadcast(t.data, t.data, t.count, to_nccl(t.type), root, comm, stream()), rank(), what,
                   "ncclBroadcast", comm);
      });
    });
  }

  /// `out.count == in.count * size()`; rank r's `in` lands at `out[r * in.count]`. `in` may be
  /// that very block of `out` (NCCL's in-place form); other overlaps are not allowed.
  /// @throws usage_error on a dtype or size mismatch, another overlap, a tensor elsewhere, or
  ///   after abort()
  work allgather(tensor_view in, tensor_view out) {
    const op_info info = contract::check_allgather(caller(), in, out);
    return issue(info, [&](ncclComm_t comm, const std::string& what) {
      if (in.count == 0) return;
      check_nccl(ncclAllGather(in.data, out.data, in.count, to_nccl(in.type), comm, stream()), rank(), what,
                 "ncclAllGather", comm);
    });
  }

  /// `in.count == out.count * size()`; rank r receives block r of the reduction. `in` and `out`
  /// must not overlap (as on every backend: NCCL's own in-place form is not part of the contract).
  /// @throws usage_error on a dtype or size mismatch, overlapping tensors, a tensor elsewhere, or
  ///   after abort()
  work reduce_scatter(tensor_view in, tensor_view out, reduce_op op) {
    const op_info info = contract::check_reduce_scatter(caller(), in, out, op);
    return issue(info, [&](ncclComm_t comm, const std::string& what) {
      if (out.count == 0) return;
      check_nccl(ncclReduceScatter(in.data, out.data, out.count, to_nccl(in.type), to_nccl(op), comm, stream()), rank(),
                 what, "ncclReduceScatter", comm);
    });
  }

  /// A one-element allreduce on a device scratch buffer: completes once every rank reached it
  /// (on the device, in stream order).
  work barrier() {
    const op_info info = contract::check_barrier(caller());
    return issue(info, [&](ncclComm_t comm, const std::string& what) {
      check_nccl(ncclAllReduce(state_->barrier_buffer, state_->barrier_buffer, 1, ncclInt32, ncclSum, comm, stream()),
                 rank(), what, "ncclAllReduce", comm);
    });
  }

  /// `ncclCommAbort`: stops this rank's collectives (also ones blocked on dead peers). Pending
  /// work then fails with communication_error; later calls throw usage_error. Safe from any thread.
  void abort() noexcept {
    if (state_) state_->abort("rank " + std::to_string(state_->rank) + " called abort()");
  }

  /// Makes `consumer` wait, on the device, for every collective issued so far; the host does not
  /// block. Use it before kernels that read the results (e.g. the optimizer step).
  /// @throws usage_error after abort(); communication_error if CUDA fails
  void stream_wait(cudaStream_t consumer) {
    const char* const operation = "nccl::communicator::stream_wait";
    (void)state_->usable_handle(operation);
    device_guard on_device(device(), rank(), operation);
    state_->collectives_done.record(stream(), rank(), operation);
    state_->collectives_done.make_wait(consumer, rank(), operation);
  }

  /// Makes every collective issued from now on wait, on the device, for the work currently
  /// queued on `producer` (e.g. the kernels that wrote the gradients). Not needed when
  /// `producer` is `stream()` itself.
  /// @throws usage_error after abort(); communication_error if CUDA fails
  void enqueue_after(cudaStream_t producer) {
    const char* const operation = "nccl::communicator::enqueue_after";
    (void)state_->usable_handle(operation);
    device_guard on_device(device(), rank(), operation);
    state_->producer_done.record(producer, rank(), operation);
    state_->producer_done.make_wait(stream(), rank(), operation);
  }

#if DDP_NCCL_HAS_REVOKE
  /// Fault tolerance, step 1 (`ncclCommRevoke`): stops in-flight collectives without freeing the
  /// communicator and waits (up to `timeout()`) until it is quiescent. Pending work then fails
  /// with communication_error, later collectives throw usage_error; `shrink` is allowed.
  /// @throws timeout_error (after aborting) if it does not become quiescent in time
  void revoke() {
    const char* const operation = "nccl::communicator::revoke";
    ncclComm_t comm = state_->management_handle(operation);
    device_guard on_device(device(), rank(), operation);
    check_nccl(ncclCommRevoke(comm, NCCL_REVOKE_DEFAULT), rank(), operation, "ncclCommRevoke", comm);
    state_->mark_revoked("rank " + std::to_string(rank()) + " revoked it");
    wait_quiescent(comm, operation);
  }
#endif

#if DDP_NCCL_HAS_SHRINK
  /// Fault tolerance, step 2 (`ncclCommShrink`): a new communicator of the ranks not in
  /// `excluded_ranks`, renumbered densely in the old order, on the same device. Collective over
  /// the surviving ranks; excluded (e.g. dead) ranks do not call it. The new communicator uses
  /// the caller's stream if one was given, else a stream of its own. This communicator stays
  /// valid for `revoke`/destruction.
  /// @throws usage_error if this rank is excluded or a rank is out of range, or after abort()
  [[nodiscard]] communicator shrink(std::span<const int> excluded_ranks, shrink_mode mode = shrink_mode::wait) {
    const char* const operation = "nccl::communicator::shrink";
    ncclComm_t comm = state_->management_handle(operation);
    std::vector<int> excluded(excluded_ranks.begin(), excluded_ranks.end());
    for (const int r : excluded) {
      if (r < 0 || r >= size()) {
        throw usage_error(rank(), operation,
                          "excluded rank " + std::to_string(r) + " is not in [0, " + std::to_string(size()) + ")");
      }
      if (r == rank()) throw usage_error(rank(), operation, "an excluded rank must not call shrink()");
    }
    device_guard on_device(device(), rank(), operation);
    auto next = std::make_shared<detail::comm_state>(rank(), size(), device(), state_->opts);
    next->acquire(operation);
    const int flags = mode == shrink_mode::abort_pending ? NCCL_SHRINK_ABORT : NCCL_SHRINK_DEFAULT;
    ncclComm_t shrunk = nullptr;
    check_nccl(ncclCommShrink(comm, excluded.data(), static_cast<int>(excluded.size()), &shrunk, nullptr, flags),
               rank(), operation, "ncclCommShrink", comm);
    next->comm = shrunk;
    if (mode == shrink_mode::abort_pending) {
      state_->mark_revoked("rank " + std::to_string(rank()) + " shrank it, aborting pending work");
    }
    check_nccl(ncclCommUserRank(next->comm, &next->rank), rank(), operation, "ncclCommUserRank", next->comm);
    check_nccl(ncclCommCount(next->comm, &next->size), rank(), operation, "ncclCommCount", next->comm);
    return communicator(std::move(next));
  }
#endif

 private:
  explicit communicator(std::shared_ptr<detail::comm_state> state) : state_(std::move(state)) {}

  // The calling rank, for the contract checks (backend_contract.hpp): CUDA memory on device() only.
  [[nodiscard]] contract::caller caller() const { return {rank(), size(), seq_, timeout(), memory_on(device())}; }

  // Enqueues one call per non-empty tensor; more than one go into an NCCL group.
  template <class Enqueue>
  void each_in_group(std::span<const tensor_view> ts, const std::string& what, ncclComm_t comm, Enqueue&& enqueue) {
    std::size_t non_empty = 0;
    for (const tensor_view& t : ts) non_empty += t.count > 0 ? 1 : 0;
    if (non_empty <= 1) {
      for (const tensor_view& t : ts) {
        if (t.count > 0) enqueue(t);
      }
      return;
    }
    group_guard group(rank(), what);
    for (const tensor_view& t : ts) {
      if (t.count > 0) enqueue(t);
    }
    group.end(comm);
  }

  // Common path of every collective: refuse after abort, select the device, enqueue, then record
  // the completion event. The event exists before the enqueue, so a failure to create it leaves
  // nothing in flight that no handle tracks.
  template <class Enqueue>
  work issue(const op_info& info, Enqueue&& enqueue) {
    const std::string what = info.describe();
    ncclComm_t comm = state_->usable_handle(what);
    device_guard on_device(device(), rank(), what);
    event done = event::create(rank(), what);
    ++seq_;
    enqueue(comm, what);
    done.record(stream(), rank(), what);
    return work(std::make_unique<detail::collective_work>(state_, info, std::move(done)));
  }

#if DDP_NCCL_HAS_REVOKE
  // NCCL reports ncclInProgress until a revoked communicator is quiescent.
  void wait_quiescent(ncclComm_t comm, const char* operation) {
    const auto deadline = clock::now() + timeout();
    for (;;) {
      ncclResult_t state = ncclSuccess;
      check_nccl(ncclCommGetAsyncError(comm, &state), rank(), operation, "ncclCommGetAsyncError", comm);
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) throw make_nccl_error(state, rank(), operation, "ncclCommRevoke", comm);
      if (clock::now() >= deadline) {
        state_->abort("rank " + std::to_string(rank()) + ": revoke did not finish in time");
        throw timeout_error(rank(), operation,
                            "the revoked communicator did not become quiescent within " +
                                std::to_string(timeout().count()) + " ms; aborted it");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
#endif

  std::shared_ptr<detail::comm_state> state_;
  std::uint64_t seq_ = 0;
};

static_assert(ddp::communicator<communicator>);

}  // namespace ddp::nccl
