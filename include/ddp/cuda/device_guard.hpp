#pragma once
/// @file device_guard.hpp
/// @brief `ddp::cuda::device_guard`: makes a CUDA device current for a scope and restores the
/// caller's device afterwards, so ddp never changes the device a trainer thread works on.

#include <cuda_runtime_api.h>

#include <string_view>

#include <ddp/cuda/error.hpp>

namespace ddp::cuda {

/// Makes `device` current for its lifetime (only when it is not current already: `cudaSetDevice`
/// is then not called) and restores the caller's device afterwards. The current device is per
/// host thread, so guards on different threads do not interfere.
class device_guard {
 public:
  /// @param device     CUDA device ordinal to make current
  /// @param rank       for error messages
  /// @param operation  the ddp operation, for error messages
  /// @throws communication_error if the device cannot be queried or selected (e.g. no driver)
  device_guard(int device, int rank, std::string_view operation) {
    check_cuda(cudaGetDevice(&previous_), rank, operation, "cudaGetDevice");
    if (previous_ != device) check_cuda(cudaSetDevice(device), rank, operation, "cudaSetDevice");
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  ~device_guard() {
    int current = previous_;
    if (cudaGetDevice(&current) == cudaSuccess && current != previous_) (void)cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
};

}  // namespace ddp::cuda
