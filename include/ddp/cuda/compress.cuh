#pragma once
/// @file cuda/compress.cuh
/// @brief f16/bf16 gradient compression on the GPU: the conversion kernels (the average's division
/// folded into the narrowing) and the device comm hooks `ddp::cuda::hooks::fp16_compress` and
/// `ddp::cuda::hooks::bf16_compress`, the counterparts of the host hooks of
/// <ddp/hooks/compress.hpp> for buckets in device memory.
///
/// CUDA source: include it from a `.cu` file compiled by nvcc; host-only code never includes it.
/// What a hook enqueues, its scratch buffer and which buckets need no compression:
/// docs/gpu-training.md ("Compression hooks on the device").

#if !defined(__CUDACC__)
#error "compile this header with nvcc (ddp/cuda/compress.cuh has CUDA kernels)"
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include <ddp/average.hpp>
#include <ddp/comm_hook.hpp>
#include <ddp/cuda/device_guard.hpp>
#include <ddp/cuda/error.hpp>
#include <ddp/cuda/runtime.hpp>
#include <ddp/device_runtime.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/hooks/compress.hpp>
#include <ddp/reduce_op.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp::cuda {

namespace kernels {

/// The narrow (wire) element types and their conversions from and to float, rounding to nearest
/// even (the host types' rule, ddp/dtype.hpp).
template <class W>
__device__ __forceinline__ W narrow(float v);
template <>
__device__ __forceinline__ __half narrow<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 narrow<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
__device__ __forceinline__ float widen(__half v) { return __half2float(v); }
__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }

/// `dst[i] = W(float(src[i] * factor))`: the product in the source type (the averaging rule:
/// `factor` is `1/divisor` rounded to S), then narrowed through float as the host conversion does.
template <class S, class W>
__global__ void compress_scaled(const S* __restrict__ src, W* __restrict__ dst, std::size_t n, S factor) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const S scaled = src[i] * factor;
    dst[i] = narrow<W>(static_cast<float>(scaled));
  }
}

/// `dst[i] = D(widen(src[i]))` (exact: every f16 and bf16 value is a float and a double).
template <class W, class D>
__global__ void decompress(const W* __restrict__ src, D* __restrict__ dst, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    dst[i] = static_cast<D>(widen(src[i]));
  }
}

/// Threads per block of the conversion kernels.
inline constexpr unsigned block_size = 256;

/// Blocks for `n` elements: one element per thread, at most 8192 blocks (a grid-stride loop
/// covers the rest; 8192 x 256 threads keep every SM of an H100 busy).
[[nodiscard]] inline unsigned grid_size(std::size_t n) noexcept {
  return static_cast<unsigned>(std::clamp<std::size_t>((n + block_size - 1) / block_size, 1, 8192));
}

}  // namespace kernels

namespace detail {

[[noreturn]] inline void bad_conversion(int rank, const char* operation, const tensor_view& a, const tensor_view& b,
                                        const char* rule) {
  throw usage_error(rank, operation,
                    std::string(name_of(a.type)) + " x " + std::to_string(a.count) + " on " + a.where.str() + " -> " +
                        std::string(name_of(b.type)) + " x " + std::to_string(b.count) + " on " + b.where.str() + ": " +
                        rule);
}

inline void check_pair(int rank, const char* operation, const tensor_view& wide, const tensor_view& wire) {
  if (wide.type != dtype::f32 && wide.type != dtype::f64) {
    bad_conversion(rank, operation, wide, wire, "the wide side must be f32 or f64");
  }
  if (wire.type != dtype::f16 && wire.type != dtype::bf16) {
    bad_conversion(rank, operation, wide, wire, "the wire side must be f16 or bf16");
  }
  if (wide.count != wire.count) bad_conversion(rank, operation, wide, wire, "element counts differ");
  if (!wide.where.is_cuda() || wide.where != wire.where) {
    bad_conversion(rank, operation, wide, wire, "both must be memory of the same CUDA device");
  }
}

// Calls fn(S{}, W{}) with the CUDA element types of a checked (wide, wire) pair.
template <class F>
void visit_pair(dtype wide, dtype wire, F&& fn) {
  const bool half_wire = wire == dtype::f16;
  if (wide == dtype::f32) {
    half_wire ? fn(float{}, __half{}) : fn(float{}, __nv_bfloat16{});
  } else {
    half_wire ? fn(double{}, __half{}) : fn(double{}, __nv_bfloat16{});
  }
}

}  // namespace detail

