#pragma once
/// @file device.hpp
/// @brief CUDA device discovery and selection for the NCCL backend, and the check that a tensor
/// lives on the communicator's device.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>
#include <string_view>

#include <ddp/backend_contract.hpp>
#include <ddp/cuda/device_guard.hpp>
#include <ddp/device.hpp>
#include <ddp/error.hpp>
#include <ddp/nccl/error.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp::nccl {

/// Result of asking the CUDA runtime how many devices this process sees.
struct device_count {
  int count = 0;  ///< 0 whenever `status` is not cudaSuccess
  cudaError_t status =
      cudaSuccess;  ///< why no device is visible, e.g. cudaErrorNoDevice or cudaErrorInsufficientDriver
};

/// Number of CUDA devices visible to this process. Never throws: "no device" is an answer here.
/// `cudaGetDeviceCount` leaves its output untouched on failure (seen with error 35, no driver),
/// so the count starts at 0 and is forced to 0 on any error.
[[nodiscard]] inline device_count visible_devices() noexcept {
  device_count result;
  result.status = cudaGetDeviceCount(&result.count);
  if (result.status != cudaSuccess) {
    result.count = 0;
    (void)cudaGetLastError();  // reported through `status`; clears the (non-sticky) last-error slot
  }
  return result;
}

/// Why `device` is not usable on this rank, or "" if it is.
[[nodiscard]] inline std::string device_problem(int rank, int device, const device_count& visible) {
  if (visible.count == 0) {
    std::string why = "no CUDA device visible on rank " + std::to_string(rank) + ": ";
    why += visible.status == cudaSuccess
               ? std::string("cudaGetDeviceCount reports 0 devices")
               : std::string("cudaGetDeviceCount failed with ") + cudaGetErrorName(visible.status) + ": " +
                     cudaGetErrorString(visible.status);
    return why + " (check the driver, CUDA_VISIBLE_DEVICES and the container's GPU access)";
  }
  if (device < 0 || device >= visible.count) {
    return "CUDA device " + std::to_string(device) + " requested on rank " + std::to_string(rank) + ", but only " +
           std::to_string(visible.count) + " device(s) are visible (ordinals 0.." + std::to_string(visible.count - 1) +
           ")";
  }
  return {};
}

/// Throws a usage_error explaining why `device` cannot be used on this rank (no device at all,
/// or an ordinal out of range).
/// @throws usage_error
inline void require_device(int rank, int device, std::string_view operation,
                           const device_count& visible = visible_devices()) {
  if (std::string why = device_problem(rank, device, visible); !why.empty()) {
    throw usage_error(rank, std::string(operation), why);
  }
}

/// Makes a device current for a scope (ddp/cuda/device_guard.hpp), under its old `ddp::nccl` name.
using ddp::cuda::device_guard;

/// The memory the NCCL backend's collectives accept on the device path: CUDA memory of the
/// communicator's `device` (a call whose tensors are all host memory is staged instead).
[[nodiscard]] constexpr contract::memory_rule memory_on(int device) noexcept {
  return contract::memory_rule::cuda(device, "the NCCL backend",
                                     "the communicator's device; or host memory for every tensor of a call, staged");
}

/// Checks that a collective's tensor is CUDA memory on the communicator's device (as declared by
/// the tensor's traits) and has data if it has elements: `contract::check_memory` with
/// `memory_on(device)`.
/// @throws usage_error naming the rank, the operation and both devices
inline void require_on_device(const tensor_view& t, int device, const op_info& info) {
  contract::check_memory(info, memory_on(device), t);
}

}  // namespace ddp::nccl
