// The cases of gpu.device_paths that need kernels of their own, compiled by nvcc: the f16/bf16
// conversion kernels of <ddp/cuda/compress.cuh> (same bits as the host conversions), the device
// compression hooks (directly, and in a Bucketer), and a Bucketer whose finalize() returns while
// the compute stream is still busy (the host does not wait). Registered with the cases of
// device_paths_test.cpp, which has the main.
#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <span>
#include <string>
#include <vector>

#include <ddp/bucketer.hpp>
#include <ddp/comm_hook.hpp>
#include <ddp/cuda/compress.cuh>
#include <ddp/cuda/runtime.hpp>
#include <ddp/dtype.hpp>
#include <ddp/nccl.hpp>

#include "gpu_support.hpp"
#include "gpu_test.hpp"

namespace {

using gpu_test::cuda_ok;
using gpu_test::device_buffer;
using gpu_test::stream_holder;

// Values over f16's whole range and beyond: tiny (subnormal in f16), ordinary, near 65504, and
// larger than f16 can hold (bf16 can).
std::vector<float> test_values(std::size_t n) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float mantissa = 1.0f + static_cast<float>(i % 997) / 997.0f;
    const int exponent = static_cast<int>(i % 48) - 30;  // 2^-30 .. 2^17
    v[i] = (i % 3 == 0 ? -1.0f : 1.0f) * std::ldexp(mantissa, exponent);
  }
  return v;
}

template <class Host>
std::uint16_t bits_of(Host h) {
  return h.bits;
}

// Host reference of the narrowing: the product rounded to the source type, then through float.
template <class Host, class S>
Host narrowed(S x, double factor) {
  const S scaled = x * static_cast<S>(factor);
  return Host(static_cast<float>(scaled));
}

template <class Host, class S>
void round_trip_case(ddp::dtype wire_type) {
  constexpr std::size_t n = 10007;
  const double factor = 1.0 / 3.0;
  std::vector<S> host(n);
  const std::vector<float> base = test_values(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<S>(base[i]);
  device_buffer<S> wide(0, host);
  device_buffer<std::uint16_t> wire(0, n);
  device_buffer<S> back(0, n);
  stream_holder s;
  const ddp::tensor_view wire_view{wire.data(), n, wire_type, ddp::device::cuda(0)};
  ddp::cuda::compress(wide.view(), wire_view, factor, s.get());
  ddp::cuda::decompress(wire_view, back.view(), s.get());
  s.sync();
  const std::vector<std::uint16_t> got = wire.download();
  const std::vector<S> widened = back.download();
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const Host want = narrowed<Host>(host[i], factor);
    if (got[i] != bits_of(want) || widened[i] != static_cast<S>(static_cast<float>(want))) {
      if (bad++ == 0) {
        gpu_test::record_failure("element " + std::to_string(i) + " (" + std::to_string(host[i]) + "): device bits " +
                                     std::to_string(got[i]) + ", host bits " + std::to_string(bits_of(want)),
                                 __FILE__, __LINE__);
      }
    }
  }
  GPU_CHECK_EQ(bad, std::size_t{0});
}

GPU_CASE("compress.kernels_same_bits_as_host") {
  cuda_ok(cudaSetDevice(0), "cudaSetDevice");
  round_trip_case<ddp::half, float>(ddp::dtype::f16);
  round_trip_case<ddp::bfloat16, float>(ddp::dtype::bf16);
  round_trip_case<ddp::half, double>(ddp::dtype::f16);
  round_trip_case<ddp::bfloat16, double>(ddp::dtype::bf16);
  // Misuse is a usage_error, before anything is launched.
  device_buffer<float> f(0, 8);
  device_buffer<float> g(0, 8);
  GPU_CHECK_THROWS_AS(ddp::cuda::compress(f.view(), g.view(), 1.0, nullptr), ddp::usage_error);
  const ddp::tensor_view short_wire{g.data(), 4, ddp::dtype::f16, ddp::device::cuda(0)};
  GPU_CHECK_THROWS_AS(ddp::cuda::compress(f.view(), short_wire, 1.0, nullptr), ddp::usage_error);
}

float pattern(std::size_t i) { return static_cast<float>(i % 7 + 1) * 0.125f; }

