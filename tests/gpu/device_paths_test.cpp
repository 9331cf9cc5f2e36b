// GPU test of ddp's device paths on real hardware, without MPI or Catch2 (scripts/gpu-check.sh
// runs it on GPU machines that have neither): the CUDA device runtime, the NCCL communicator's
// collectives on device memory, the Bucketer over device gradients (copy path, zero-copy,
// finalize() without a host wait, finalize_blocking(), mark_ready with events), two NCCL
// communicators in one process, and the bandwidth of the runtime's batched device copies against
// one cudaMemcpyAsync of the same bytes. The cases that need kernels of their own (compression,
// a busy compute stream) are in device_kernels_test.cu.
//
// Ranks are threads, one per visible GPU (at most 4): a single-GPU machine runs NCCL at world
// size 1. Without a device the program prints "SKIP: no CUDA device" and exits 77 (ctest's
// SKIP_RETURN_CODE). Output: "RESULT <case> PASS|FAIL: ..." per case, "BANDWIDTH ..." lines.
//
//   gpu_device_paths [substring]   runs the cases whose name contains the substring
//   gpu_device_paths --list        lists the cases
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <span>
#include <string>
#include <vector>

#include <ddp/bucketer.hpp>
#include <ddp/buffer_reducer.hpp>
#include <ddp/cuda/runtime.hpp>
#include <ddp/device_runtime.hpp>
#include <ddp/join.hpp>
#include <ddp/nccl.hpp>
#include <ddp/strategies/allreduce.hpp>

#include "gpu_support.hpp"
#include "gpu_test.hpp"

namespace {

using gpu_test::cuda_ok;
using gpu_test::device_buffer;
using gpu_test::stream_holder;

// Small integers: exact in f16 and bf16, and so are their sums over up to 4 ranks.
float pattern(std::size_t i) { return static_cast<float>(i % 7 + 1); }

template <class T>
std::vector<T> values_of(std::size_t n, int rank, float offset = 0.0f) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = T(static_cast<float>(rank + 1) * pattern(i) + offset);
  return v;
}

template <class T>
float as_float(T v) {
  return static_cast<float>(v);
}

bool close(float got, float want, float rel) { return std::fabs(got - want) <= rel * std::max(1.0f, std::fabs(want)); }

// Records a failure naming the first element of `got` not within `rel` of `want(i)`.
template <class T, class W>
void check_values(const char* what, const std::vector<T>& got, float rel, const char* file, int line, W&& want) {
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!close(as_float(got[i]), want(i), rel)) {
      gpu_test::record_failure(std::string(what) + " at " + std::to_string(i) + ": " +
                                   std::to_string(as_float(got[i])) + ", want " + std::to_string(want(i)),
                               file, line);
      return;
    }
  }
}
/// CHECK_VALUES(values, relative tolerance, want(i)): every element close to its expected value.
#define CHECK_VALUES(got, rel, ...) check_values(#got, got, rel, __FILE__, __LINE__, __VA_ARGS__)

ddp::work allreduce(ddp::nccl::communicator& c, ddp::tensor_view v, ddp::reduce_op op) {
  return c.allreduce(std::span<const ddp::tensor_view>(&v, 1), op);
}

// ---- the CUDA device runtime -----------------------------------------------------------------

