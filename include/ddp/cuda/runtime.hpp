#pragma once
/// @file runtime.hpp
/// @brief `ddp::cuda::runtime`: the `ddp::device_runtime` over the CUDA runtime API (host
/// compiler, no nvcc needed; link `ddp::cuda`), and the conversions between CUDA's handles and
/// the runtime-neutral `device_stream` / `device_event`.
///
/// Which CUDA call each operation is, the current device, errors and threads:
/// docs/gpu-training.md ("The CUDA runtime").

#include <cuda.h>  // the driver API's types, for cuStreamWaitValue32 (reached through the runtime)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/cuda/batched_copy.hpp>
#include <ddp/cuda/device_guard.hpp>
#include <ddp/cuda/error.hpp>
#include <ddp/device.hpp>
#include <ddp/device_runtime.hpp>
#include <ddp/error.hpp>

/// 1 when `cudaMemcpyBatchAsync` is used for copies of several regions: CUDA 13's signature (the
/// one without `failIdx`; CUDA 12.8's differs and is not used). Predefine it to 0 to always copy
/// region by region.
#ifndef DDP_CUDA_HAS_MEMCPY_BATCH
#if CUDART_VERSION >= 13000
#define DDP_CUDA_HAS_MEMCPY_BATCH 1
#else
#define DDP_CUDA_HAS_MEMCPY_BATCH 0
#endif
#endif

namespace ddp::cuda {

/// `s` as a runtime-neutral stream handle (not owned).
[[nodiscard]] inline device_stream stream(cudaStream_t s) noexcept { return device_stream{static_cast<void*>(s)}; }
/// `e` as a runtime-neutral event handle (not owned).
[[nodiscard]] inline device_event event(cudaEvent_t e) noexcept { return device_event{static_cast<void*>(e)}; }
/// The CUDA stream behind `s` (null: the legacy default stream).
[[nodiscard]] inline cudaStream_t native(device_stream s) noexcept { return static_cast<cudaStream_t>(s.native); }
/// The CUDA event behind `e` (null: no event).
[[nodiscard]] inline cudaEvent_t native(device_event e) noexcept { return static_cast<cudaEvent_t>(e.native); }

namespace detail {

/// True when no region's destination overlaps another region's source or destination (or its
/// own source), so the copies may run in any order: the condition for one batched call. Empty
/// regions take no part.
[[nodiscard]] inline bool independent(std::span<const copy_region> regions) {
  struct interval {
    std::uintptr_t begin;
    std::uintptr_t end;
    bool write;
  };
  std::vector<interval> all;
  all.reserve(2 * regions.size());
  for (const copy_region& r : regions) {
    if (r.bytes == 0) continue;
    const auto d = reinterpret_cast<std::uintptr_t>(r.dst);
    const auto s = reinterpret_cast<std::uintptr_t>(r.src);
    all.push_back({d, d + r.bytes, true});
    all.push_back({s, s + r.bytes, false});
  }
  std::sort(all.begin(), all.end(), [](const interval& a, const interval& b) { return a.begin < b.begin; });
  // Sweep by start: an interval overlaps an earlier-starting one iff it starts before that one's end.
  std::uintptr_t end_any = 0;
  std::uintptr_t end_write = 0;
  for (const interval& i : all) {
    if (i.begin < end_write || (i.write && i.begin < end_any)) return false;
    end_any = std::max(end_any, i.end);
    if (i.write) end_write = std::max(end_write, i.end);
  }
  return true;
}

/// `cuStreamWaitValue32`, reached through the runtime's driver entry point (no link to libcuda).
using stream_wait_value32 = CUresult(CUDAAPI*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

/// The words gates are made of: 32-bit words of page-locked host memory mapped into the device's
/// address space, reused (freeing page-locked memory waits for the device), freed with the runtime.
class gate_words {
 public:
  gate_words() = default;
  gate_words(const gate_words&) = delete;
  gate_words& operator=(const gate_words&) = delete;
  ~gate_words() {
    for (std::uint32_t* w : all_) (void)cudaFreeHost(w);
  }
  /// A word set to 0 (closed). @throws communication_error
  std::uint32_t* take(int rank) {
    std::lock_guard lk(m_);
    std::uint32_t* w = nullptr;
    if (!free_.empty()) {
      w = free_.back();
      free_.pop_back();
    } else {
      all_.reserve(all_.size() + 1);
      free_.reserve(all_.size() + 1);  // give_back never allocates
      void* p = nullptr;
      check_cuda(cudaHostAlloc(&p, sizeof(std::uint32_t), cudaHostAllocMapped | cudaHostAllocPortable), rank,
                 "cuda::runtime::create_gate", "cudaHostAlloc");
      w = static_cast<std::uint32_t*>(p);
      all_.push_back(w);
    }
    std::atomic_ref<std::uint32_t>(*w).store(0, std::memory_order_release);
    return w;
  }
  /// Back for reuse (the stream passed its wait).
  void give_back(std::uint32_t* w) noexcept {
    std::lock_guard lk(m_);
    free_.push_back(w);  // capacity reserved in take
  }

 private:
  std::mutex m_;
  std::vector<std::uint32_t*> all_;
  std::vector<std::uint32_t*> free_;
};

}  // namespace detail

/// The CUDA runtime API as a `ddp::device_runtime` (see the file comment).
class runtime final : public device_runtime {
 public:
  /// A runtime whose errors name `rank`. Touches no device: a machine without one fails on the
  /// first call that needs it, not here.
  explicit runtime(int rank) noexcept : rank_(rank) {}

