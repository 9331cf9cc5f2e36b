// GPU cases of issue #45 (run by scripts/gpu-check.sh with the other gpu_device_paths cases):
// - nccl.bounded_init_peer_never_arrives: a 2-rank NCCL communicator whose second rank never
//   calls create fails at its init deadline (non-blocking set-up, then ncclCommAbort), and the
//   process goes on to create a working 1-rank communicator (check (b));
// - staged.two_ranks_one_gpu: ddp::staged::communicator over the thread backend, two ranks sharing
//   one GPU through the CUDA runtime's page-locked memory and gates: device allreduces correct
//   and stream-ordered (the transport for replicas that cannot share an NCCL clique).
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

#include <ddp/cuda/runtime.hpp>
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

}  // namespace