GPU_CASE("cuda_runtime.allocate_copy_zero") {
  cuda_ok(cudaSetDevice(0), "cudaSetDevice");
  ddp::cuda::runtime rt(0);
  const ddp::device gpu = ddp::device::cuda(0);
  const ddp::device_stream s = rt.create_stream(gpu);
  constexpr std::size_t n = std::size_t{1} << 20;
  std::vector<float> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i);
  auto* a = static_cast<float*>(rt.allocate(gpu, n * sizeof(float), s));
  auto* b = static_cast<float*>(rt.allocate(gpu, n * sizeof(float), s));
  GPU_REQUIRE(a != nullptr && b != nullptr);
  GPU_CHECK(rt.allocate(gpu, 0, s) == nullptr);
  const ddp::copy_region up{a, host.data(), n * sizeof(float)};
  rt.copy(std::span<const ddp::copy_region>(&up, 1), s);
  // Device to device in four regions, last quarter first (one batched call).
  std::vector<ddp::copy_region> quarters;
  for (std::size_t q = 4; q-- > 0;) quarters.push_back({b + q * n / 4, a + q * n / 4, n / 4 * sizeof(float)});
  rt.copy(quarters, s);
  rt.zero(b, 16 * sizeof(float), s);
  std::vector<float> back(n, -1.0f);
  const ddp::copy_region down{back.data(), b, n * sizeof(float)};
  rt.copy(std::span<const ddp::copy_region>(&down, 1), s);
  const ddp::device_event done = rt.create_event(gpu);
  rt.record(done, s);
  rt.synchronize(done);
  GPU_CHECK(rt.query(done));
  GPU_CHECK_EQ(back[0], 0.0f);
  GPU_CHECK_EQ(back[15], 0.0f);
  GPU_CHECK_EQ(back[16], 16.0f);
  GPU_CHECK_EQ(back[n / 2 + 3], static_cast<float>(n / 2 + 3));
  GPU_CHECK_EQ(back[n - 1], static_cast<float>(n - 1));
  GPU_CHECK(std::memcmp(back.data() + 16, host.data() + 16, (n - 16) * sizeof(float)) == 0);
  GPU_CHECK_THROWS_AS(rt.allocate(ddp::device::host(), 4, s), ddp::usage_error);
  rt.deallocate(a, s);
  rt.deallocate(b, s);
  rt.destroy_event(done);
  cuda_ok(cudaStreamSynchronize(ddp::cuda::native(s)), "cudaStreamSynchronize");
  rt.destroy_stream(s);
}

// Many regions, sizes 0 to 5000 bytes at every alignment (16-, 4- and 1-byte words in the kernel),
// in both directions between two buffers: the copy kernel's path. Then one pageable host region
// in the batch: the copy-engine path, same result.
GPU_CASE("cuda_runtime.copy_kernel_many_regions_any_alignment") {
  cuda_ok(cudaSetDevice(0), "cudaSetDevice");
  ddp::cuda::runtime rt(0);
  constexpr std::size_t n = std::size_t{8} << 20;
  std::vector<std::uint8_t> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<std::uint8_t>(i * 13 + 5);
  device_buffer<std::uint8_t> a(0, host), b(0, n);
  stream_holder s;
  for (const bool through_host : {false, true}) {
    cuda_ok(cudaMemset(b.data(), 0, n), "cudaMemset");
    std::vector<ddp::copy_region> regions;
    std::vector<std::uint8_t> want(n, 0);
    std::size_t at = 0;
    for (std::size_t k = 0; at + 6000 < n / 2; ++k) {
      const std::size_t bytes = k % 17 == 0 ? 0 : (k * 977) % 5000 + 1;
      const std::size_t skew = k % 3 == 0 ? 0 : (k % 3 == 1 ? 4 : k % 16);  // 16-, 4-, 1-byte aligned
      const std::size_t from = at + skew, to = n / 2 + at + (k % 5 == 0 ? skew : 0);
      regions.push_back({b.data() + to, a.data() + from, bytes});
      std::memcpy(want.data() + to, host.data() + from, bytes);
      at += bytes + 32;
    }
    if (through_host) regions.push_back({b.data(), host.data(), 4096});  // pageable: no kernel
    if (through_host) std::memcpy(want.data(), host.data(), 4096);
    rt.copy(regions, s.handle());
    s.sync();
    const std::vector<std::uint8_t> got = b.download();
    std::size_t wrong = 0, first_wrong = n;
    for (std::size_t i = 0; i < n; ++i) {
      if (got[i] != want[i]) {
        ++wrong;
        first_wrong = std::min(first_wrong, i);
      }
    }
    std::printf("  copy of %zu regions%s: %zu wrong bytes (first at %zu)\n", regions.size(),
                through_host ? " with one host region" : "", wrong, first_wrong);
    GPU_CHECK(wrong == 0);
  }
}

