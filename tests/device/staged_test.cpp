// ddp::staged::communicator on the emulated device over thread ranks (1-4): every collective over
// device tensors stream-ordered (nothing runs before the stream reaches it; later stream work sees
// the result) without a host synchronisation on the caller's thread; host tensors; the pinned
// buffers reused; abort and a dead peer open the gates (the stream goes on) and fail the works;
// wrong memory is a usage_error; nothing leaks. The components over it: device_components_local.
#include <chrono>
#include <cstddef>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/local/communicator.hpp>
#include <ddp/staged/communicator.hpp>
#include <ddp/testing/emulated.hpp>

#include "../common/collective_suite.hpp"
#include "../common/ranks.hpp"

using namespace std::chrono_literals;
using test_ranks::on_ranks;
using test_ranks::require_on_ranks;
namespace emu = ddp::emulated_device;

namespace {

const ddp::device gpu0 = ddp::device::cuda(0);

// `n` f32 of emulated device memory filled with `fill(i)`, written directly (it is host memory).
template <class Fill>
float* device_floats(emu::runtime& rt, std::size_t n, Fill fill) {
  auto* p = static_cast<float*>(rt.allocate(gpu0, n * sizeof(float), {}));
  for (std::size_t i = 0; i < n; ++i) p[i] = fill(i);
  return p;
}

void sync(emu::runtime& rt, ddp::device_stream s) {
  const auto e = rt.create_event(gpu0);
  rt.record(e, s);
  rt.synchronize(e);
  rt.destroy_event(e);
}

ddp::tensor_view dview(float* p, std::size_t n) { return {p, n, ddp::dtype::f32, gpu0}; }

// The one-tensor calls take lvalues (the tensor must outlive the work); these take a view.
ddp::work allreduce(ddp::staged::communicator& c, ddp::tensor_view v, ddp::reduce_op op) {
  return c.allreduce(std::span<const ddp::tensor_view>(&v, 1), op);
}
ddp::work broadcast(ddp::staged::communicator& c, ddp::tensor_view v, int root) {
  return c.broadcast(std::span<const ddp::tensor_view>(&v, 1), root);
}

void every_collective(ddp::communicator_ref host) {
  const int r = host.rank();
  const int n = host.size();
  emu::runtime rt(r);
  {
    ddp::staged::communicator c(host, rt, gpu0);
    const ddp::device_stream s = c.device_queue().stream;
    SUITE_EXPECT(c.device_queue().runtime == &rt && c.device_queue().where == gpu0, "the queue names rt and cuda:0");
    float* a = device_floats(rt, 1000, [&](std::size_t i) { return static_cast<float>((r + 1) * (i % 7)); });
    float* b = device_floats(rt, 3, [&](std::size_t i) { return static_cast<float>(r * 10 + i); });
    float* gathered = device_floats(rt, 4 * static_cast<std::size_t>(n), [](std::size_t) { return -1.0F; });
    float* mine = device_floats(rt, 4, [&](std::size_t i) { return static_cast<float>(100 * r + i); });
    float* scattered = device_floats(rt, 2, [](std::size_t) { return -1.0F; });
    float* to_scatter = device_floats(rt, 2 * static_cast<std::size_t>(n), [&](std::size_t i) {
      return static_cast<float>(i + static_cast<std::size_t>(r));
    });
    float* premul =
        device_floats(rt, 5, [&](std::size_t i) { return static_cast<float>(r + 1) * static_cast<float>(i); });

    const std::size_t syncs = rt.host_syncs();
    const ddp::tensor_view two[] = {dview(a, 1000), dview(b, 3)};
    std::vector<ddp::work> works;
    works.push_back(c.allreduce(two, ddp::reduce_op::sum));
    works.push_back(broadcast(c, dview(b, 3), n - 1));
    works.push_back(c.allgather(dview(mine, 4), dview(gathered, 4 * static_cast<std::size_t>(n))));
    works.push_back(
        c.reduce_scatter(dview(to_scatter, 2 * static_cast<std::size_t>(n)), dview(scattered, 2), ddp::reduce_op::sum));
    const ddp::tensor_view p1[] = {dview(premul, 5)};
    works.push_back(c.allreduce_premul_sum(p1, 0.5));
    works.push_back(c.barrier());
    // Later stream work sees the results: a "kernel" enqueued now reads them.
    float seen_a = -1, seen_b = -1;
    rt.launch(s, [&] {
      seen_a = a[6];
      seen_b = b[2];
    });
    SUITE_EXPECT(rt.host_syncs() == syncs, "issuing made " << rt.host_syncs() - syncs << " host sync(s)");
    for (auto& w : works) w.wait();
    SUITE_EXPECT(rt.host_syncs() == syncs, "waiting on the works made " << rt.host_syncs() - syncs << " host sync(s)");
    sync(rt, s);
    const float sum_ranks = static_cast<float>(n * (n + 1) / 2);
    SUITE_EXPECT(seen_a == sum_ranks * 6.0F, "the kernel after the allreduce saw " << seen_a);
    // b was summed first (every rank's 10 r + i), then broadcast from the last rank.
    SUITE_EXPECT(seen_b == static_cast<float>(5 * n * (n - 1) + 2 * n),
                 "the kernel after the broadcast saw " << seen_b);
    for (std::size_t i = 0; i < 1000; ++i) {
      SUITE_EXPECT(a[i] == sum_ranks * static_cast<float>(i % 7), "allreduce a[" << i << "] = " << a[i]);
    }
    for (int q = 0; q < n; ++q) {
      for (std::size_t i = 0; i < 4; ++i) {
        const float got = gathered[static_cast<std::size_t>(q) * 4 + i];
        SUITE_EXPECT(got == static_cast<float>(100 * q + static_cast<int>(i)), "allgather block " << q << ": " << got);
      }
    }
    for (std::size_t i = 0; i < 2; ++i) {
      float want = 0;
      for (int q = 0; q < n; ++q)
        want += static_cast<float>(2 * static_cast<std::size_t>(r) + i + static_cast<std::size_t>(q));
      SUITE_EXPECT(scattered[i] == want, "reduce_scatter [" << i << "] = " << scattered[i] << ", want " << want);
    }
    for (std::size_t i = 0; i < 5; ++i) {
      SUITE_EXPECT(premul[i] == 0.5F * sum_ranks * static_cast<float>(i), "premul [" << i << "] = " << premul[i]);
    }

    // In-place allgather: this rank's block of the output is the input.
    float* in_place = device_floats(rt, 3 * static_cast<std::size_t>(n), [&](std::size_t i) {
      return i / 3 == static_cast<std::size_t>(r) ? static_cast<float>(7 * r + 1) : -1.0F;
    });
    c.allgather(dview(in_place + 3 * r, 3), dview(in_place, 3 * static_cast<std::size_t>(n))).wait();
    sync(rt, s);
    for (int q = 0; q < n; ++q) {
      SUITE_EXPECT(in_place[3 * q + 2] == static_cast<float>(7 * q + 1), "in-place allgather block " << q);
    }

    // Host tensors: run in order on the communicator's thread, complete on return.
    std::vector<float> h{static_cast<float>(r), 1.0F};
    allreduce(c, ddp::tensor_view{h.data(), 2, ddp::dtype::f32, ddp::device::host()}, ddp::reduce_op::max).wait();
    SUITE_EXPECT(h[0] == static_cast<float>(n - 1) && h[1] == 1.0F, "host allreduce: " << h[0] << ", " << h[1]);

    // Steady steps reuse the pinned buffers.
    const std::size_t held = c.staging_bytes();
    for (int t = 0; t < 20; ++t) c.allreduce(two, ddp::reduce_op::sum).wait();
    sync(rt, s);
    SUITE_EXPECT(c.staging_bytes() == held, "staging grew from " << held << " to " << c.staging_bytes() << " bytes");
    for (float* p : {a, b, gathered, mine, scattered, to_scatter, premul, in_place}) rt.deallocate(p, s);
  }
  SUITE_EXPECT(rt.host_side().live_gates() == 0, rt.host_side().live_gates() << " gates left");
  SUITE_EXPECT(rt.host_side().live_allocations() == 0, rt.host_side().live_allocations() << " pinned buffers left");
  rt.run_ready();
  SUITE_EXPECT(rt.live_events() == 0, rt.live_events() << " events left");
}

}  // namespace

