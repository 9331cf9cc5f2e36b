#pragma once
/// @file batched_copy.hpp
/// @brief `ddp::cuda::detail::batched_copy_kernel`: many device-to-device copies as a few launches
/// of one copy kernel, which `ddp::cuda::runtime::copy` uses before `cudaMemcpyBatchAsync`. The
/// kernel is PTX (batched_copy_ptx.hpp) that the driver compiles at the first use, so the headers
/// still need no nvcc. Why, and what it measured: docs/gpu-training.md ("Copies of many regions").

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <string_view>
#include <vector>

#include <ddp/cuda/batched_copy_ptx.hpp>
#include <ddp/device_runtime.hpp>

namespace ddp::cuda::detail {

/// One region as the kernel reads it (scripts/ptx/batched_copy.cu's ddp_copy_region).
struct kernel_copy_region {
  std::uint64_t dst = 0;          ///< device address
  std::uint64_t src = 0;          ///< device address
  std::uint64_t bytes = 0;        ///< more than 0
  std::uint64_t first_chunk = 0;  ///< the launch's index of the region's first chunk
};

/// The regions per launch: the kernel's parameter is at most 4 KiB.
inline constexpr std::size_t kernel_copy_batch_regions = 120;

/// The kernel's parameter (ddp_copy_batch): up to 120 regions, cut into chunks of `chunk_bytes`;
/// the launch has one block per chunk.
struct kernel_copy_batch {
  kernel_copy_region region[kernel_copy_batch_regions];  ///< the first `count` are used
  std::uint64_t chunk_bytes = 0;                         ///< bytes a block copies, a multiple of 16
  std::uint32_t count = 0;                               ///< regions used
  std::uint64_t chunks = 0;  ///< blocks of the launch (host side only: past the kernel's layout)
};
static_assert(offsetof(kernel_copy_batch, chunk_bytes) == 3840 && offsetof(kernel_copy_batch, count) == 3848,
              "kernel_copy_batch must match ddp_copy_batch in scripts/ptx/batched_copy.cu (3856 bytes)");

/// Bytes one block copies: 256 threads, 16 bytes a thread, 16 times.
inline constexpr std::size_t kernel_copy_chunk_bytes = std::size_t{64} << 10;

/// The launches that copy `regions` (empty ones skipped), in order, each at most
/// `kernel_copy_batch_regions` regions and `max_chunks` blocks. Pure: the unit tests check it.
[[nodiscard]] inline std::vector<kernel_copy_batch> plan_kernel_copies(
    std::span<const copy_region> regions, std::size_t chunk_bytes = kernel_copy_chunk_bytes,
    std::uint64_t max_chunks = 1u << 30) {
  std::vector<kernel_copy_batch> launches;
  for (const copy_region& r : regions) {
    std::size_t done = 0;
    while (done < r.bytes) {
      if (launches.empty() || launches.back().count == kernel_copy_batch_regions ||
          launches.back().chunks == max_chunks) {
        launches.emplace_back();
        launches.back().chunk_bytes = chunk_bytes;
      }
      kernel_copy_batch& b = launches.back();
      // The part of the region this launch still has blocks for (a huge region spans launches).
      const std::uint64_t chunks_left = (r.bytes - done + chunk_bytes - 1) / chunk_bytes;
      const std::uint64_t chunks = std::min<std::uint64_t>(chunks_left, max_chunks - b.chunks);
      const std::size_t bytes = std::min<std::size_t>(r.bytes - done, static_cast<std::size_t>(chunks * chunk_bytes));
      b.region[b.count++] = {reinterpret_cast<std::uintptr_t>(r.dst) + done,
                             reinterpret_cast<std::uintptr_t>(r.src) + done, bytes, b.chunks};
      b.chunks += chunks;
      done += bytes;
    }
  }
  return launches;
}

/// The copy kernel of one `ddp::cuda::runtime`, loaded at its first use (`cudaLibraryLoadData`,
/// which serves every device). A driver that cannot load it leaves `enqueue` returning false:
/// the runtime then copies as before.
class batched_copy_kernel {
 public:
  batched_copy_kernel() = default;
  batched_copy_kernel(const batched_copy_kernel&) = delete;
  batched_copy_kernel& operator=(const batched_copy_kernel&) = delete;
  ~batched_copy_kernel() {
    if (library_ != nullptr && cudaLibraryUnload(library_) != cudaSuccess) (void)cudaGetLastError();
  }

  /// Enqueues `regions` (independent of each other, non-empty ones at least two) on `stream`,
  /// whose device `device` is current, as kernel launches, and returns true; or returns false
  /// having enqueued nothing: a region's memory is not on `device` (or managed), or the kernel is
  /// not available. A failed launch is returned as its CUDA error in `*launch_error`.
  [[nodiscard]] bool enqueue(std::span<const copy_region> regions, cudaStream_t stream, int device,
                             cudaError_t* launch_error) {
    if (!on_device(regions, device) || !load()) return false;
    for (kernel_copy_batch& batch : plan_kernel_copies(regions)) {
      void* args[] = {&batch};
      const cudaError_t status =
          cudaLaunchKernel(reinterpret_cast<const void*>(kernel_), dim3(static_cast<unsigned>(batch.chunks)), dim3(256),
                           args, 0, stream);
      if (status != cudaSuccess) {
        *launch_error = status;
        return true;
      }
    }
    return true;
  }

 private:
  // Every non-empty region's source and destination is memory of `device` or managed memory
  // (pageable or pinned host memory goes the copy-engine way, as before).
  [[nodiscard]] static bool on_device(std::span<const copy_region> regions, int device) {
    auto usable = [device](const void* p) {
      cudaPointerAttributes a{};
      if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
      }
      return a.type == cudaMemoryTypeManaged || (a.type == cudaMemoryTypeDevice && a.device == device);
    };
    for (const copy_region& r : regions) {
      if (r.bytes != 0 && (!usable(r.dst) || !usable(r.src))) return false;
    }
    return true;
  }

  [[nodiscard]] bool load() {
    std::call_once(loaded_, [this] {
      if (cudaLibraryLoadData(&library_, batched_copy_ptx, nullptr, nullptr, 0, nullptr, nullptr, 0) != cudaSuccess ||
          cudaLibraryGetKernel(&kernel_, library_, "ddp_batched_copy") != cudaSuccess) {
        (void)cudaGetLastError();
        kernel_ = nullptr;
      }
    });
    return kernel_ != nullptr;
  }

  std::once_flag loaded_;
  cudaLibrary_t library_ = nullptr;
  cudaKernel_t kernel_ = nullptr;
};

}  // namespace ddp::cuda::detail