GPU_CASE("cuda_runtime.events_order_streams") {
  cuda_ok(cudaSetDevice(0), "cudaSetDevice");
  ddp::cuda::runtime rt(0);
  const ddp::device gpu = ddp::device::cuda(0);
  stream_holder s1, s2;
  const ddp::device_event fresh = rt.create_event(gpu);
  GPU_CHECK(rt.query(fresh));                       // never recorded: complete
  constexpr std::size_t n = std::size_t{16} << 20;  // 64 MiB: the copy takes a while
  std::vector<float> host = values_of<float>(n, 0);
  device_buffer<float> a(0, n), b(0, n);
  const ddp::copy_region up{a.data(), host.data(), n * sizeof(float)};
  rt.copy(std::span<const ddp::copy_region>(&up, 1), s1.handle());
  rt.record(fresh, s1.handle());
  rt.wait(s2.handle(), fresh);  // s2's copy starts after s1's upload
  const ddp::copy_region across{b.data(), a.data(), n * sizeof(float)};
  rt.copy(std::span<const ddp::copy_region>(&across, 1), s2.handle());
  std::vector<float> back(n);
  const ddp::copy_region down{back.data(), b.data(), n * sizeof(float)};
  rt.copy(std::span<const ddp::copy_region>(&down, 1), s2.handle());
  const ddp::device_event done = rt.create_event(gpu);
  rt.record(done, s2.handle());
  rt.synchronize(done);
  GPU_CHECK(rt.query(done));
  GPU_CHECK(std::memcmp(back.data(), host.data(), n * sizeof(float)) == 0);
  rt.destroy_event(fresh);
  rt.destroy_event(done);
}

// ---- NCCL collectives on device memory ---------------------------------------------------------

GPU_CASE("nccl.device_queue") {
  gpu_test::on_ranks(gpu_test::gpu_ranks(), [](ddp::nccl::communicator& c, int r) {
    const ddp::device_queue q = c.device_queue();
    GPU_CHECK(q.runtime != nullptr);
    GPU_CHECK(q.where == ddp::device::cuda(r));
    GPU_CHECK(q.stream == ddp::cuda::stream(c.stream()));
    const ddp::communicator_ref ref(c);
    GPU_CHECK(ref.has_device_queue());
    GPU_CHECK(ref.has_premul_sum());
  });
}

template <class T>
void allreduce_case(ddp::nccl::communicator& c, int r, float rel) {
  const int n = c.size();
  constexpr std::size_t count = 4099;
  const float sum_factor = static_cast<float>(n * (n + 1)) / 2.0f;
  {
    device_buffer<T> buf(r, values_of<T>(count, r));
    allreduce(c, buf.view(), ddp::reduce_op::sum).wait();
    const std::vector<T> got = buf.download();
    CHECK_VALUES(got, 0.0f, [&](std::size_t i) { return sum_factor * pattern(i); });
  }
  {
    device_buffer<T> buf(r, values_of<T>(count, r));
    allreduce(c, buf.view(), ddp::reduce_op::avg).wait();
    const std::vector<T> got = buf.download();
    CHECK_VALUES(got, rel, [&](std::size_t i) { return sum_factor / static_cast<float>(n) * pattern(i); });
  }
  {
    device_buffer<T> buf(r, values_of<T>(count, r));
    const ddp::tensor_view v = buf.view();
    c.allreduce_premul_sum(std::span<const ddp::tensor_view>(&v, 1), 0.5).wait();
    const std::vector<T> got = buf.download();
    CHECK_VALUES(got, 0.0f, [&](std::size_t i) { return 0.5f * sum_factor * pattern(i); });
  }
  {  // the rule of ddp/average.hpp over the device: premul sum by 1/n
    device_buffer<T> buf(r, values_of<T>(count, r));
    ddp::allreduce_average(ddp::communicator_ref(c), buf.view(), n).wait();
    const std::vector<T> got = buf.download();
    CHECK_VALUES(got, rel, [&](std::size_t i) { return sum_factor / static_cast<float>(n) * pattern(i); });
  }
}

GPU_CASE("nccl.allreduce_f32_f16_bf16") {
  gpu_test::on_ranks(gpu_test::gpu_ranks(), [](ddp::nccl::communicator& c, int r) {
    allreduce_case<float>(c, r, 1e-6f);
    allreduce_case<ddp::half>(c, r, 2e-3f);
    allreduce_case<ddp::bfloat16>(c, r, 1.6e-2f);
  });
}

