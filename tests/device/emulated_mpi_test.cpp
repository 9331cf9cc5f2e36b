// The emulated device communicator over real MPI processes: a device allreduce enqueued on the
// communicator's stream, and a host allgather staged through device memory.
#include <chrono>
#include <cstdint>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/testing/emulated.hpp>
#include <ddp/mpi.hpp>

#include "../common/mpi_world.hpp"

using test_ranks::make_world;

TEST_CASE("emulated device communicator over MPI", "[mpi][device]") {
  auto host = make_world();
  const int r = host.rank();
  const int n = host.size();
  ddp::emulated_device::runtime rt(r);
  {
    ddp::emulated_device::communicator dc(host, rt, 0);
    const ddp::device_stream s = dc.device_queue().stream;

    // Device tensors: enqueued, ordered before the copy back, one host sync for all of it.
    constexpr std::size_t count = 1000;  // several ring chunks
    auto* d = static_cast<float*>(rt.allocate(ddp::device::cuda(0), count * sizeof(float), s));
    std::vector<float> in(count);
    for (std::size_t i = 0; i < count; ++i) in[i] = static_cast<float>(r + 1) * static_cast<float>(i % 7);
    const ddp::copy_region up{d, in.data(), count * sizeof(float)};
    rt.copy({&up, 1}, s);
    const ddp::tensor_view dv{d, count, ddp::dtype::f32, ddp::device::cuda(0)};
    ddp::work w = dc.allreduce(std::span<const ddp::tensor_view>(&dv, 1), ddp::reduce_op::sum);
    std::vector<float> out(count, -1);
    const ddp::copy_region down{out.data(), d, count * sizeof(float)};
    rt.copy({&down, 1}, s);
    rt.deallocate(d, s);
    CHECK(out[1] == -1);  // nothing ran yet
    const ddp::device_event e = rt.create_event(ddp::device::cuda(0));
    rt.record(e, s);
    rt.synchronize(e);
    rt.destroy_event(e);
    CHECK(w.test());
    CHECK(rt.host_syncs() == 1);
    const float ranks = static_cast<float>(n * (n + 1) / 2);
    for (std::size_t i = 0; i < count; ++i) {
      if (out[i] != ranks * static_cast<float>(i % 7)) FAIL("allreduce element " << i << ": " << out[i]);
    }

    // Host tensors: staged, complete on return, one more host sync.
    std::vector<std::int64_t> mine{r, 10 * r};
    std::vector<std::int64_t> all(2 * static_cast<std::size_t>(n), -1);
    ddp::work g = dc.allgather(ddp::view(mine), ddp::view(all));
    CHECK(g.done());
    CHECK(rt.host_syncs() == 2);
    for (int q = 0; q < n; ++q) {
      CHECK(all[2 * static_cast<std::size_t>(q)] == q);
      CHECK(all[2 * static_cast<std::size_t>(q) + 1] == 10 * q);
    }
  }
  rt.run_ready();
  CHECK(rt.live_allocations() == 0);
  CHECK(rt.live_events() == 0);
}