  /// The rank its errors name.
  [[nodiscard]] int rank() const noexcept { return rank_; }

  /// "cuda".
  [[nodiscard]] std::string_view name() const noexcept override { return "cuda"; }

  /// `cudaMallocAsync` on `stream` with `where` current (the stream must belong to `where`, or
  /// be the legacy default stream). Null for 0 bytes.
  /// @throws usage_error if `where` is not a CUDA device; communication_error if CUDA fails
  [[nodiscard]] void* allocate(device where, std::size_t bytes, device_stream stream) override {
    const char* const operation = "cuda::runtime::allocate";
    require_cuda(where, operation);
    if (bytes == 0) return nullptr;
    device_guard on_device(where.index, rank_, operation);
    void* memory = nullptr;
    check_cuda(cudaMallocAsync(&memory, bytes, native(stream)), rank_, operation, "cudaMallocAsync");
    return memory;
  }

  /// `cudaFreeAsync` on `stream`; null is ignored. Errors cannot be reported here and are dropped.
  void deallocate(void* memory, device_stream stream) noexcept override {
    if (memory == nullptr) return;
    if (cudaFreeAsync(memory, native(stream)) != cudaSuccess) (void)cudaGetLastError();
  }

  /// Two or more non-empty regions that may run in any order: all in the stream's device memory
  /// (or managed), a few launches of one copy kernel (batched_copy.hpp); else one
  /// `cudaMemcpyBatchAsync` (on a stream other than the legacy default one, which the batch call
  /// refuses). Otherwise one `cudaMemcpyAsync(cudaMemcpyDefault)` per non-empty region, in order.
  /// The host memory of a region must stay valid until the stream reached the copy.
  /// @throws communication_error
  void copy(std::span<const copy_region> regions, device_stream stream) override {
    const char* const operation = "cuda::runtime::copy";
    std::size_t non_empty = 0;
    for (const copy_region& r : regions) non_empty += r.bytes > 0 ? 1 : 0;
    if (non_empty == 0) return;
    const stream_device_guard on_device(stream, rank_, operation);
    const bool independent = non_empty > 1 && detail::independent(regions);
    if (independent) {
      int current = 0;
      check_cuda(cudaGetDevice(&current), rank_, operation, "cudaGetDevice");
      cudaError_t launch = cudaSuccess;
      if (kernel_.enqueue(regions, native(stream), current, &launch)) {
        check_cuda(launch, rank_, operation, "cudaLaunchKernel (ddp_batched_copy)");
        return;
      }
    }
#if DDP_CUDA_HAS_MEMCPY_BATCH
    if (independent && !is_legacy(stream)) {
      std::vector<void*> dsts;
      std::vector<const void*> srcs;
      std::vector<std::size_t> sizes;
      dsts.reserve(non_empty);
      srcs.reserve(non_empty);
      sizes.reserve(non_empty);
      for (const copy_region& r : regions) {
        if (r.bytes == 0) continue;
        dsts.push_back(r.dst);
        srcs.push_back(r.src);
        sizes.push_back(r.bytes);
      }
      cudaMemcpyAttributes attributes{};
      attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      std::size_t first_copy = 0;
      check_cuda(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), non_empty, &attributes, &first_copy, 1,
                                      native(stream)),
                 rank_, operation, "cudaMemcpyBatchAsync");
      return;
    }
#endif
    for (const copy_region& r : regions) {
      if (r.bytes == 0) continue;
      check_cuda(cudaMemcpyAsync(r.dst, r.src, r.bytes, cudaMemcpyDefault, native(stream)), rank_, operation,
                 "cudaMemcpyAsync");
    }
  }