GPU_CASE("nccl.broadcast_allgather_reduce_scatter") {
  gpu_test::on_ranks(gpu_test::gpu_ranks(), [](ddp::nccl::communicator& c, int r) {
    const int n = c.size();
    const ddp::communicator_ref ref(c);
    constexpr std::size_t m = 1000;
    {  // broadcast from the last rank
      device_buffer<float> buf(r, values_of<float>(m, r));
      ddp::tensor_view v = buf.view();
      ref.broadcast(v, n - 1).wait();
      const std::vector<float> got = buf.download();
      CHECK_VALUES(got, 0.0f, [&](std::size_t i) { return static_cast<float>(n) * pattern(i); });
    }
    {  // allgather: rank q's block holds q's values
      device_buffer<float> in(r, values_of<float>(m, r));
      device_buffer<float> out(r, m * static_cast<std::size_t>(n));
      ref.allgather(in.view(), out.view()).wait();
      const std::vector<float> got = out.download();
      CHECK_VALUES(got, 0.0f, [&](std::size_t i) { return static_cast<float>(i / m + 1) * pattern(i % m); });
    }
    {  // reduce_scatter (sum): rank r gets block r of the sum
      device_buffer<float> in(r, values_of<float>(m * static_cast<std::size_t>(n), r));
      device_buffer<float> out(r, m);
      ref.reduce_scatter(in.view(), out.view(), ddp::reduce_op::sum).wait();
      const std::vector<float> got = out.download();
      const float sum_factor = static_cast<float>(n * (n + 1)) / 2.0f;
      CHECK_VALUES(got, 0.0f, [&](std::size_t i) { return sum_factor * pattern(static_cast<std::size_t>(r) * m + i); });
    }
    // Host tensors are staged through device memory and complete on return (the components'
    // control messages); a call mixing host and device tensors is a usage_error.
    std::vector<float> host(5, static_cast<float>(r + 1));
    ref.allreduce(host, ddp::reduce_op::sum).wait();
    GPU_CHECK_EQ(host[4], static_cast<float>(n * (n + 1)) / 2.0f);
    device_buffer<float> dev(r, 5);
    const ddp::tensor_view mixed[2] = {dev.view(), ddp::view(host)};
    GPU_CHECK_THROWS_AS(c.allreduce(mixed, ddp::reduce_op::sum), ddp::usage_error);
  });
}

// ---- the Bucketer over device gradients ----------------------------------------------------------

// Three gradients in separate allocations (odd sizes), registered as views.
struct gradients {
  static constexpr std::size_t sizes[3] = {1000, 37, 5000};
  std::deque<device_buffer<float>> buffers;  // a deque: device buffers do not move
  explicit gradients(int device) {
    for (std::size_t s : sizes) buffers.emplace_back(device, s);
  }
};

float averaged(int n, std::size_t i, float offset) { return static_cast<float>(n + 1) / 2.0f * pattern(i) + offset; }

GPU_CASE("bucketer.copy_path_finalize_without_host_wait") {
  gpu_test::on_ranks(gpu_test::gpu_ranks(), [](ddp::nccl::communicator& c, int r) {
    const int n = c.size();
    gradients g(r);
    ddp::Bucketer<> bk(c, ddp::bucketing::size_capped{.cap_bytes = 4096, .small_bucket_bytes = 128});
    for (auto& b : g.buffers) bk.add(b.view());
    stream_holder compute;
    bk.set_compute_stream(compute.handle());
    for (int step = 0; step < 4; ++step) {
      const float offset = static_cast<float>(step);
      std::vector<std::vector<float>> host;
      for (std::size_t k = 0; k < 3; ++k) host.push_back(values_of<float>(gradients::sizes[k], r, offset));
      for (std::size_t k = 3; k-- > 0;) {  // "backward": last gradient first
        cuda_ok(cudaMemcpyAsync(g.buffers[k].data(), host[k].data(), host[k].size() * sizeof(float),
                                cudaMemcpyHostToDevice, compute.get()),
                "cudaMemcpyAsync");
        bk.mark_ready(k);
      }
      bk.finalize();
      compute.sync();  // the compute stream waited for the averaged gradients
      for (std::size_t k = 0; k < 3; ++k) {
        const std::vector<float> got = g.buffers[k].download();
        CHECK_VALUES(got, 1e-6f, [&](std::size_t i) { return averaged(n, i, offset); });
      }
    }
    GPU_CHECK(bk.last_step().iteration == 4);
  });
}