TEST_CASE("staged communicator: every collective, stream-ordered, no host sync on the caller", "[device][staged]") {
  require_on_ranks(1, 4, [](ddp::communicator_ref c) { every_collective(c); });
}

TEST_CASE("staged communicator: nothing runs before the stream reaches it", "[device][staged]") {
  on_ranks(2, [](ddp::communicator_ref host) {
    emu::runtime rt(host.rank());
    ddp::staged::communicator c(host, rt, gpu0);
    const ddp::device_stream s = c.device_queue().stream;
    float* a = device_floats(rt, 4, [](std::size_t) { return -1.0F; });
    rt.hold(s);
    rt.launch(s, [a] {  // the kernel that writes the gradient, before the allreduce in stream order
      for (int i = 0; i < 4; ++i) a[i] = 1.0F;
    });
    ddp::work w = allreduce(c, dview(a, 4), ddp::reduce_op::sum);
    std::this_thread::sleep_for(50ms);
    SUITE_EXPECT(!w.test(), "the work completed while its stream was held");
    SUITE_EXPECT(a[0] == -1.0F, "the allreduce ran before the kernel before it");
    rt.release(s);
    w.wait();
    SUITE_EXPECT(a[0] == 2.0F && a[3] == 2.0F, "after the stream ran: " << a[0]);
    rt.deallocate(a, s);
  });
}