/// Enqueues on `stream` the narrowing of `src` (f32 or f64) into `wire` (f16 or bf16, same count,
/// same device): `wire[i] = narrow(src[i] * factor)`, the product rounded to the source type
/// first (with `factor = 1.0 / divisor`: ddp's averaging rule). The stream's device must be
/// current. Returns at once.
/// @param rank  for error messages
/// @throws usage_error on other dtypes, differing counts or devices; communication_error if the
///   launch fails
inline void compress(const tensor_view& src, const tensor_view& wire, double factor, cudaStream_t stream,
                     int rank = -1) {
  const char* const operation = "cuda::compress";
  detail::check_pair(rank, operation, src, wire);
  if (src.count == 0) return;
  detail::visit_pair(src.type, wire.type, [&]<class S, class W>(S, W) {
    kernels::compress_scaled<S, W><<<kernels::grid_size(src.count), kernels::block_size, 0, stream>>>(
        static_cast<const S*>(src.data), static_cast<W*>(wire.data), src.count, static_cast<S>(factor));
  });
  check_cuda(cudaGetLastError(), rank, operation, "kernel launch (compress_scaled)");
}

/// Enqueues on `stream` the widening of `wire` (f16 or bf16) into `dst` (f32 or f64, same count,
/// same device); exact. The stream's device must be current. Returns at once.
/// @throws as `compress`
inline void decompress(const tensor_view& wire, const tensor_view& dst, cudaStream_t stream, int rank = -1) {
  const char* const operation = "cuda::decompress";
  detail::check_pair(rank, operation, dst, wire);
  if (dst.count == 0) return;
  detail::visit_pair(dst.type, wire.type, [&]<class D, class W>(D, W) {
    kernels::decompress<W, D><<<kernels::grid_size(dst.count), kernels::block_size, 0, stream>>>(
        static_cast<const W*>(wire.data), static_cast<D*>(dst.data), dst.count);
  });
  check_cuda(cudaGetLastError(), rank, operation, "kernel launch (decompress)");
}

namespace hooks {

namespace detail {

/// The scratch buffers of a compression hook, one per communicator stream and bucket index,
/// shared by the hook's copies (so one hook may serve several Bucketers, on several
/// communicators) and kept alive by the works it returned.
class compress_scratch {
 public:
  /// One bucket's buffer, and the event recorded after its last decompression.
  struct slot {
    device_runtime* runtime = nullptr;
    device_stream stream;
    void* memory = nullptr;
    std::size_t bytes = 0;
    device_event done;
  };

  compress_scratch() = default;
  compress_scratch(const compress_scratch&) = delete;
  compress_scratch& operator=(const compress_scratch&) = delete;
  /// Frees every buffer on the stream it was allocated on (stream-ordered: after the work that
  /// uses it), so the communicators must still exist.
  ~compress_scratch() {
    for (auto& [key, s] : slots_) {
      s.runtime->deallocate(s.memory, s.stream);
      s.runtime->destroy_event(s.done);
    }
  }

  /// Serialises the hook's calls (copies of a hook may run in several Bucketers' threads).
  std::mutex mutex;

  /// Bucket `index`'s buffer of at least `bytes` on `q`'s stream, allocated there when missing or
  /// too small. Call with `mutex` held.
  slot& get(std::size_t index, const device_queue& q, std::size_t bytes) {
    auto [it, fresh] = slots_.try_emplace(key{q.runtime, q.stream.native, index});
    slot& s = it->second;
    if (fresh) {
      try {
        s.done = q.runtime->create_event(q.where);
      } catch (...) {
        slots_.erase(it);
        throw;
      }
      s.runtime = q.runtime;
      s.stream = q.stream;
    }
    if (s.bytes < bytes) {
      // Stream-ordered: the old buffer is freed after the work already enqueued that uses it.
      s.runtime->deallocate(s.memory, s.stream);
      s.memory = nullptr;
      s.bytes = 0;
      s.memory = s.runtime->allocate(q.where, bytes, s.stream);
      s.bytes = bytes;
    }
    return s;
  }