// What the compression hooks give for this case's values, with a tolerance: each rank's value
// divided by n and rounded to the wire type, the sum rounded again.
template <class Hook>
void hook_direct_case(ddp::nccl::communicator& c, int r, float rel) {
  const int n = c.size();
  constexpr std::size_t count = 3001;
  std::vector<float> host(count);
  for (std::size_t i = 0; i < count; ++i) host[i] = static_cast<float>(r + 1) * pattern(i);
  device_buffer<float> data(r, host);
  Hook hook;
  for (int round = 0; round < 2; ++round) {  // the second round reuses the scratch buffer
    data.upload(host);
    ddp::grad_bucket b{0, 1, data.view(), ddp::communicator_ref(c), n, false};
    ddp::work w = hook(b);
    w.wait();
    // The hook's work completes after the decompression: a copy on the legacy default stream
    // (ordered after nothing of ddp's) already sees the averages.
    const std::vector<float> got = data.download();
    std::size_t bad = 0;
    for (std::size_t i = 0; i < count; ++i) {
      const float want = static_cast<float>(n + 1) / 2.0f * pattern(i);
      if (std::fabs(got[i] - want) > rel * std::fabs(want)) ++bad;
    }
    GPU_CHECK_EQ(bad, std::size_t{0});
  }
}

GPU_CASE("compress.hooks_direct") {
  gpu_test::on_ranks(gpu_test::gpu_ranks(), [](ddp::nccl::communicator& c, int r) {
    hook_direct_case<ddp::cuda::hooks::fp16_compress>(c, r, 2e-3f);
    hook_direct_case<ddp::cuda::hooks::bf16_compress>(c, r, 1.6e-2f);
    // World size 1: exactly the host conversion of each value.
    if (c.size() == 1) {
      std::vector<float> host = test_values(4096);
      for (float& v : host) v = std::fmin(std::fmax(v, -60000.0f), 60000.0f);
      device_buffer<float> data(r, host);
      ddp::grad_bucket b{0, 1, data.view(), ddp::communicator_ref(c), 1, false};
      ddp::cuda::hooks::fp16_compress{}(b).wait();
      const std::vector<float> got = data.download();
      std::size_t bad = 0;
      for (std::size_t i = 0; i < host.size(); ++i) bad += got[i] != static_cast<float>(ddp::half(host[i])) ? 1 : 0;
      GPU_CHECK_EQ(bad, std::size_t{0});
    }
    // An integer bucket is refused, as by the host hooks.
    device_buffer<std::int32_t> ints(r, 16);
    ddp::grad_bucket bi{0, 1, ints.view(), ddp::communicator_ref(c), c.size(), false};
    GPU_CHECK_THROWS_AS(ddp::cuda::hooks::fp16_compress{}(bi), ddp::usage_error);
  });
}

template <class Hook>
void hook_bucketer_case(ddp::nccl::communicator& c, int r, float rel) {
  const int n = c.size();
  const std::size_t sizes[3] = {2000, 41, 7000};
  std::deque<device_buffer<float>> grads;
  for (std::size_t s : sizes) grads.emplace_back(r, s);
  ddp::Bucketer<> bk(c, ddp::bucketing::size_capped{.cap_bytes = 8192, .small_bucket_bytes = 128});
  for (auto& g : grads) bk.add(g.view());
  bk.register_comm_hook(Hook{});
  stream_holder compute;
  bk.set_compute_stream(compute.handle());
  for (int step = 0; step < 3; ++step) {
    std::vector<std::vector<float>> host;
    for (std::size_t k = 0; k < 3; ++k) {
      host.emplace_back(sizes[k]);
      for (std::size_t i = 0; i < sizes[k]; ++i) host[k][i] = static_cast<float>(r + 1) * pattern(i) + step;
    }
    for (std::size_t k = 3; k-- > 0;) {
      cuda_ok(cudaMemcpyAsync(grads[k].data(), host[k].data(), sizes[k] * sizeof(float), cudaMemcpyHostToDevice,
                              compute.get()),
              "cudaMemcpyAsync");
      bk.mark_ready(k);
    }
    bk.finalize();
    compute.sync();
    std::size_t bad = 0;
    for (std::size_t k = 0; k < 3; ++k) {
      const std::vector<float> got = grads[k].download();
      for (std::size_t i = 0; i < sizes[k]; ++i) {
        const float want = static_cast<float>(n + 1) / 2.0f * pattern(i) + static_cast<float>(step);
        if (std::fabs(got[i] - want) > rel * std::fabs(want)) ++bad;
      }
    }
    GPU_CHECK_EQ(bad, std::size_t{0});
  }
}