TEST_CASE("staged communicator: a dead peer and abort fail the works and open the gates", "[device][staged]") {
  // Rank 1 never calls: rank 0's allreduce times out, the communicator aborts, the stream goes on.
  on_ranks(
      2,
      [](ddp::communicator_ref host) {
        if (host.rank() == 1) return;
        emu::runtime rt(0);
        ddp::staged::communicator c(host, rt, gpu0, {.timeout = 300ms});
        const ddp::device_stream s = c.device_queue().stream;
        float* a = device_floats(rt, 4, [](std::size_t) { return 3.0F; });
        ddp::work w = allreduce(c, dview(a, 4), ddp::reduce_op::sum);
        ddp::work later = allreduce(c, dview(a, 4), ddp::reduce_op::sum);
        bool after = false;
        rt.launch(s, [&] { after = true; });
        try {
          w.wait_for(5s);
          SUITE_EXPECT(false, "the allreduce without its peer completed");
        } catch (const ddp::error& e) {
          SUITE_EXPECT(std::string(e.what()).find("allreduce") != std::string::npos,
                       "names the collective: " << e.what());
        }
        try {
          later.wait_for(5s);
          SUITE_EXPECT(false, "the allreduce after a failed one completed");
        } catch (const ddp::error&) {
        }
        sync(rt, s);  // the gates opened: the stream went on
        SUITE_EXPECT(after, "the kernel after the failed collectives never ran");
        try {
          (void)allreduce(c, dview(a, 4), ddp::reduce_op::sum);
          SUITE_EXPECT(false, "a call after the abort was accepted");
        } catch (const ddp::usage_error& e) {
          SUITE_EXPECT(std::string(e.what()).find("after abort") != std::string::npos, e.what());
        }
        rt.deallocate(a, s);
      },
      2s);
}

TEST_CASE("staged communicator: a work waited for on another thread while later calls recycle buffers",
          "[device][staged]") {
  // A Bucketer's progress thread may wait on a work while the trainer issues the next collectives,
  // which return finished jobs' buffers to the pool: the work's events must stay valid.
  on_ranks(2, [](ddp::communicator_ref host) {
    emu::runtime rt(host.rank());
    ddp::staged::communicator c(host, rt, gpu0);
    float* a = device_floats(rt, 256, [](std::size_t) { return 1.0F; });
    float* b = device_floats(rt, 256, [](std::size_t) { return 1.0F; });
    for (int round = 0; round < 20; ++round) {
      ddp::work first = allreduce(c, dview(a, 256), ddp::reduce_op::max);
      std::thread waiter([&] { first.wait(); });
      for (int k = 0; k < 5; ++k) allreduce(c, dview(b, 256), ddp::reduce_op::max).wait();
      waiter.join();
    }
    sync(rt, c.device_queue().stream);
    SUITE_EXPECT(a[0] == 1.0F && b[255] == 1.0F, "max of ones: " << a[0] << ", " << b[255]);
    rt.deallocate(a, c.device_queue().stream);
    rt.deallocate(b, c.device_queue().stream);
  });
}

TEST_CASE("staged communicator: wrong memory is a usage_error naming the call", "[device][staged]") {
  on_ranks(1, [](ddp::communicator_ref host) {
    emu::runtime rt(0);
    ddp::staged::communicator c(host, rt, gpu0);
    float* a = device_floats(rt, 4, [](std::size_t) { return 1.0F; });
    std::vector<float> h(4, 1.0F);
    const ddp::tensor_view mixed[] = {dview(a, 4), {h.data(), 4, ddp::dtype::f32, ddp::device::host()}};
    const auto expect_error = [](auto&& f, const std::string& needle) {
      try {
        f();
        SUITE_EXPECT(false, "no usage_error; expected one saying '" << needle << "'");
      } catch (const ddp::usage_error& e) {
        SUITE_EXPECT(std::string(e.what()).find(needle) != std::string::npos, "'" << needle << "' in: " << e.what());
      }
    };
    expect_error([&] { (void)c.allreduce(mixed, ddp::reduce_op::sum); }, "mixes host and device memory");
    expect_error(
        [&] {
          (void)allreduce(c, ddp::tensor_view{a, 4, ddp::dtype::f32, ddp::device::cuda(1)}, ddp::reduce_op::sum);
        },
        "cuda:1");
    expect_error([&] { ddp::staged::communicator bad(host, rt, ddp::device::host()); }, "not a device");
    rt.deallocate(a, c.device_queue().stream);
  });
}
