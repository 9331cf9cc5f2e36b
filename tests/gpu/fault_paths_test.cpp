// GPU cases of issue #45 (run by scripts/gpu-check.sh with the other gpu_device_paths cases):
// - nccl.bounded_init_peer_never_arrives: a 2-rank NCCL communicator whose second rank never
//   calls create fails at its init deadline (non-blocking set-up, then ncclCommAbort), and the
//   process goes on to create a working 1-rank communicator (check (b));
// - staged.two_ranks_one_gpu: ddp::staged::communicator over the thread backend, two ranks sharing
//   one GPU through the CUDA runtime's page-locked memory and gates: device allreduces correct
//   and stream-ordered (the transport for replicas that cannot share an NCCL clique);
// - manager.overhead_per_step: the same Bucketer step (64 MiB of f32 gradients in 4 tensors) over
//   a plain NCCL communicator (blocking, then non-blocking as by default) and over a Manager (one
//   replica, nccl::manager_factory on a replica_stream), timed in one run: the cost of the
//   non-blocking mode and the Manager's overhead per step (check (c)); prints an OVERHEAD line
//   that scripts/gpu-check.sh tabulates.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <deque>
#include <string>
#include <vector>

#include <ddp/bucketer.hpp>
#include <ddp/bucketing/fixed.hpp>
#include <ddp/cuda/runtime.hpp>
#include <ddp/manager.hpp>
#include <ddp/nccl/manager_factory.hpp>
#include <ddp/stores/memory_store.hpp>
#include <ddp/local/communicator.hpp>
#include <ddp/nccl.hpp>
#include <ddp/staged/communicator.hpp>

#include "gpu_support.hpp"
#include "gpu_test.hpp"

namespace {

using namespace std::chrono_literals;
using gpu_test::device_buffer;

GPU_CASE("nccl.bounded_init_peer_never_arrives") {
  const auto id = ddp::nccl::unique_id::generate();
  const auto start = std::chrono::steady_clock::now();
  bool timed_out = false;
  std::string message;
  try {
    (void)ddp::nccl::communicator::create(id, 0, 2, 0, {.timeout = 30s, .init_timeout = 3s});
  } catch (const ddp::timeout_error& e) {
    timed_out = true;
    message = e.what();
  }
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
  std::printf("  the 2-rank set-up without its peer ended after %lld ms: %s\n", static_cast<long long>(took.count()),
              message.c_str());
  GPU_CHECK(timed_out);
  GPU_CHECK(took < 10s);
  GPU_CHECK(message.find("did not form within 3000 ms") != std::string::npos);
  // The process goes on: a fresh clique of one works.
  auto one = ddp::nccl::communicator::create(ddp::nccl::unique_id::generate(), 0, 1, 0, {.timeout = 30s});
  device_buffer<float> buf(0, std::vector<float>(1000, 2.0f));
  ddp::tensor_view v = buf.view();
  one.allreduce(std::span<const ddp::tensor_view>(&v, 1), ddp::reduce_op::sum).wait();
  GPU_CHECK(buf.download()[999] == 2.0f);
}

GPU_CASE("staged.two_ranks_one_gpu") {
  ddp::local::run(2, [](ddp::local::communicator& host) {
    const int r = host.rank();
    ddp::cuda::runtime rt(r);
    ddp::staged::communicator c(host, rt, ddp::device::cuda(0), {.timeout = 30s});
    constexpr std::size_t n = 1 << 20;
    std::vector<float> values(n);
    for (std::size_t i = 0; i < n; ++i) values[i] = static_cast<float>((r + 1) * static_cast<int>(i % 13));
    device_buffer<float> buf(0, values);
    std::vector<float> after(n, -1.0f);
    const ddp::tensor_view v = buf.view();
    const ddp::device_stream s = c.device_queue().stream;
    for (int step = 0; step < 5; ++step) {
      (void)c.allreduce(std::span<const ddp::tensor_view>(&v, 1), ddp::reduce_op::sum);
    }
    // Stream order: a copy enqueued after the allreduces sees their result, with no host wait.
    const ddp::copy_region down{after.data(), buf.data(), n * sizeof(float)};
    rt.copy(std::span<const ddp::copy_region>(&down, 1), s);
    const ddp::device_event e = rt.create_event(ddp::device::cuda(0));
    rt.record(e, s);
    rt.synchronize(e);
    rt.destroy_event(e);
    // Five sums of two ranks: 3 * 2^4 times the pattern.
    for (std::size_t i = 0; i < n; i += 4097) {
      GPU_CHECK_EQ(after[i], 48.0f * static_cast<float>(i % 13));
    }
  });
}

// Mean milliseconds of `steps` calls of `step` after 3 warm-ups, the device drained after each.
template <class Step>
double mean_ms(int steps, Step&& step) {
  for (int i = 0; i < 3; ++i) step();
  gpu_test::cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) {
    step();
    gpu_test::cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / steps;
}

GPU_CASE("manager.overhead_per_step") {
  constexpr std::size_t per_tensor = std::size_t{4} << 20;  // 4 x 16 MiB of f32
  std::deque<device_buffer<float>> grads;                   // not movable: a deque never moves them
  for (int i = 0; i < 4; ++i) grads.emplace_back(0, std::vector<float>(per_tensor, 1.0f));
  const auto step_of = [&](auto& bucketer) {
    return [&] {
      for (std::size_t i = grads.size(); i-- > 0;) bucketer.mark_ready(i);
      bucketer.finalize();
    };
  };
  double blocking = 0, plain = 0, managed = 0;
  for (const bool bounded : {false, true}) {  // NCCL's blocking mode, then the default non-blocking one
    auto c = ddp::nccl::communicator::create(ddp::nccl::unique_id::generate(), 0, 1, 0,
                                             {.timeout = 60s, .bounded_init = bounded});
    ddp::Bucketer<ddp::bucketing::fixed> b(c);
    for (auto& g : grads) b.add(g.view());
    b.build();
    (bounded ? plain : blocking) = mean_ms(20, step_of(b));
  }
  {
    ddp::stores::memory_store store;
    ddp::nccl::replica_stream gpu(0);
    ddp::training_state state;
    ddp::manager_options opts;
    opts.replica_id = "r0";
    opts.min_replicas = 1;
    opts.device_queue = gpu.queue();
    ddp::Manager m(store, ddp::nccl::manager_factory(gpu, {.timeout = 60s}), state, opts);
    ddp::Bucketer<ddp::bucketing::fixed> b(m);
    for (auto& g : grads) b.add(g.view());
    m.attach(b);
    const auto inner = step_of(b);
    bool committed = true;
    managed = mean_ms(20, [&] {
      m.start_quorum();
      inner();
      committed = m.should_commit() && committed;
    });
    GPU_CHECK(committed);
    GPU_CHECK(m.step() == 23);
  }
  std::printf("OVERHEAD bytes=%zu blocking_nccl_ms=%.3f plain_nccl_ms=%.3f manager_ms=%.3f ratio=%.3f\n",
              4 * per_tensor * sizeof(float), blocking, plain, managed, managed / plain);
  std::fflush(stdout);
}

}  // namespace