GPU_CASE("compress.hooks_in_bucketer") {
  gpu_test::on_ranks(gpu_test::gpu_ranks(), [](ddp::nccl::communicator& c, int r) {
    hook_bucketer_case<ddp::cuda::hooks::fp16_compress>(c, r, 2e-3f);
    hook_bucketer_case<ddp::cuda::hooks::bf16_compress>(c, r, 1.6e-2f);
  });
}

GPU_CASE("compress.one_hook_two_communicators") {
  // One hook object registered on two Bucketers over two communicators: its copies share one
  // scratch, kept per communicator stream and bucket index.
  gpu_test::on_ranks_two_comms(
      gpu_test::gpu_ranks(), [](ddp::nccl::communicator& one, ddp::nccl::communicator& two, int r) {
        const int n = one.size();
        const ddp::cuda::hooks::fp16_compress hook;
        constexpr std::size_t count = 5000;
        device_buffer<float> g1(r, count), g2(r, count);
        ddp::Bucketer<> b1(one), b2(two);
        b1.add(g1.view());
        b2.add(g2.view());
        b1.register_comm_hook(hook);
        b2.register_comm_hook(hook);
        stream_holder compute;
        b1.set_compute_stream(compute.handle());
        b2.set_compute_stream(compute.handle());
        std::vector<float> host(count);
        for (int step = 0; step < 3; ++step) {
          for (std::size_t i = 0; i < count; ++i) host[i] = static_cast<float>(r + 1) * pattern(i) + step;
          cuda_ok(cudaMemcpyAsync(g1.data(), host.data(), count * sizeof(float), cudaMemcpyHostToDevice, compute.get()),
                  "cudaMemcpyAsync");
          cuda_ok(cudaMemcpyAsync(g2.data(), host.data(), count * sizeof(float), cudaMemcpyHostToDevice, compute.get()),
                  "cudaMemcpyAsync");
          b1.mark_ready(0);
          b2.mark_ready(0);
          b1.finalize();
          b2.finalize();
          compute.sync();
          std::size_t bad = 0;
          for (const device_buffer<float>* g : {&g1, &g2}) {
            const std::vector<float> got = g->download();
            for (std::size_t i = 0; i < count; ++i) {
              const float want = static_cast<float>(n + 1) / 2.0f * pattern(i) + static_cast<float>(step);
              if (std::fabs(got[i] - want) > 2e-3f * std::fabs(want)) ++bad;
            }
          }
          GPU_CHECK_EQ(bad, std::size_t{0});
        }
      });
}

// Keeps the stream busy for about `cycles` clock cycles.
__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

GPU_CASE("bucketer.finalize_returns_while_compute_stream_busy") {
  gpu_test::on_ranks(gpu_test::gpu_ranks(), [](ddp::nccl::communicator& c, int r) {
    const int n = c.size();
    int khz = 0;
    cuda_ok(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, r), "cudaDeviceGetAttribute");
    const long long busy_ms = 500;
    constexpr std::size_t count = 100000;
    device_buffer<float> grad(r, count);
    ddp::Bucketer<> bk(c);
    bk.add(grad.view());
    stream_holder compute;
    bk.set_compute_stream(compute.handle());
    std::vector<float> host(count);
    for (std::size_t i = 0; i < count; ++i) host[i] = static_cast<float>(r + 1) * pattern(i);
    // "Backward": half a second of work, then the gradient.
    spin<<<1, 1, 0, compute.get()>>>(static_cast<long long>(khz) * busy_ms);
    cuda_ok(cudaGetLastError(), "spin launch");
    cuda_ok(cudaMemcpyAsync(grad.data(), host.data(), count * sizeof(float), cudaMemcpyHostToDevice, compute.get()),
            "cudaMemcpyAsync");
    const auto t0 = std::chrono::steady_clock::now();
    bk.mark_ready(0);
    bk.finalize();
    const double host_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const cudaError_t still_busy = cudaStreamQuery(compute.get());
    GPU_CHECK(still_busy == cudaErrorNotReady);
    GPU_CHECK(host_ms < static_cast<double>(busy_ms) / 2);
    compute.sync();
    const std::vector<float> got = grad.download();
    std::size_t bad = 0;
    for (std::size_t i = 0; i < count; ++i) {
      const float want = static_cast<float>(n + 1) / 2.0f * pattern(i);
      if (std::fabs(got[i] - want) > 1e-6f * std::fabs(want)) ++bad;
    }
    GPU_CHECK_EQ(bad, std::size_t{0});
  });
}

}  // namespace
