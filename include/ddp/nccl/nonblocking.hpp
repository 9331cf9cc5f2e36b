#pragma once
/// @file nonblocking.hpp
/// @brief (detail) NCCL's non-blocking mode (`ncclConfig_t::blocking = 0`): a call on such a
/// communicator may return `ncclInProgress`, and is finished once `ncclCommGetAsyncError` stops
/// saying so. ddp creates communicators this way by default (`options::bounded_init`), so that
/// a set-up whose peer never arrives ends at a deadline instead of blocking forever
/// (docs/backends-nccl.md, "Bounded set-up").

#include <nccl.h>

#include <chrono>
#include <string>
#include <thread>

#include <ddp/error.hpp>
#include <ddp/nccl/error.hpp>
#include <ddp/work.hpp>

namespace ddp::nccl::detail {

/// The outcome of a call that returned `started`: `started` itself unless it is `ncclInProgress`,
/// else what `ncclCommGetAsyncError` says once it stops saying `ncclInProgress`, or
/// `ncclInProgress` if it still does at `deadline` (the caller then aborts the communicator).
[[nodiscard]] inline ncclResult_t settle(ncclComm_t comm, ncclResult_t started, clock::time_point deadline) {
  if (started != ncclInProgress || comm == nullptr) return started;
  for (unsigned idle = 0;; ++idle) {
    ncclResult_t state = ncclInProgress;
    const ncclResult_t queried = ncclCommGetAsyncError(comm, &state);
    if (queried != ncclSuccess) return queried;
    if (state != ncclInProgress) return state;
    if (clock::now() >= deadline) return ncclInProgress;
    if (idle < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
}

/// `check_nccl` for a call on a possibly non-blocking communicator: waits for it to finish (up to
/// `within`); a call still in progress then is a `timeout_error` (the communicator must be
/// aborted: its owner does when it goes).
/// @throws communication_error, timeout_error
inline void check_settled(ncclResult_t started, ncclComm_t comm, int rank, std::string_view operation,
                          std::string_view call, std::chrono::milliseconds within) {
  const ncclResult_t r = settle(comm, started, clock::now() + within);
  if (r == ncclInProgress) {
    throw timeout_error(rank, std::string(operation),
                        std::string(call) + " did not finish within " + std::to_string(within.count()) +
                            " ms (a non-blocking NCCL communicator still reports ncclInProgress)");
  }
  check_nccl(r, rank, operation, call, comm);
}

}  // namespace ddp::nccl::detail