  /// `cudaMemsetAsync(memory, 0, bytes)` on `stream`, with the stream's device current.
  /// @throws communication_error
  void zero(void* memory, std::size_t bytes, device_stream stream) override {
    const char* const operation = "cuda::runtime::zero";
    if (bytes == 0) return;
    const stream_device_guard on_device(stream, rank_, operation);
    check_cuda(cudaMemsetAsync(memory, 0, bytes, native(stream)), rank_, operation, "cudaMemsetAsync");
  }

  /// `cudaStreamCreateWithFlags(cudaStreamNonBlocking)` on `where`.
  /// @throws usage_error if `where` is not a CUDA device; communication_error if CUDA fails
  [[nodiscard]] device_stream create_stream(device where) override {
    const char* const operation = "cuda::runtime::create_stream";
    require_cuda(where, operation);
    device_guard on_device(where.index, rank_, operation);
    cudaStream_t s = nullptr;
    check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), rank_, operation, "cudaStreamCreateWithFlags");
    return cuda::stream(s);
  }

  /// `cudaStreamDestroy` (CUDA releases the stream once its work completed); null is ignored.
  void destroy_stream(device_stream stream) noexcept override {
    if (stream.native == nullptr) return;
    if (cudaStreamDestroy(native(stream)) != cudaSuccess) (void)cudaGetLastError();
  }

  /// `cudaEventCreateWithFlags(cudaEventDisableTiming)` on `where`.
  /// @throws usage_error if `where` is not a CUDA device; communication_error if CUDA fails
  [[nodiscard]] device_event create_event(device where) override {
    const char* const operation = "cuda::runtime::create_event";
    require_cuda(where, operation);
    device_guard on_device(where.index, rank_, operation);
    cudaEvent_t e = nullptr;
    check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), rank_, operation, "cudaEventCreateWithFlags");
    return cuda::event(e);
  }

  /// `cudaEventDestroy`; null is ignored.
  void destroy_event(device_event event) noexcept override {
    if (!event) return;
    if (cudaEventDestroy(native(event)) != cudaSuccess) (void)cudaGetLastError();
  }

  /// `cudaEventRecord(event, stream)`; event and stream must belong to the same device.
  /// @throws communication_error
  void record(device_event event, device_stream stream) override {
    check_cuda(cudaEventRecord(native(event), native(stream)), rank_, "cuda::runtime::record", "cudaEventRecord");
  }

  /// `cudaStreamWaitEvent(stream, event)`: device-side, the host does not block.
  /// @throws communication_error
  void wait(device_stream stream, device_event event) override {
    check_cuda(cudaStreamWaitEvent(native(stream), native(event), 0), rank_, "cuda::runtime::wait",
               "cudaStreamWaitEvent");
  }

  /// `cudaEventQuery`: true on `cudaSuccess`, false on `cudaErrorNotReady`.
  /// @throws communication_error on any other status (e.g. a failed kernel before the event)
  [[nodiscard]] bool query(device_event event) override {
    const cudaError_t status = cudaEventQuery(native(event));
    if (status == cudaErrorNotReady) return false;
    check_cuda(status, rank_, "cuda::runtime::query", "cudaEventQuery");
    return true;
  }

  /// `cudaEventSynchronize`: blocks the host.
  /// @throws communication_error
  void synchronize(device_event event) override {
    check_cuda(cudaEventSynchronize(native(event)), rank_, "cuda::runtime::synchronize", "cudaEventSynchronize");
  }

  // ---- host staging ---------------------------------------------------------------------------

  /// `cudaHostAlloc` (page-locked, portable). Null for 0 bytes. @throws communication_error
  [[nodiscard]] void* allocate_host(std::size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* memory = nullptr;
    check_cuda(cudaHostAlloc(&memory, bytes, cudaHostAllocPortable), rank_, "cuda::runtime::allocate_host",
               "cudaHostAlloc");
    return memory;
  }
  /// `cudaFreeHost` (which waits for the device: free outside the hot path). Errors are dropped.
  void deallocate_host(void* memory) noexcept override {
    if (memory != nullptr && cudaFreeHost(memory) != cudaSuccess) (void)cudaGetLastError();
  }
  /// A word of page-locked host memory mapped into the device, 0 while closed. Gates are reused:
  /// `destroy_gate` only once the stream passed its wait.
  /// @throws communication_error
  [[nodiscard]] device_gate create_gate() override { return {gate_words_.take(rank_)}; }
  /// `cuStreamWaitValue32(stream, word, 1, GEQ)`: the device waits for the word, no host thread
  /// does. @throws communication_error, also where the driver lacks stream memory operations
  void wait_gate(device_stream stream, device_gate gate) override {
    const char* const operation = "cuda::runtime::wait_gate";
    void* on_device = nullptr;
    check_cuda(cudaHostGetDevicePointer(&on_device, gate.native, 0), rank_, operation, "cudaHostGetDevicePointer");
    const CUresult r = stream_wait_value()(static_cast<CUstream>(stream.native),
                                           reinterpret_cast<CUdeviceptr>(on_device), 1, CU_STREAM_WAIT_VALUE_GEQ);
    if (r != CUDA_SUCCESS) {
      throw communication_error(rank_, operation,
                                "cuStreamWaitValue32 failed with CUresult " + std::to_string(static_cast<int>(r)) +
                                    " (does the driver offer stream memory operations?)");
    }
  }
  /// Writes 1 to the gate's word (any thread).
  void open_gate(device_gate gate) noexcept override {
    if (gate.native != nullptr) {
      std::atomic_ref<std::uint32_t>(*static_cast<std::uint32_t*>(gate.native)).store(1, std::memory_order_release);
    }
  }
  /// Back for reuse; the stream must have passed its wait.
  void destroy_gate(device_gate gate) noexcept override {
    if (gate.native != nullptr) gate_words_.give_back(static_cast<std::uint32_t*>(gate.native));
  }

 private:
  // Makes the device of a stream current for a copy or fill (the legacy default stream belongs
  // to whatever device is current: nothing changes then). Without cudaStreamGetDevice (before
  // CUDA 12.8) nothing changes either: copies then run on any stream, fills need it current.
  class stream_device_guard {
   public:
    stream_device_guard(device_stream stream, int rank, std::string_view operation) {
#if CUDART_VERSION >= 12080
      if (is_legacy(stream)) return;
      int device = 0;
      check_cuda(cudaStreamGetDevice(native(stream), &device), rank, operation, "cudaStreamGetDevice");
      check_cuda(cudaGetDevice(&previous_), rank, operation, "cudaGetDevice");
      if (previous_ != device) {
        check_cuda(cudaSetDevice(device), rank, operation, "cudaSetDevice");
        switched_ = true;
      }
#else
      (void)stream;
      (void)rank;
      (void)operation;
#endif
    }
    stream_device_guard(const stream_device_guard&) = delete;
    stream_device_guard& operator=(const stream_device_guard&) = delete;
    ~stream_device_guard() {
      if (switched_) (void)cudaSetDevice(previous_);
    }

   private:
    int previous_ = 0;
    bool switched_ = false;
  };

  // The legacy default stream: null or cudaStreamLegacy.
  [[nodiscard]] static bool is_legacy(device_stream s) noexcept {
    return s.native == nullptr || native(s) == cudaStreamLegacy;
  }

  void require_cuda(device where, const char* operation) const {
    if (!where.is_cuda()) {
      throw usage_error(rank_, operation, "the CUDA runtime needs a CUDA device, got " + where.str());
    }
  }

  // cuStreamWaitValue32 from the driver, looked up once. @throws communication_error if absent
  detail::stream_wait_value32 stream_wait_value() {
    std::call_once(wait_value_once_, [this] {
      void* fn = nullptr;
      cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
      const cudaError_t e =
          cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &fn, 12000, cudaEnableDefault, &found);
#else
      const cudaError_t e = cudaGetDriverEntryPoint("cuStreamWaitValue32", &fn, cudaEnableDefault, &found);
#endif
      if (e == cudaSuccess && found == cudaDriverEntryPointSuccess)
        wait_value_ = reinterpret_cast<detail::stream_wait_value32>(fn);
    });
    if (wait_value_ == nullptr) {
      throw communication_error(rank_, "cuda::runtime::wait_gate",
                                "the CUDA driver has no cuStreamWaitValue32: gates (ddp::staged) need it");
    }
    return wait_value_;
  }

  int rank_;
  detail::batched_copy_kernel kernel_;  // loaded at the first copy it serves
  detail::gate_words gate_words_;       // gates, reused
  std::once_flag wait_value_once_;
  detail::stream_wait_value32 wait_value_ = nullptr;
};

}  // namespace ddp::cuda