 private:
  using key = std::tuple<device_runtime*, void*, std::size_t>;  // runtime, stream, bucket index
  std::map<key, slot> slots_;
};

/// The work of one compressed bucket: the allreduce's, then the decompression (an event recorded
/// behind it on the communicator's stream).
class compressed_work final : public work_state {
 public:
  compressed_work(op_info info, work allreduce, device_runtime* runtime, device_event done,
                  std::shared_ptr<compress_scratch> keep)
      : work_state(info), allreduce_(std::move(allreduce)), runtime_(runtime), done_(done), keep_(std::move(keep)) {}

  bool poll() override {
    if (!allreduce_done_) {
      if (!allreduce_.test()) return false;  // rethrows the collective's error
      allreduce_done_ = true;
    }
    // The event may have been recorded again by a later step of the same bucket: that one
    // completes after this one, so waiting for it is only later, never wrong.
    return runtime_->query(done_);
  }

 private:
  work allreduce_;
  bool allreduce_done_ = false;
  device_runtime* runtime_;
  device_event done_;
  std::shared_ptr<compress_scratch> keep_;  // the event's owner
};

/// Narrow-allreduce-widen through the 2-byte float type `Wire` (see the file comment).
template <dtype Wire>
class compress {
  static_assert(Wire == dtype::f16 || Wire == dtype::bf16, "compression travels as f16 or bf16");

 public:
  work operator()(grad_bucket& b) const {
    const tensor_view data = b.data;
    if (data.where.is_host()) return host_(b);  // the host hook, same semantics
    const char* const operation = Wire == dtype::f16 ? "cuda::hooks::fp16_compress" : "cuda::hooks::bf16_compress";
    const int rank = b.comm.rank();
    if (!is_floating(data.type)) {
      throw usage_error(rank, operation,
                        "bucket " + std::to_string(b.index) + " holds " + std::string(name_of(data.type)) +
                            " gradients; compression hooks need floating-point buckets");
    }
    // 2-byte floats already: nothing to compress; the plain average (NCCL reduces them natively).
    if (size_of(data.type) == 2 || data.count == 0) {
      return ddp::allreduce_average(b.comm, data, b.divisor, average_input::raw, operation);
    }
    const device_queue q = b.comm.device_queue();
    if (q.runtime == nullptr) {
      throw usage_error(rank, operation,
                        "bucket " + std::to_string(b.index) + " is on " + data.where.str() +
                            ", but the communicator runs its collectives on host memory (no device_queue())");
    }
    if (data.where != q.where) {
      throw usage_error(rank, operation,
                        "bucket " + std::to_string(b.index) + " is on " + data.where.str() +
                            ", the communicator's collectives on " + q.where.str());
    }

    std::lock_guard lk(scratch_->mutex);
    compress_scratch::slot& s = scratch_->get(b.index, q, data.count * size_of(Wire));
    const tensor_view wire{s.memory, data.count, Wire, q.where};
    const cudaStream_t stream = native(q.stream);
    work allreduce;
    {
      const device_guard on_device(q.where.index, rank, operation);
      cuda::compress(data, wire, 1.0 / b.divisor, stream, rank);
      allreduce = ddp::allreduce_average(b.comm, wire, b.divisor, average_input::divided, operation);
      cuda::decompress(wire, data, stream, rank);
    }
    q.runtime->record(s.done, q.stream);
    op_info info;
    info.rank = rank;
    info.name = Wire == dtype::f16 ? "fp16-compressed allreduce" : "bf16-compressed allreduce";
    info.type = Wire;
    info.count = data.count;
    info.op = reduce_op::sum;
    info.timeout = allreduce.timeout();
    return work(std::make_unique<compressed_work>(info, std::move(allreduce), q.runtime, s.done, scratch_));
  }

 private:
  ddp::hooks::detail::compress<Wire> host_;
  std::shared_ptr<compress_scratch> scratch_ = std::make_shared<compress_scratch>();
};

}  // namespace detail

/// f32/f64 device buckets travel as IEEE half (the device `ddp::hooks::fp16_compress`).
using fp16_compress = detail::compress<dtype::f16>;
/// f32/f64 device buckets travel as bfloat16: the range of f32, 8 bits of mantissa (the device
/// `ddp::hooks::bf16_compress`).
using bf16_compress = detail::compress<dtype::bf16>;

}  // namespace hooks

}  // namespace ddp::cuda
