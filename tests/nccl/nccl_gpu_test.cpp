// NCCL backend collectives on real GPUs: one rank per visible device (up to 4), each on its own
// thread, bootstrapped over the local backend. GPU-only: every case SKIPS (prints why and
// passes) when no CUDA device is visible. CMake registers this executable as a test only when
// its configure-time probe saw a device.
#include <catch2/catch.hpp>

#include <ddp/average.hpp>
#include <ddp/cuda/runtime.hpp>
#include <ddp/local/communicator.hpp>
#include <ddp/nccl.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

// Device memory of `count` elements of T on `device`; a tensor through tensor_traits.
template <class T>
class device_buffer {
 public:
  device_buffer(int device, std::size_t count) : device_(device), count_(count) {
    check(cudaSetDevice(device), "cudaSetDevice");
    check(cudaMalloc(&data_, std::max<std::size_t>(count, 1) * sizeof(T)), "cudaMalloc");
  }
  device_buffer(int device, const std::vector<T>& values) : device_buffer(device, values.size()) { upload(values); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { (void)cudaFree(data_); }

  void upload(const std::vector<T>& values) {
    check(cudaMemcpy(data_, values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  [[nodiscard]] std::vector<T> download() const {
    std::vector<T> out(count_);
    check(cudaMemcpy(out.data(), data_, count_ * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
    return out;
  }

  T* data() const { return data_; }
  std::size_t size() const { return count_; }
  int device() const { return device_; }

 private:
  static void check(cudaError_t e, const char* call) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(call) + ": " + cudaGetErrorString(e));
  }
  int device_;
  std::size_t count_;
  T* data_ = nullptr;
};

}  // namespace

template <class T>
struct ddp::tensor_traits<device_buffer<T>> {
  static void* data(device_buffer<T>& b) { return b.data(); }
  static std::size_t size(const device_buffer<T>& b) { return b.size(); }
  static ddp::dtype dtype(const device_buffer<T>&) { return ddp::dtype_v<T>; }
  static ddp::device device(const device_buffer<T>& b) { return ddp::device::cuda(b.device()); }
};

namespace {

// Number of ranks for the multi-GPU cases, or 0 (after printing why) when the case must skip.
int gpu_ranks() {
  const ddp::nccl::device_count visible = ddp::nccl::visible_devices();
  if (visible.count == 0) {
    std::printf("SKIPPED (GPU-only): no CUDA device visible: %s\n", cudaGetErrorString(visible.status));
    return 0;
  }
  return std::min(visible.count, 4);
}

// Runs fn(nccl_communicator&, local_communicator&) on one thread per GPU.
template <class F>
void on_gpus(int ranks, F&& fn) {
  ddp::local::run(ranks, [&](ddp::local::communicator& host) {
    auto gpu = ddp::nccl::communicator::bootstrap(host, host.rank(), {.timeout = std::chrono::seconds(60)});
    fn(gpu, host);
  });
}

}  // namespace

TEST_CASE("gpu: allreduce sum and avg over f32, i32 max, f16 sum", "[nccl][gpu]") {
  const int n = gpu_ranks();
  if (n == 0) return;
  on_gpus(n, [n](ddp::nccl::communicator& gpu, ddp::local::communicator&) {
    const auto r = static_cast<float>(gpu.rank());
    device_buffer<float> sum(gpu.device(), std::vector<float>(1000, r + 1));
    ddp::communicator_ref(gpu).allreduce(sum, ddp::reduce_op::sum).wait();
    CHECK(sum.download() == std::vector<float>(1000, static_cast<float>(n * (n + 1) / 2)));

    device_buffer<float> avg(gpu.device(), std::vector<float>(8, 2 * r));
    ddp::communicator_ref(gpu).allreduce(avg, ddp::reduce_op::avg).wait();
    CHECK(avg.download() == std::vector<float>(8, static_cast<float>(n - 1)));

    device_buffer<std::int32_t> max(gpu.device(), std::vector<std::int32_t>(3, gpu.rank()));
    ddp::communicator_ref(gpu).allreduce(max, ddp::reduce_op::max).wait();
    CHECK(max.download() == std::vector<std::int32_t>(3, n - 1));

    device_buffer<ddp::half> h(gpu.device(), std::vector<ddp::half>(5, ddp::half(1.5f)));
    ddp::communicator_ref(gpu).allreduce(h, ddp::reduce_op::sum).wait();
    CHECK(static_cast<float>(h.download()[4]) == 1.5f * static_cast<float>(n));
  });
}

TEST_CASE("gpu: a multi-tensor allreduce of mixed dtypes is one coalesced call", "[nccl][gpu]") {
  const int n = gpu_ranks();
  if (n == 0) return;
  on_gpus(n, [n](ddp::nccl::communicator& gpu, ddp::local::communicator&) {
    device_buffer<double> a(gpu.device(), std::vector<double>(7, 1.0));
    device_buffer<std::int64_t> b(gpu.device(), std::vector<std::int64_t>(9, 2));
    device_buffer<float> empty(gpu.device(), std::size_t{0});
    const std::vector<ddp::tensor_view> ts{ddp::view(a), ddp::view(empty), ddp::view(b)};
    const auto before = gpu.issued();
    gpu.allreduce(ts, ddp::reduce_op::sum).wait();
    CHECK(gpu.issued() == before + 1);
    CHECK(a.download() == std::vector<double>(7, n));
    CHECK(b.download() == std::vector<std::int64_t>(9, 2 * n));
  });
}

TEST_CASE("gpu: broadcast, allgather, reduce_scatter, barrier", "[nccl][gpu]") {
  const int n = gpu_ranks();
  if (n == 0) return;
  on_gpus(n, [n](ddp::nccl::communicator& gpu, ddp::local::communicator&) {
    const int r = gpu.rank();
    const auto un = static_cast<std::size_t>(n);
    device_buffer<std::uint8_t> b(gpu.device(), std::vector<std::uint8_t>(16, static_cast<std::uint8_t>(r)));
    ddp::communicator_ref(gpu).broadcast(b, n - 1).wait();
    CHECK(b.download() == std::vector<std::uint8_t>(16, static_cast<std::uint8_t>(n - 1)));

    device_buffer<float> in(gpu.device(), std::vector<float>(3, static_cast<float>(r)));
    device_buffer<float> gathered(gpu.device(), 3 * un);
    gpu.allgather(ddp::view(in), ddp::view(gathered)).wait();
    const auto g = gathered.download();
    for (std::size_t i = 0; i < g.size(); ++i) CHECK(g[i] == static_cast<float>(i / 3));

    device_buffer<std::int32_t> big(gpu.device(), std::vector<std::int32_t>(2 * un, 1));
    device_buffer<std::int32_t> block(gpu.device(), std::size_t{2});
    gpu.reduce_scatter(ddp::view(big), ddp::view(block), ddp::reduce_op::sum).wait();
    CHECK(block.download() == std::vector<std::int32_t>(2, n));

    gpu.barrier().wait();
  });
}

TEST_CASE("gpu: stream_wait orders a compute stream after the collective without a host wait", "[nccl][gpu]") {
  const int n = gpu_ranks();
  if (n == 0) return;
  on_gpus(n, [n](ddp::nccl::communicator& gpu, ddp::local::communicator&) {
    device_buffer<float> x(gpu.device(), std::vector<float>(1 << 20, 1.0f));
    cudaStream_t compute = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking) == cudaSuccess);
    ddp::work w = ddp::communicator_ref(gpu).allreduce(x, ddp::reduce_op::sum);
    gpu.stream_wait(compute);
    std::vector<float> out(x.size());
    REQUIRE(cudaMemcpyAsync(out.data(), x.data(), out.size() * sizeof(float), cudaMemcpyDeviceToHost, compute) ==
            cudaSuccess);
    REQUIRE(cudaStreamSynchronize(compute) == cudaSuccess);
    CHECK(out.front() == static_cast<float>(n));
    CHECK(out.back() == static_cast<float>(n));
    CHECK(w.test());  // the copy ran after the collective, so its event has completed too
    (void)cudaStreamDestroy(compute);
  });
}

TEST_CASE("gpu: a call mixing host and device tensors is refused with a usage_error", "[nccl][gpu]") {
  const int n = gpu_ranks();
  if (n == 0) return;
  on_gpus(n, [](ddp::nccl::communicator& gpu, ddp::local::communicator&) {
    std::vector<float> host(4);
    device_buffer<float> dev(gpu.device(), std::size_t{4});
    const std::vector<ddp::tensor_view> mixed{ddp::view(dev), ddp::view(host)};
    const auto before = gpu.issued();
    CHECK_THROWS_WITH(gpu.allreduce(mixed, ddp::reduce_op::sum), Catch::Matchers::Contains("got a tensor on host"));
    CHECK_THROWS_AS(gpu.allreduce_premul_sum(mixed, 0.5), ddp::usage_error);
    CHECK_THROWS_AS(gpu.allgather(ddp::view(host), ddp::view(dev)), ddp::usage_error);
    CHECK(gpu.issued() == before);  // refused before anything was issued
  });
}

TEST_CASE("gpu: abort fails pending work and refuses later use", "[nccl][gpu]") {
  const int n = gpu_ranks();
  if (n == 0) return;
  on_gpus(n, [](ddp::nccl::communicator& gpu, ddp::local::communicator& host) {
    device_buffer<float> x(gpu.device(), std::vector<float>(4, 1.0f));
    ddp::work pending = ddp::communicator_ref(gpu).allreduce(x, ddp::reduce_op::sum);
    host.barrier().wait();  // every rank enqueued before anyone aborts
    gpu.abort();
    CHECK_THROWS_AS(pending.wait(), ddp::communication_error);
    CHECK_THROWS_AS(gpu.barrier(), ddp::usage_error);
    CHECK(gpu.native_handle() == nullptr);
  });
}

TEST_CASE("gpu: a wait whose peer never arrives times out and aborts the communicator", "[nccl][gpu]") {
  const int n = gpu_ranks();
  if (n < 2) {
    if (n == 1) std::printf("SKIPPED (needs 2 GPUs)\n");
    return;
  }
  on_gpus(n, [](ddp::nccl::communicator& gpu, ddp::local::communicator& host) {
    if (gpu.rank() == 0) {
      device_buffer<float> x(gpu.device(), std::vector<float>(4, 1.0f));
      ddp::work w = ddp::communicator_ref(gpu).allreduce(x, ddp::reduce_op::sum);
      CHECK_THROWS_AS(w.wait_for(std::chrono::milliseconds(500)), ddp::timeout_error);
      CHECK_THROWS_AS(gpu.barrier(), ddp::usage_error);  // aborted by the timeout
    }
    host.barrier().wait();
    gpu.abort();  // the other ranks tear down without waiting for rank 0
  });
}

// --- the CUDA runtime, the device queue, pre-multiplied sums, host staging ----------------------

TEST_CASE("gpu: cuda::runtime allocates, copies, zeroes and orders two streams with events", "[cuda][gpu]") {
  if (gpu_ranks() == 0) return;
  ddp::cuda::runtime rt(0);
  const ddp::device gpu = ddp::device::cuda(0);
  const ddp::device_stream a = rt.create_stream(gpu);
  const ddp::device_stream b = rt.create_stream(gpu);
  REQUIRE(a.native != nullptr);
  REQUIRE(a != b);
  constexpr std::size_t n = 1 << 20;
  constexpr std::size_t bytes = n * sizeof(float);
  std::vector<float> host(n);
  std::iota(host.begin(), host.end(), 1.0f);

  void* d1 = rt.allocate(gpu, bytes, a);
  void* d2 = rt.allocate(gpu, bytes, a);
  REQUIRE(d1 != nullptr);
  REQUIRE(d2 != nullptr);
  const ddp::copy_region up{d1, host.data(), bytes};
  rt.copy({&up, 1}, a);  // host to device
  const ddp::copy_region across{d2, d1, bytes};
  rt.copy({&across, 1}, a);  // device to device

  const ddp::device_event written = rt.create_event(gpu);
  CHECK(rt.query(written));  // never recorded: complete
  rt.record(written, a);
  rt.wait(b, written);  // b runs after a's copies; the host does not block
  std::vector<float> back(n, -1.0f);
  const ddp::copy_region down{back.data(), d2, bytes};
  rt.copy({&down, 1}, b);  // device to host, on the other stream
  const ddp::device_event done = rt.create_event(gpu);
  rt.record(done, b);
  rt.synchronize(done);
  CHECK(rt.query(done));
  CHECK(back == host);

  // Zero fill, then read back on the same stream.
  rt.zero(d2, bytes / 2, a);
  const ddp::copy_region down_a{back.data(), d2, bytes};
  rt.copy({&down_a, 1}, a);
  rt.record(done, a);
  rt.synchronize(done);
  CHECK(back.front() == 0.0f);
  CHECK(back[n / 2 - 1] == 0.0f);
  CHECK(back[n / 2] == host[n / 2]);

  // Several independent regions (one batched call where CUDA has it), and dependent ones (in order).
  rt.zero(d1, bytes, a);
  std::vector<float> chunks(n, 0.0f);
  const std::size_t q = bytes / 4;
  const std::vector<ddp::copy_region> scatter{{static_cast<std::byte*>(d1) + 3 * q, host.data() + 3 * (n / 4), q},
                                              {d1, host.data(), q},
                                              {static_cast<std::byte*>(d1) + q, host.data() + n / 4, q},
                                              {static_cast<std::byte*>(d1) + 2 * q, host.data() + n / 2, q}};
  rt.copy(scatter, a);
  const std::vector<ddp::copy_region> chain{{d2, d1, bytes}, {chunks.data(), d2, bytes}};  // read after write
  rt.copy(chain, a);
  rt.record(done, a);
  rt.synchronize(done);
  CHECK(chunks == host);

  // The legacy default stream works too (copies region by region).
  void* d3 = rt.allocate(gpu, 2 * sizeof(float), {});
  const float pair[2] = {7.0f, 8.0f};
  float pair_back[2] = {0.0f, 0.0f};
  const std::vector<ddp::copy_region> legacy{{d3, pair, sizeof(float)},
                                             {static_cast<std::byte*>(d3) + sizeof(float), pair + 1, sizeof(float)}};
  rt.copy(legacy, {});
  const ddp::copy_region legacy_down{pair_back, d3, sizeof(pair)};
  rt.copy({&legacy_down, 1}, {});
  rt.record(done, {});
  rt.synchronize(done);
  CHECK(pair_back[0] == 7.0f);
  CHECK(pair_back[1] == 8.0f);

  rt.deallocate(d3, {});
  rt.deallocate(d1, a);
  rt.deallocate(d2, a);
  rt.destroy_event(written);
  rt.destroy_event(done);
  rt.destroy_stream(a);
  rt.destroy_stream(b);
  CHECK(cudaDeviceSynchronize() == cudaSuccess);
}

TEST_CASE("gpu: cuda::runtime errors on a real device name the rank and the call", "[cuda][gpu]") {
  const int n = gpu_ranks();
  if (n == 0) return;
  ddp::cuda::runtime rt(2);
  const int past_last = ddp::nccl::visible_devices().count;
  CHECK_THROWS_WITH((void)rt.create_stream(ddp::device::cuda(past_last)),
                    Catch::Matchers::Contains("rank 2") && Catch::Matchers::Contains("cudaSetDevice failed"));
  int current = -1;
  REQUIRE(cudaGetDevice(&current) == cudaSuccess);
  const ddp::device_stream s = rt.create_stream(ddp::device::cuda(0));
  int after = -1;
  REQUIRE(cudaGetDevice(&after) == cudaSuccess);
  CHECK(after == current);  // the caller's device is restored
  rt.destroy_stream(s);
}

TEST_CASE("gpu: the NCCL communicator's device queue orders the runtime's work around collectives", "[nccl][gpu]") {
  const int n = gpu_ranks();
  if (n == 0) return;
  on_gpus(n, [n](ddp::nccl::communicator& gpu, ddp::local::communicator&) {
    const ddp::device_queue q = gpu.device_queue();
    REQUIRE(q.runtime != nullptr);
    CHECK(q.runtime->name() == "cuda");
    CHECK(q.stream == ddp::cuda::stream(gpu.stream()));
    CHECK(q.where == ddp::device::cuda(gpu.device()));
    const ddp::communicator_ref ref(gpu);
    CHECK(ref.has_device_queue());
    CHECK(ref.has_premul_sum());
    CHECK(ref.device_queue().runtime == q.runtime);

    // Allocate, fill, reduce and read back, all on the communicator's stream: one host wait at the end.
    std::vector<float> values(16, 1.5f);
    void* memory = q.runtime->allocate(q.where, values.size() * sizeof(float), q.stream);
    const ddp::copy_region up{memory, values.data(), values.size() * sizeof(float)};
    q.runtime->copy({&up, 1}, q.stream);
    const ddp::tensor_view t{memory, values.size(), ddp::dtype::f32, q.where};
    ddp::work w = gpu.allreduce(std::span<const ddp::tensor_view>(&t, 1), ddp::reduce_op::sum);
    std::vector<float> out(values.size());
    const ddp::copy_region down{out.data(), memory, out.size() * sizeof(float)};
    q.runtime->copy({&down, 1}, q.stream);
    const ddp::device_event done = q.runtime->create_event(q.where);
    q.runtime->record(done, q.stream);
    q.runtime->synchronize(done);
    CHECK(out == std::vector<float>(values.size(), 1.5f * static_cast<float>(n)));
    CHECK(w.test());
    q.runtime->destroy_event(done);
    q.runtime->deallocate(memory, q.stream);
  });
}

TEST_CASE("gpu: allreduce_premul_sum scales floats by the factor, sums integers as they are", "[nccl][gpu]") {
  const int n = gpu_ranks();
  if (n == 0) return;
  on_gpus(n, [n](ddp::nccl::communicator& gpu, ddp::local::communicator&) {
    const auto v = static_cast<float>(gpu.rank() + 1);
    device_buffer<float> f(gpu.device(), std::vector<float>(1000, v));
    device_buffer<double> d(gpu.device(), std::vector<double>(7, 3.0 * v));
    device_buffer<ddp::half> h(gpu.device(), std::vector<ddp::half>(5, ddp::half(v)));
    device_buffer<ddp::bfloat16> bf(gpu.device(), std::vector<ddp::bfloat16>(6, ddp::bfloat16(v)));
    device_buffer<std::int32_t> i(gpu.device(), std::vector<std::int32_t>(4, gpu.rank() + 1));
    const std::vector<ddp::tensor_view> ts{ddp::view(f), ddp::view(d), ddp::view(h), ddp::view(bf), ddp::view(i)};
    const auto before = gpu.issued();
    gpu.allreduce_premul_sum(ts, 0.5).wait();
    CHECK(gpu.issued() == before + 1);
    const float half_sum = 0.5f * static_cast<float>(n * (n + 1) / 2);  // exact for n <= 4
    CHECK(f.download() == std::vector<float>(1000, half_sum));
    CHECK(d.download() == std::vector<double>(7, 3.0 * static_cast<double>(half_sum)));
    CHECK(static_cast<float>(h.download()[4]) == half_sum);
    CHECK(static_cast<float>(bf.download()[5]) == half_sum);
    CHECK(i.download() == std::vector<std::int32_t>(4, n * (n + 1) / 2));  // not scaled

    // The averaging rule through communicator_ref takes the pre-multiplied path for n > 1.
    device_buffer<float> avg(gpu.device(), std::vector<float>(9, 3.0f));
    ddp::allreduce_average(gpu, ddp::view(avg), n).wait();
    CHECK(avg.download() == std::vector<float>(9, 3.0f));  // 3 * float(1/n) is exact enough for n <= 4

    CHECK_THROWS_AS(gpu.allreduce_premul_sum(ts, std::numeric_limits<double>::infinity()), ddp::usage_error);
  });
}

TEST_CASE("gpu: host tensors are staged through device memory and complete on return", "[nccl][gpu]") {
  const int n = gpu_ranks();
  if (n == 0) return;
  on_gpus(n, [n](ddp::nccl::communicator& gpu, ddp::local::communicator&) {
    const int r = gpu.rank();
    const auto un = static_cast<std::size_t>(n);
    const ddp::communicator_ref ref(gpu);

    // A device collective in flight is waited for by the staged call behind it (a host sync).
    device_buffer<float> dev(gpu.device(), std::vector<float>(1 << 16, 1.0f));
    ddp::work device_work = ref.allreduce(dev, ddp::reduce_op::sum);

    std::vector<float> f(5, static_cast<float>(r + 1));
    std::vector<std::int64_t> i(3, r + 1);
    const std::vector<ddp::tensor_view> ts{ddp::view(f), ddp::view(i)};
    const auto before = gpu.issued();
    ddp::work w = gpu.allreduce(ts, ddp::reduce_op::sum);
    CHECK(w.test());  // complete on return
    CHECK(gpu.issued() == before + 1);
    CHECK(device_work.test());
    CHECK(f == std::vector<float>(5, static_cast<float>(n * (n + 1) / 2)));
    CHECK(i == std::vector<std::int64_t>(3, n * (n + 1) / 2));

    std::vector<double> p(4, 2.0 * (r + 1));
    const std::vector<ddp::tensor_view> pv{ddp::view(p)};
    ref.allreduce_premul_sum(pv, 0.5).wait();
    CHECK(p == std::vector<double>(4, static_cast<double>(n * (n + 1) / 2)));

    std::vector<std::uint8_t> b(16, static_cast<std::uint8_t>(r));
    ref.broadcast(b, n - 1).wait();
    CHECK(b == std::vector<std::uint8_t>(16, static_cast<std::uint8_t>(n - 1)));

    std::vector<std::int32_t> in(3, r);
    std::vector<std::int32_t> gathered(3 * un, -1);
    gpu.allgather(ddp::view(in), ddp::view(gathered)).wait();
    for (std::size_t k = 0; k < gathered.size(); ++k) CHECK(gathered[k] == static_cast<std::int32_t>(k / 3));

    // In place: the input is this rank's block of the output.
    std::vector<std::int32_t> in_place(2 * un, -1);
    in_place[2 * static_cast<std::size_t>(r)] = 10 * r;
    in_place[2 * static_cast<std::size_t>(r) + 1] = 10 * r + 1;
    const ddp::tensor_view all = ddp::view(in_place);
    gpu.allgather(all.slice(2 * static_cast<std::size_t>(r), 2), all).wait();
    for (std::size_t k = 0; k < in_place.size(); ++k) {
      CHECK(in_place[k] == static_cast<std::int32_t>(10 * (k / 2) + k % 2));
    }

    std::vector<float> big(2 * un, 1.0f);
    std::vector<float> block(2, -1.0f);
    gpu.reduce_scatter(ddp::view(big), ddp::view(block), ddp::reduce_op::sum).wait();
    CHECK(block == std::vector<float>(2, static_cast<float>(n)));
    CHECK(big == std::vector<float>(2 * un, 1.0f));  // the input is not copied back
  });
}

TEST_CASE("gpu: two NCCL communicators in one process are independent", "[nccl][gpu]") {
  const int n = gpu_ranks();
  if (n == 0) return;
  // World size 1 twice on device 0, used alternately.
  {
    auto first = ddp::nccl::communicator::create(ddp::nccl::unique_id::generate(), 0, 1, 0, {.name = "first"});
    auto second = ddp::nccl::communicator::create(ddp::nccl::unique_id::generate(), 0, 1, 0, {.name = "second"});
    CHECK(first.stream() != second.stream());
    CHECK(first.device_queue().runtime != second.device_queue().runtime);
    device_buffer<float> a(0, std::vector<float>(8, 2.0f));
    device_buffer<float> b(0, std::vector<float>(8, 3.0f));
    ddp::work wa = ddp::communicator_ref(first).allreduce(a, ddp::reduce_op::sum);
    ddp::work wb = ddp::communicator_ref(second).allreduce(b, ddp::reduce_op::max);
    std::vector<int> flag{1};
    ddp::communicator_ref(second).allreduce(flag, ddp::reduce_op::sum).wait();  // staged, on the second
    wa.wait();
    wb.wait();
    CHECK(a.download() == std::vector<float>(8, 2.0f));
    CHECK(b.download() == std::vector<float>(8, 3.0f));
    CHECK(flag[0] == 1);
    first.barrier().wait();
    second.abort();  // one aborted, the other still works
    CHECK_THROWS_AS(second.barrier(), ddp::usage_error);
    first.barrier().wait();
  }
  // A second NCCL communicator bootstrapped over the first (host staging carries the id).
  on_gpus(n, [n](ddp::nccl::communicator& gpu, ddp::local::communicator&) {
    auto sub = ddp::nccl::communicator::bootstrap(gpu, gpu.device(), {.timeout = std::chrono::seconds(60)});
    CHECK(sub.rank() == gpu.rank());
    CHECK(sub.size() == n);
    device_buffer<std::int32_t> x(gpu.device(), std::vector<std::int32_t>(4, 1));
    ddp::communicator_ref(sub).allreduce(x, ddp::reduce_op::sum).wait();
    ddp::communicator_ref(gpu).allreduce(x, ddp::reduce_op::sum).wait();
    CHECK(x.download() == std::vector<std::int32_t>(4, n * n));
  });
}
