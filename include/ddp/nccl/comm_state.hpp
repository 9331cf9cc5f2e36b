#pragma once
/// @file comm_state.hpp
/// @brief (detail) What an NCCL communicator and its pending work handles share: the ncclComm_t,
/// the stream, the CUDA device runtime, and whether the communicator was aborted or revoked.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <ddp/cuda/runtime.hpp>
#include <ddp/error.hpp>
#include <ddp/nccl/error.hpp>
#include <ddp/nccl/event.hpp>
#include <ddp/nccl/nonblocking.hpp>
#include <ddp/nccl/options.hpp>
#include <ddp/work.hpp>

namespace ddp::nccl::detail {

enum class comm_status : unsigned char { healthy, revoked, aborted };

/// Owned by the communicator and by every work handle it issued, so a handle outliving its
/// communicator still reports the right outcome. Resources are released when the last owner goes.
class comm_state {
 public:
  comm_state(int rank, int size, int device, options opts)
      : rank(rank), size(size), device(device), opts(std::move(opts)) {}
  comm_state(const comm_state&) = delete;
  comm_state& operator=(const comm_state&) = delete;

  /// Nothing here can report an error, so failures are ignored. A healthy communicator is
  /// destroyed (`ncclCommDestroy` waits for its in-flight collectives; a non-blocking one is
  /// finalized first, up to `opts.timeout`); one that failed, was revoked or reports an
  /// asynchronous error is aborted, which never waits for peers.
  ~comm_state() {
    int previous = device;
    const bool switched =
        cudaGetDevice(&previous) == cudaSuccess && previous != device && cudaSetDevice(device) == cudaSuccess;
    if (comm != nullptr && status_ != comm_status::aborted) {
      ncclResult_t async = ncclSuccess;
      const bool clean =
          status_ == comm_status::healthy && ncclCommGetAsyncError(comm, &async) == ncclSuccess && async == ncclSuccess;
      if (clean && opts.bounded_init) {  // non-blocking: finalize, wait for it, then destroy
        const ncclResult_t finalized = settle(comm, ncclCommFinalize(comm), clock::now() + opts.timeout);
        (void)(finalized == ncclSuccess ? ncclCommDestroy(comm) : ncclCommAbort(comm));
      } else {
        (void)(clean ? ncclCommDestroy(comm) : ncclCommAbort(comm));
      }
    }
    if (barrier_buffer != nullptr) (void)cudaFree(barrier_buffer);
    if (owns_stream && stream != nullptr) (void)cudaStreamDestroy(stream);
    if (switched) (void)cudaSetDevice(previous);
  }

  /// Creates the stream (unless the caller gave one), the stream-ordering events and the barrier
  /// buffer; `device` must be current. Separate from the constructor so that, when a step fails,
  /// the destructor still releases what the earlier steps created. `comm` is set by the caller.
  /// @throws communication_error
  void acquire(std::string_view operation) {
    runtime.emplace(rank);
    if (opts.stream != nullptr) {
      stream = opts.stream;
    } else {
      check_cuda(cudaStreamCreate(&stream), rank, operation, "cudaStreamCreate");
      owns_stream = true;
    }
    producer_done = event::create(rank, operation);
    collectives_done = event::create(rank, operation);
    check_cuda(cudaMalloc(&barrier_buffer, sizeof(int)), rank, operation, "cudaMalloc");
    check_cuda(cudaMemset(barrier_buffer, 0, sizeof(int)), rank, operation, "cudaMemset");
  }

  /// The handle for a new operation.
  /// @throws usage_error after abort() or revoke()
  ncclComm_t usable_handle(std::string_view operation) const {
    std::lock_guard lock(m_);
    switch (status_) {
      case comm_status::healthy: break;
      case comm_status::aborted:
        throw usage_error(rank, std::string(operation), "communicator used after abort() (" + reason_ + ")");
      case comm_status::revoked:
        throw usage_error(rank, std::string(operation),
                          "communicator used after revoke() (" + reason_ + "); shrink it or create a new one");
    }
    return comm;
  }

  /// The handle for revoke/shrink, which are allowed on a revoked communicator.
  /// @throws usage_error after abort()
  ncclComm_t management_handle(std::string_view operation) const {
    std::lock_guard lock(m_);
    if (status_ == comm_status::aborted) {
      throw usage_error(rank, std::string(operation), "communicator used after abort() (" + reason_ + ")");
    }
    return comm;
  }

  /// Why pending work cannot complete any more, or "" while the communicator is healthy.
  [[nodiscard]] std::string failure() const {
    std::lock_guard lock(m_);
    switch (status_) {
      case comm_status::healthy: return {};
      case comm_status::aborted: return "the communicator was aborted (" + reason_ + ")";
      case comm_status::revoked: return "the communicator was revoked (" + reason_ + ")";
    }
    return {};
  }

  /// Polls `ncclCommGetAsyncError`. On an error, aborts the communicator (NCCL's advice: a
  /// communicator with an asynchronous error cannot recover) and throws it.
  /// @throws communication_error naming `info`
  void check_async(const op_info& info) {
    std::unique_lock lock(m_);
    if (status_ != comm_status::healthy || comm == nullptr) return;
    ncclResult_t async = ncclSuccess;
    const ncclResult_t queried = ncclCommGetAsyncError(comm, &async);
    if (queried == ncclSuccess && (async == ncclSuccess || async == ncclInProgress)) return;
    const communication_error e =
        queried != ncclSuccess
            ? make_nccl_error(queried, info.rank, info.describe(), "ncclCommGetAsyncError", comm)
            : make_nccl_error(async, info.rank, info.describe(), "asynchronous NCCL operation", comm);
    abort_locked(std::string("after an asynchronous error: ") + e.what());
    throw e;
  }

  /// `ncclCommAbort` (once): pending work then fails, later use throws usage_error.
  void abort(std::string why) noexcept {
    std::lock_guard lock(m_);
    abort_locked(std::move(why));
  }

  /// Records that ncclCommRevoke succeeded.
  void mark_revoked(std::string why) {
    std::lock_guard lock(m_);
    if (status_ == comm_status::healthy) {
      status_ = comm_status::revoked;
      reason_ = std::move(why);
    }
  }

  int rank;
  int size;
  const int device;
  const options opts;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  bool owns_stream = false;
  event producer_done;     ///< recorded on a producer stream by enqueue_after
  event collectives_done;  ///< recorded on `stream` by stream_wait
  void* barrier_buffer = nullptr;
  /// The device runtime of `device_queue()` (memory, copies and events ordered on `stream`) and of
  /// host staging; set by `acquire`, re-made when `rank` changes (shrink) so errors name the rank.
  /// Lives as long as the communicator or any of its work handles.
  std::optional<cuda::runtime> runtime;

 private:
  void abort_locked(std::string why) noexcept {
    if (status_ == comm_status::aborted) return;
    if (comm != nullptr) {
      int previous = device;
      const bool switched =
          cudaGetDevice(&previous) == cudaSuccess && previous != device && cudaSetDevice(device) == cudaSuccess;
      (void)ncclCommAbort(comm);  // frees the communicator, even when it reports an error
      if (switched) (void)cudaSetDevice(previous);
    }
    comm = nullptr;
    status_ = comm_status::aborted;
    reason_ = std::move(why);
  }

  mutable std::mutex m_;
  comm_status status_ = comm_status::healthy;
  std::string reason_;
};

}  // namespace ddp::nccl::detail
