#pragma once
/// @file error.hpp
/// @brief Translation of CUDA runtime status codes into ddp exceptions. Every CUDA call of ddp
/// (`ddp::cuda::runtime`, the NCCL backend) goes through `check_cuda`, so a failure always names
/// the rank, the ddp operation and the CUDA function, with CUDA's own explanation.

#include <cuda_runtime_api.h>

#include <string>
#include <string_view>
#include <utility>

#include <ddp/error.hpp>

namespace ddp::cuda {

/// The exception for a failed CUDA runtime call: "<call> failed: cudaErrorX: <cudaGetErrorString>".
/// @param status     the failed call's status
/// @param rank       rank that made the call
/// @param operation  the ddp operation it was part of
/// @param call       the CUDA function ("cudaMallocAsync", ...)
[[nodiscard]] inline communication_error make_cuda_error(cudaError_t status, int rank, std::string operation,
                                                         std::string_view call) {
  return {rank, std::move(operation),
          std::string(call) + " failed: " + cudaGetErrorName(status) + ": " + cudaGetErrorString(status)};
}

/// Throws `make_cuda_error(...)` unless `status` is `cudaSuccess`. Clears CUDA's last-error slot
/// first, so a later unrelated `cudaGetLastError()` does not report this failure again (a sticky
/// error, e.g. a failed driver initialisation, is reported again by CUDA itself).
/// @throws communication_error
inline void check_cuda(cudaError_t status, int rank, std::string_view operation, std::string_view call) {
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    throw make_cuda_error(status, rank, std::string(operation), call);
  }
}

}  // namespace ddp::cuda
