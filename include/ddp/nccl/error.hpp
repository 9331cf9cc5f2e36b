#pragma once
/// @file error.hpp
/// @brief Translation of NCCL and CUDA status codes into ddp exceptions. Every NCCL and CUDA
/// call of the backend goes through `check_nccl` / `check_cuda`, so a failure always names the
/// rank, the ddp operation and the library call, with the library's own explanation. The CUDA
/// half lives in ddp/cuda/error.hpp (`ddp::cuda::check_cuda`) and is available here under its
/// `ddp::nccl` names.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>
#include <string_view>
#include <utility>

#include <ddp/cuda/error.hpp>
#include <ddp/error.hpp>

namespace ddp::nccl {

/// The exception for a failed NCCL call: "<call> failed: <ncclGetErrorString> (ncclResult_t N);
/// last NCCL error: <ncclGetLastError>".
/// @param result     the failed call's status
/// @param rank       rank that made the call
/// @param operation  the ddp operation it was part of
/// @param call       the NCCL function ("ncclAllReduce", ...)
/// @param comm       communicator the call used, or null (NCCL then reports its last global error)
[[nodiscard]] inline communication_error make_nccl_error(ncclResult_t result, int rank, std::string operation,
                                                         std::string_view call, ncclComm_t comm = nullptr) {
  std::string message = std::string(call) + " failed: " + ncclGetErrorString(result) + " (ncclResult_t " +
                        std::to_string(static_cast<int>(result)) + ")";
  // The last-error text is NCCL's detailed reason ("Cuda failure 'out of memory'", "remote process
  // exited", ...); it is not cleared between calls, so it is reported as context, not as the cause.
  if (const char* last = ncclGetLastError(comm); last != nullptr && *last != '\0') {
    message += "; last NCCL error: ";
    message += last;
  }
  return {rank, std::move(operation), message};
}

/// Throws `make_nccl_error(...)` unless `result` is `ncclSuccess`.
/// @throws communication_error
inline void check_nccl(ncclResult_t result, int rank, std::string_view operation, std::string_view call,
                       ncclComm_t comm = nullptr) {
  if (result != ncclSuccess) throw make_nccl_error(result, rank, std::string(operation), call, comm);
}

/// The CUDA half (ddp/cuda/error.hpp), under the names the NCCL backend always used.
using ddp::cuda::check_cuda;
using ddp::cuda::make_cuda_error;

}  // namespace ddp::nccl
