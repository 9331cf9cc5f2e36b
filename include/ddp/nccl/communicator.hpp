#pragma once
/// @file communicator.hpp
/// @brief `ddp::nccl::communicator`: the NCCL backend, modelling `ddp::communicator` for tensors
/// in CUDA memory, `ddp::device_communicator` (its collectives run on a CUDA stream) and
/// `ddp::premul_sum_communicator` (`ncclRedOpCreatePreMulSum`).
///
/// Collectives are enqueued on the communicator's stream and return at once; host tensors (the
/// components' control messages) are staged through device memory. See docs/backends-nccl.md for
/// stream semantics, what "complete" means, staging, threads and an example.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/backend_contract.hpp>
#include <ddp/communicator.hpp>
#include <ddp/cuda/runtime.hpp>
#include <ddp/detail/host_staging.hpp>
#include <ddp/device.hpp>
#include <ddp/device_runtime.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/nccl/collective_work.hpp>
#include <ddp/nccl/comm_state.hpp>
#include <ddp/nccl/device.hpp>
#include <ddp/nccl/error.hpp>
#include <ddp/nccl/event.hpp>
#include <ddp/nccl/features.hpp>
#include <ddp/nccl/group_guard.hpp>
#include <ddp/nccl/nonblocking.hpp>
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
  /// Creates this rank's communicator (`ncclCommInitRankConfig`): returns once all `size` ranks
  /// called it with the same id, or, with `options::bounded_init` (the default), throws
  /// `timeout_error` at `options::init_timeout` after aborting the half-made communicator.
  /// Collective over the clique.
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
    config.blocking = state->opts.bounded_init ? 0 : 1;
    if (!state->opts.name.empty()) config.commName = state->opts.name.c_str();
    // Kept out of `state` until it succeeded: a failed blocking init is cleaned up by NCCL itself,
    // a non-blocking one that failed or ran out of time is aborted here.
    ncclComm_t comm = nullptr;
    const ncclResult_t started = ncclCommInitRankConfig(&comm, size, id.native, rank, &config);
    if (!state->opts.bounded_init || comm == nullptr) {
      check_nccl(started, rank, operation, "ncclCommInitRankConfig");
    } else {
      const auto within =
          state->opts.init_timeout > std::chrono::milliseconds(0) ? state->opts.init_timeout : state->opts.timeout;
      const ncclResult_t r = detail::settle(comm, started, clock::now() + within);
      if (r == ncclInProgress) {
        (void)ncclCommAbort(comm);
        throw timeout_error(rank, operation,
                            "ncclCommInitRankConfig: the clique of " + std::to_string(size) +
                                " ranks did not form within " + std::to_string(within.count()) +
                                " ms (a rank never called create with this id, or died after it was shared); "
                                "the communicator was aborted (ncclCommAbort)");
      }
      if (r != ncclSuccess) {
        communication_error e = make_nccl_error(r, rank, operation, "ncclCommInitRankConfig", comm);
        (void)ncclCommAbort(comm);
        throw e;
      }
    }
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
  /// Where the collectives run (`device_communicator`): this communicator's runtime, `stream()`
  /// and `device()`. Valid as long as the communicator (or a work handle it returned) lives.
  [[nodiscard]] ddp::device_queue device_queue() const noexcept {
    return {&*state_->runtime, cuda::stream(state_->stream), ddp::device::cuda(state_->device)};
  }

  /// In-place allreduce; several tensors are coalesced into one NCCL group (one launch).
  /// Tensors of one call may have different dtypes. `avg` uses `ncclAvg`.
  /// @pre every tensor is CUDA memory on `device()`, or every tensor is host memory (staged and
  ///      complete on return: docs/backends-nccl.md)
  /// @throws usage_error on a tensor elsewhere, a call mixing host and device tensors, or after abort()
  work allreduce(std::span<const tensor_view> ts, reduce_op op) {
    if (all_host(ts)) {
      return staged(contract::check_allreduce(host_caller(), ts, op), [&](ddp::detail::host_staging& staging) {
        const std::vector<tensor_view> on_device = stage_in_place(staging, ts, true);
        return allreduce(on_device, op);
      });
    }
    const op_info info = contract::check_allreduce(caller(), ts, op);
    return issue(info, [&](ncclComm_t comm, const std::string& what) {
      each_in_group(ts, what, comm, [&](const tensor_view& t) {
        check_enqueued(ncclAllReduce(t.data, t.data, t.count, to_nccl(t.type), to_nccl(op), comm, stream()), rank(),
                       what, "ncclAllReduce", comm);
      });
    });
  }

  /// In-place sum in which every rank's floating-point values are first multiplied by `factor`
  /// (`premul_sum_communicator`; the averaging rule of ddp/average.hpp): an
  /// `ncclRedOpCreatePreMulSum` operator per floating-point tensor, its scalar `factor` converted
  /// on the host to the tensor's dtype (NCCL takes the scalar in the dtype of the operator), and
  /// destroyed once the call is enqueued. Integer tensors are summed as they are (`ncclSum`).
  /// Several tensors are one NCCL group, like `allreduce`.
  ///
  /// Bits: f32 and f64 follow the rule exactly. For f16 and bf16 the factor is rounded to the
  /// dtype itself (not to f32, the rule's compute type), so the result is the rule's whenever
  /// `factor` is exact in the dtype, e.g. `1/d` for a power-of-two `d`.
  /// Host tensors are staged as in `allreduce`.
  /// @throws usage_error if `factor` is not finite, on a tensor elsewhere, a call mixing host and
  ///   device tensors, or after abort()
  work allreduce_premul_sum(std::span<const tensor_view> ts, double factor) {
    const bool host = all_host(ts);
    const op_info info = contract::check_allreduce(host ? host_caller() : caller(), ts, reduce_op::sum);
    if (!std::isfinite(factor)) {
      throw usage_error(rank(), info.describe(), "the pre-multiplication factor is not finite");
    }
    if (host) {
      return staged(info, [&](ddp::detail::host_staging& staging) {
        const std::vector<tensor_view> on_device = stage_in_place(staging, ts, true);
        return allreduce_premul_sum(on_device, factor);
      });
    }
    return issue(info, [&](ncclComm_t comm, const std::string& what) {
      // Declared before the group: the operators are destroyed after ncclGroupEnd.
      premul_ops ops(comm, rank(), what, ts.size());
      each_in_group(ts, what, comm, [&](const tensor_view& t) {
        const ncclRedOp_t op = is_floating(t.type) ? ops.create(t.type, factor) : ncclSum;
        check_enqueued(ncclAllReduce(t.data, t.data, t.count, to_nccl(t.type), op, comm, stream()), rank(), what,
                       "ncclAllReduce", comm);
      });
    });
  }

  /// In-place broadcast from `root`; several tensors are coalesced into one NCCL group.
  /// Host tensors are staged as in `allreduce`.
  /// @throws usage_error on a bad root, a tensor elsewhere, a call mixing host and device
  ///   tensors, or after abort()
  work broadcast(std::span<const tensor_view> ts, int root) {
    if (all_host(ts)) {
      return staged(contract::check_broadcast(host_caller(), ts, root), [&](ddp::detail::host_staging& staging) {
        const std::vector<tensor_view> on_device = stage_in_place(staging, ts, rank() == root);
        return broadcast(on_device, root);
      });
    }
    const op_info info = contract::check_broadcast(caller(), ts, root);
    return issue(info, [&](ncclComm_t comm, const std::string& what) {
      each_in_group(ts, what, comm, [&](const tensor_view& t) {
        check_enqueued(ncclBroadcast(t.data, t.data, t.count, to_nccl(t.type), root, comm, stream()), rank(), what,
                       "ncclBroadcast", comm);
      });
    });
  }

  /// `out.count == in.count * size()`; rank r's `in` lands at `out[r * in.count]`. `in` may be
  /// that very block of `out` (NCCL's in-place form); other overlaps are not allowed. Host
  /// tensors are staged as in `allreduce`.
  /// @throws usage_error on a dtype or size mismatch, another overlap, a tensor elsewhere, a
  ///   call mixing host and device tensors, or after abort()
  work allgather(tensor_view in, tensor_view out) {
    if (in.where.is_host() && out.where.is_host()) {
      return staged(contract::check_allgather(host_caller(), in, out), [&](ddp::detail::host_staging& staging) {
        // The output first: an in-place input is then a view of its device copy.
        const tensor_view out_on_device = staging.stage(out, /*copy_in=*/false);
        const tensor_view in_on_device = staging.stage(in, /*copy_in=*/true, /*copy_out=*/false);
        return allgather(in_on_device, out_on_device);
      });
    }
    const op_info info = contract::check_allgather(caller(), in, out);
    return issue(info, [&](ncclComm_t comm, const std::string& what) {
      if (in.count == 0) return;
      check_enqueued(ncclAllGather(in.data, out.data, in.count, to_nccl(in.type), comm, stream()), rank(), what,
                     "ncclAllGather", comm);
    });
  }

  /// `in.count == out.count * size()`; rank r receives block r of the reduction. `in` and `out`
  /// must not overlap (as on every backend: NCCL's own in-place form is not part of the contract).
  /// Host tensors are staged as in `allreduce`.
  /// @throws usage_error on a dtype or size mismatch, overlapping tensors, a tensor elsewhere, a
  ///   call mixing host and device tensors, or after abort()
  work reduce_scatter(tensor_view in, tensor_view out, reduce_op op) {
    if (in.where.is_host() && out.where.is_host()) {
      return staged(contract::check_reduce_scatter(host_caller(), in, out, op),
                    [&](ddp::detail::host_staging& staging) {
                      const tensor_view in_on_device = staging.stage(in, /*copy_in=*/true, /*copy_out=*/false);
                      const tensor_view out_on_device = staging.stage(out, /*copy_in=*/false);
                      return reduce_scatter(in_on_device, out_on_device, op);
                    });
    }
    const op_info info = contract::check_reduce_scatter(caller(), in, out, op);
    return issue(info, [&](ncclComm_t comm, const std::string& what) {
      if (out.count == 0) return;
      check_enqueued(ncclReduceScatter(in.data, out.data, out.count, to_nccl(in.type), to_nccl(op), comm, stream()),
                     rank(), what, "ncclReduceScatter", comm);
    });
  }

  /// A one-element allreduce on a device scratch buffer: completes once every rank reached it
  /// (on the device, in stream order).
  work barrier() {
    const op_info info = contract::check_barrier(caller());
    return issue(info, [&](ncclComm_t comm, const std::string& what) {
      check_enqueued(
          ncclAllReduce(state_->barrier_buffer, state_->barrier_buffer, 1, ncclInt32, ncclSum, comm, stream()), rank(),
          what, "ncclAllReduce", comm);
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
    // Non-blocking (bounded_init): the revoke goes on in NCCL's thread; wait_quiescent waits for it.
    const ncclResult_t started = ncclCommRevoke(comm, NCCL_REVOKE_DEFAULT);
    if (started != ncclInProgress) check_nccl(started, rank(), operation, "ncclCommRevoke", comm);
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
    // Non-blocking (bounded_init): NCCL's thread writes the new handle when the shrink finished,
    // so it goes straight into `next` (heap memory), which releases it whatever happens.
    const auto deadline = clock::now() + state_->opts.timeout;
    const ncclResult_t started =
        ncclCommShrink(comm, excluded.data(), static_cast<int>(excluded.size()), &next->comm, nullptr, flags);
    const ncclResult_t r = detail::settle(comm, started, deadline);
    if (r == ncclInProgress) {  // aborting the parent ends NCCL's shrink job before `next` may go
      state_->abort("its shrink did not finish in time");
      throw timeout_error(rank(), operation,
                          "ncclCommShrink did not finish within " + std::to_string(state_->opts.timeout.count()) +
                              " ms; the communicator was aborted");
    }
    check_nccl(r, rank(), operation, "ncclCommShrink", comm);
    if (next->comm == nullptr) {
      throw communication_error(rank(), operation, "ncclCommShrink reported success without a communicator");
    }
    detail::check_settled(ncclInProgress, next->comm, rank(), operation, "ncclCommShrink (the new communicator)",
                          std::max(std::chrono::milliseconds(0),
                                   std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now())));
    if (mode == shrink_mode::abort_pending) {
      state_->mark_revoked("rank " + std::to_string(rank()) + " shrank it, aborting pending work");
    }
    check_nccl(ncclCommUserRank(next->comm, &next->rank), rank(), operation, "ncclCommUserRank", next->comm);
    check_nccl(ncclCommCount(next->comm, &next->size), rank(), operation, "ncclCommCount", next->comm);
    next->runtime.emplace(next->rank);  // its errors name the new rank
    return communicator(std::move(next));
  }
#endif

 private:
  explicit communicator(std::shared_ptr<detail::comm_state> state) : state_(std::move(state)) {}

  // The calling rank, for the contract checks (backend_contract.hpp): CUDA memory on device() only.
  [[nodiscard]] contract::caller caller() const { return {rank(), size(), seq_, timeout(), memory_on(device())}; }
  // The same for a staged call: host memory only.
  [[nodiscard]] contract::caller host_caller() const {
    return {rank(), size(), seq_, timeout(), contract::memory_rule::host("a staged NCCL call")};
  }

  // True when a call's tensors are all host memory (and there is one): the call is staged.
  [[nodiscard]] static bool all_host(std::span<const tensor_view> ts) noexcept {
    if (ts.empty()) return false;
    for (const tensor_view& t : ts) {
      if (!t.where.is_host()) return false;
    }
    return true;
  }

  // Device copies of in-place tensors, each copied back by `finish`.
  [[nodiscard]] static std::vector<tensor_view> stage_in_place(ddp::detail::host_staging& staging,
                                                               std::span<const tensor_view> ts, bool copy_in) {
    std::vector<tensor_view> on_device;
    on_device.reserve(ts.size());
    for (const tensor_view& t : ts) on_device.push_back(staging.stage(t, copy_in));
    return on_device;
  }

  // A call over host tensors (docs/backends-nccl.md): `issue_staged(staging)` stages the tensors
  // and issues the collective over their device copies on stream(); then the results are copied
  // back and waited for. Complete on return: a ready work, or a failed one carrying the
  // communication or timeout error. usage_errors (e.g. after abort()) are thrown.
  template <class IssueStaged>
  work staged(const op_info& info, IssueStaged&& issue_staged) {
    (void)state_->usable_handle(info.describe());
    try {
      ddp::detail::host_staging staging(device_queue());
      work collective = issue_staged(staging);
      staging.finish(std::move(collective), info);
      return work::ready();
    } catch (const usage_error&) {
      throw;
    } catch (...) {
      return work::failed(std::current_exception());
    }
  }

  // The pre-multiplied-sum operators of one call, destroyed with this object (NCCL allows it as
  // soon as the calls given them returned; destroying them after the group ended is safe also
  // for NCCL releases that read the operator at ncclGroupEnd).
  class premul_ops {
   public:
    premul_ops(ncclComm_t comm, int rank, const std::string& what, std::size_t capacity)
        : comm_(comm), rank_(rank), what_(what) {
      ops_.reserve(capacity);
    }
    premul_ops(const premul_ops&) = delete;
    premul_ops& operator=(const premul_ops&) = delete;
    ~premul_ops() {
      for (const ncclRedOp_t op : ops_) (void)ncclRedOpDestroy(op, comm_);
    }

    // An operator multiplying by `factor` rounded to `type` (a floating dtype), kept until destruction.
    ncclRedOp_t create(dtype type, double factor) {
      switch (type) {
        case dtype::f64: return create_with(type, factor);
        case dtype::f32: return create_with(type, static_cast<float>(factor));
        case dtype::f16: return create_with(type, half(static_cast<float>(factor)));
        case dtype::bf16: return create_with(type, bfloat16(static_cast<float>(factor)));
        default: break;
      }
      return ncclSum;  // integers: not reached (callers sum them as they are)
    }

   private:
    template <class Scalar>
    ncclRedOp_t create_with(dtype type, Scalar scalar) {
      ncclRedOp_t op{};
      check_nccl(ncclRedOpCreatePreMulSum(&op, &scalar, to_nccl(type), ncclScalarHostImmediate, comm_), rank_, what_,
                 "ncclRedOpCreatePreMulSum", comm_);  // a local call: never ncclInProgress
      ops_.push_back(op);                             // capacity reserved: cannot throw
      return op;
    }

    ncclComm_t comm_;
    int rank_;
    const std::string& what_;
    std::vector<ncclRedOp_t> ops_;
  };

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
    try {
      group.end(comm, state_->opts.timeout);
    } catch (const timeout_error& e) {  // NCCL's thread may still enqueue on the stream: stop it
      state_->abort(e.message());
      throw;
    }
  }

  // check_nccl for a collective's enqueue: on a non-blocking communicator it may report
  // ncclInProgress, which is waited for (up to the timeout) before the stream may be used.
  void check_enqueued(ncclResult_t started, int rank, std::string_view what, std::string_view call,
                      ncclComm_t comm) const {
    try {
      detail::check_settled(started, comm, rank, what, call, state_->opts.timeout);
    } catch (const timeout_error& e) {  // NCCL's thread may still enqueue on the stream: stop it
      state_->abort(e.message());
      throw;
    }
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
static_assert(ddp::premul_sum_communicator<communicator>);
static_assert(ddp::device_communicator<communicator>);

}  // namespace ddp::nccl