GPU_CASE("bucketer.mark_ready_event_finalize_blocking") {
  gpu_test::on_ranks(gpu_test::gpu_ranks(), [](ddp::nccl::communicator& c, int r) {
    const int n = c.size();
    gradients g(r);
    ddp::Bucketer<> bk(c, ddp::bucketing::size_capped{.cap_bytes = 4096, .small_bucket_bytes = 128});
    for (auto& b : g.buffers) bk.add(b.view());
    stream_holder producer;
    cudaEvent_t produced = nullptr;
    cuda_ok(cudaEventCreateWithFlags(&produced, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    std::vector<std::vector<float>> host;
    for (std::size_t k = 0; k < 3; ++k) host.push_back(values_of<float>(gradients::sizes[k], r));
    for (std::size_t k = 3; k-- > 0;) {
      cuda_ok(cudaMemcpyAsync(g.buffers[k].data(), host[k].data(), host[k].size() * sizeof(float),
                              cudaMemcpyHostToDevice, producer.get()),
              "cudaMemcpyAsync");
      cuda_ok(cudaEventRecord(produced, producer.get()), "cudaEventRecord");
      bk.mark_ready(k, ddp::cuda::event(produced));
    }
    bk.finalize_blocking();
    // The host waited: a copy on the legacy default stream (ordered after nothing of ddp's)
    // reads the averages.
    for (std::size_t k = 0; k < 3; ++k) {
      const std::vector<float> got = g.buffers[k].download();
      CHECK_VALUES(got, 1e-6f, [&](std::size_t i) { return averaged(n, i, 0.0f); });
    }
    (void)cudaEventDestroy(produced);
    // Without a compute stream or an event, a device gradient cannot be marked.
    ddp::Bucketer<> other(c);
    device_buffer<float> lone(r, 8);
    other.add(lone.view());
    GPU_CHECK_THROWS_AS(other.mark_ready(0), ddp::usage_error);
  });
}

GPU_CASE("bucketer.zero_copy") {
  gpu_test::on_ranks(gpu_test::gpu_ranks(), [](ddp::nccl::communicator& c, int r) {
    const int n = c.size();
    gradients shapes(r);  // only their shapes: zero-copy gradients live in the buckets
    ddp::Bucketer<> bk(c, ddp::bucketing::size_capped{.cap_bytes = 4096, .small_bucket_bytes = 128},
                       ddp::bucketer_options{.zero_copy = true});
    for (auto& b : shapes.buffers) bk.add(b.view());
    bk.build();
    stream_holder compute;
    bk.set_compute_stream(compute.handle());
    for (int step = 0; step < 3; ++step) {
      const float offset = static_cast<float>(step);
      std::vector<std::vector<float>> host;
      for (std::size_t k = 0; k < 3; ++k) host.push_back(values_of<float>(gradients::sizes[k], r, offset));
      for (std::size_t k = 3; k-- > 0;) {
        const ddp::tensor_view v = bk.gradient_view(k);
        GPU_REQUIRE(v.where == ddp::device::cuda(r) && v.count == gradients::sizes[k]);
        cuda_ok(cudaMemcpyAsync(v.data, host[k].data(), v.bytes(), cudaMemcpyHostToDevice, compute.get()),
                "cudaMemcpyAsync");
        bk.mark_ready(k);
      }
      bk.finalize();
      compute.sync();
      for (std::size_t k = 0; k < 3; ++k) {
        const ddp::tensor_view v = bk.gradient_view(k);
        std::vector<float> got(v.count);
        cuda_ok(cudaMemcpy(got.data(), v.data, v.bytes(), cudaMemcpyDeviceToHost), "cudaMemcpy");
        CHECK_VALUES(got, 1e-6f, [&](std::size_t i) { return averaged(n, i, offset); });
      }
    }
  });
}

// ---- two NCCL communicators in one process ----------------------------------------------------

GPU_CASE("buffer_reducer.mean_broadcast_max") {
  gpu_test::on_ranks(gpu_test::gpu_ranks(), [](ddp::nccl::communicator& c, int r) {
    const int n = c.size();
    device_buffer<float> mean(r, 6), from_root(r, 4), biggest(r, 3);
    ddp::BufferReducer buffers(c);
    buffers.add(mean.view(), ddp::strategies::allreduce_mean{});
    buffers.add(from_root.view());
    buffers.add(biggest.view(), ddp::strategies::allreduce_max{});
    buffers.build();  // the fingerprint allgather is a host collective: staged through the device
    for (int t = 0; t < 2; ++t) {
      const float offset = static_cast<float>(t);
      mean.upload(values_of<float>(6, r, offset));
      from_root.upload(std::vector<float>(4, static_cast<float>(r + 10 * t)));
      biggest.upload(std::vector<float>(3, static_cast<float>(r * (t + 1))));
      buffers.sync();  // the host waits for the collectives (completed on the device)
      CHECK_VALUES(mean.download(), 1e-6f, [&](std::size_t i) { return averaged(n, i, offset); });
      CHECK_VALUES(from_root.download(), 0.0f, [&](std::size_t) { return static_cast<float>(10 * t); });
      CHECK_VALUES(biggest.download(), 0.0f, [&](std::size_t) { return static_cast<float>((n - 1) * (t + 1)); });
    }
  });
}

GPU_CASE("join.uneven_inputs_on_device") {
  gpu_test::on_ranks(gpu_test::gpu_ranks(), [](ddp::nccl::communicator& c, int r) {
    device_buffer<float> param(r, std::vector<float>(16, 0.0f)), grad(r, 16);
    ddp::Bucketer<> bk(c);
    bk.add(param.view(), grad.view());
    stream_holder compute;
    bk.set_compute_stream(compute.handle());
    const int batches = 2 + r;  // rank r runs out of data after 2 + r batches
    {
      ddp::JoinContext join({}, bk);
      for (int t = 0; t < batches; ++t) {
        const ddp::join_round& round = join.notify();
        const std::vector<float> ones(16, 1.0f);
        cuda_ok(cudaMemcpyAsync(grad.data(), ones.data(), 16 * sizeof(float), cudaMemcpyHostToDevice, compute.get()),
                "cudaMemcpyAsync");
        bk.mark_ready(0);
        bk.finalize();
        compute.sync();
        // Training ranks contribute 1, joined ones shadow with device zeros.
        const float want = static_cast<float>(round.training) / static_cast<float>(round.divisor());
        CHECK_VALUES(grad.download(), 1e-6f, [&](std::size_t) { return want; });
        std::vector<float> p = param.download();
        for (float& v : p) v -= 1.0f + static_cast<float>(r);  // ranks that train longer move further
        param.upload(p);
      }
      join.finish();  // the final broadcast of the device parameters from the authoritative rank
    }
    // Every rank ends with the same parameters.
    std::vector<float> mine = param.download();
    device_buffer<float> all(r, 16 * static_cast<std::size_t>(c.size()));
    ddp::communicator_ref(c).allgather(param.view(), all.view()).wait();
    const std::vector<float> every = all.download();
    for (std::size_t i = 0; i < every.size(); ++i) GPU_CHECK(every[i] == mine[i % 16]);
  });
}

GPU_CASE("nccl.two_communicators_one_process") {
  gpu_test::on_ranks_two_comms(
      gpu_test::gpu_ranks(), [](ddp::nccl::communicator& one, ddp::nccl::communicator& two, int r) {
        const int n = one.size();
        GPU_CHECK(one.stream() != two.stream());
        // Interleaved collectives on both, each on its own stream.
        device_buffer<float> a(r, values_of<float>(3000, r)), b(r, values_of<float>(2000, r, 1.0f));
        ddp::work wa = allreduce(one, a.view(), ddp::reduce_op::sum);
        ddp::work wb = allreduce(two, b.view(), ddp::reduce_op::max);
        wb.wait();
        wa.wait();
        const float sum_factor = static_cast<float>(n * (n + 1)) / 2.0f;
        const std::vector<float> got_a = a.download();
        const std::vector<float> got_b = b.download();
        CHECK_VALUES(got_a, 0.0f, [&](std::size_t i) { return sum_factor * pattern(i); });
        CHECK_VALUES(got_b, 0.0f, [&](std::size_t i) { return static_cast<float>(n) * pattern(i) + 1.0f; });
        // A Bucketer on each, in the same steps, one compute stream.
        gradients g1(r), g2(r);
        ddp::Bucketer<> b1(one, ddp::bucketing::size_capped{.cap_bytes = 4096, .small_bucket_bytes = 128});
        ddp::Bucketer<> b2(two, ddp::bucketing::size_capped{.cap_bytes = 8192, .small_bucket_bytes = 256});
        for (auto& x : g1.buffers) b1.add(x.view());
        for (auto& x : g2.buffers) b2.add(x.view());
        stream_holder compute;
        b1.set_compute_stream(compute.handle());
        b2.set_compute_stream(compute.handle());
        std::vector<std::vector<float>> host;
        for (std::size_t k = 0; k < 3; ++k) host.push_back(values_of<float>(gradients::sizes[k], r));
        for (std::size_t k = 3; k-- > 0;) {
          for (gradients* g : {&g1, &g2}) {
            cuda_ok(cudaMemcpyAsync(g->buffers[k].data(), host[k].data(), host[k].size() * sizeof(float),
                                    cudaMemcpyHostToDevice, compute.get()),
                    "cudaMemcpyAsync");
          }
          b1.mark_ready(k);
          b2.mark_ready(k);
        }
        b1.finalize();
        b2.finalize();
        compute.sync();
        for (gradients* g : {&g1, &g2}) {
          for (std::size_t k = 0; k < 3; ++k) {
            const std::vector<float> got = g->buffers[k].download();
            CHECK_VALUES(got, 1e-6f, [&](std::size_t i) { return averaged(n, i, 0.0f); });
          }
        }
      });
}

// ---- bandwidth: the runtime's batched device copies against the copy engines' batch and one --------
// ---- cudaMemcpyAsync of the same bytes --------------------------------------------------------

GPU_CASE("bandwidth.runtime_copy_vs_cudaMemcpyAsync") {
  cuda_ok(cudaSetDevice(0), "cudaSetDevice");
  ddp::cuda::runtime rt(0);
  constexpr std::size_t total = std::size_t{256} << 20;  // 256 MiB
  device_buffer<std::uint8_t> src(0, total), dst(0, total);
  cuda_ok(cudaMemset(src.data(), 0x5a, total), "cudaMemset");
  cuda_ok(cudaMemset(dst.data(), 0, total), "cudaMemset");
  stream_holder s;
  cudaEvent_t start = nullptr, stop = nullptr;
  cuda_ok(cudaEventCreate(&start), "cudaEventCreate");
  cuda_ok(cudaEventCreate(&stop), "cudaEventCreate");
  constexpr int warmup = 2, timed = 10;
  auto time_ms = [&](auto&& enqueue) {
    for (int i = 0; i < warmup; ++i) enqueue();
    cuda_ok(cudaEventRecord(start, s.get()), "cudaEventRecord");
    for (int i = 0; i < timed; ++i) enqueue();
    cuda_ok(cudaEventRecord(stop, s.get()), "cudaEventRecord");
    cuda_ok(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0.0f;
    cuda_ok(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    return static_cast<double>(ms) / timed;
  };
  const double baseline_ms = time_ms([&] {
    cuda_ok(cudaMemcpyAsync(dst.data(), src.data(), total, cudaMemcpyDeviceToDevice, s.get()), "cudaMemcpyAsync");
  });
  const double gb = static_cast<double>(total) / 1e9;
  for (const std::size_t regions : {std::size_t{1}, std::size_t{16}, std::size_t{256}, std::size_t{4096}}) {
    const std::size_t each = total / regions;
    std::vector<ddp::copy_region> batch;
    for (std::size_t k = 0; k < regions; ++k) batch.push_back({dst.data() + k * each, src.data() + k * each, each});
    const double ms = time_ms([&] { rt.copy(batch, s.handle()); });
    // The copy-engine batch the runtime used before its copy kernel (one call for all regions).
    std::vector<void*> dsts;
    std::vector<const void*> srcs;
    std::vector<std::size_t> sizes(regions, each);
    for (const ddp::copy_region& r : batch) {
      dsts.push_back(r.dst);
      srcs.push_back(r.src);
    }
#if DDP_CUDA_HAS_MEMCPY_BATCH
    const double batch_ms = time_ms([&] {
      cudaMemcpyAttributes attributes{};
      attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      std::size_t first = 0;
      cuda_ok(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), regions, &attributes, &first, 1, s.get()),
              "cudaMemcpyBatchAsync");
    });
#else
    const double batch_ms = 0.0;  // no batch call before CUDA 13: reported as inf
#endif
    std::printf(
        "BANDWIDTH d2d bytes=%zu regions=%zu region_bytes=%zu runtime_copy_GBps=%.1f "
        "cudaMemcpyBatchAsync_GBps=%.1f cudaMemcpyAsync_GBps=%.1f ratio=%.3f\n",
        total, regions, each, gb / (ms / 1e3), gb / (batch_ms / 1e3), gb / (baseline_ms / 1e3), baseline_ms / ms);
  }
  std::printf(
      "  (GB/s: bytes copied per second, each byte counted once; 10 copies timed with CUDA events "
      "after 2 warm-ups)\n");
  s.sync();
  const std::vector<std::uint8_t> tail = [&] {
    std::vector<std::uint8_t> v(4096);
    cuda_ok(cudaMemcpy(v.data(), dst.data() + total - v.size(), v.size(), cudaMemcpyDeviceToHost), "cudaMemcpy");
    return v;
  }();
  GPU_CHECK(tail.front() == 0x5a && tail.back() == 0x5a);
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--list") {
    for (const gpu_test::test_case& tc : gpu_test::registry()) std::printf("%s\n", tc.name.c_str());
    return 0;
  }
  // Versions first (they need no device), for scripts/gpu-check.sh's report.
  int nccl_version = 0, runtime_version = 0, driver_version = 0;
  (void)ncclGetVersion(&nccl_version);
  (void)cudaRuntimeGetVersion(&runtime_version);
  (void)cudaDriverGetVersion(&driver_version);
  std::printf("VERSIONS nccl=%d.%d.%d cuda_runtime=%d.%d cuda_driver_api=%d.%d\n", nccl_version / 10000,
              nccl_version / 100 % 100, nccl_version % 100, runtime_version / 1000, runtime_version % 1000 / 10,
              driver_version / 1000, driver_version % 1000 / 10);
  const ddp::nccl::device_count visible = ddp::nccl::visible_devices();
  if (visible.count == 0) {
    std::printf("SKIP: no CUDA device visible (%s)\n", cudaGetErrorString(visible.status));
    return 77;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
    std::printf("gpu.device_paths: %d device(s), device 0: %s (sm_%d%d), ranks per case: %d\n", visible.count,
                prop.name, prop.major, prop.minor, gpu_test::gpu_ranks());
  }
  const std::string filter = argc > 1 ? argv[1] : "";
  int passed = 0, failed = 0;
  for (const gpu_test::test_case& tc : gpu_test::registry()) {
    if (!filter.empty() && tc.name.find(filter) == std::string::npos) continue;
    gpu_test::failures().clear();
    std::printf("RUN %s\n", tc.name.c_str());
    std::fflush(stdout);
    const auto t0 = std::chrono::steady_clock::now();
    std::string error;
    try {
      tc.body();
    } catch (const gpu_test::abort_case&) {
    } catch (const std::exception& e) {
      error = std::string("exception: ") + e.what();
    } catch (...) {
      error = "unknown exception";
    }
    if (!error.empty()) gpu_test::failures().push_back(error);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (gpu_test::failures().empty()) {
      ++passed;
      std::printf("RESULT %s PASS (%.0f ms)\n", tc.name.c_str(), ms);
    } else {
      ++failed;
      std::printf("RESULT %s FAIL: %s\n", tc.name.c_str(), gpu_test::failures().front().c_str());
    }
    std::fflush(stdout);
  }
  std::printf("gpu.device_paths: %d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
