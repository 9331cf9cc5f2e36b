// ddp::shm::communicator over the local backend (ranks as threads of one process, each with its
// own mapping of a POSIX segment): the decorator needs nothing from MPI. One node, and two
// simulated nodes whose leaders get a second local world as their communicator.
#include <catch2/catch.hpp>
#include <ddp/local.hpp>
#include <ddp/shm.hpp>

#include <memory>
#include <optional>

#include "shm_cases.hpp"

namespace {

using shm_local = ddp::shm::communicator<ddp::local::communicator>;

}  // namespace

TEST_CASE("shm over local threads: one node, every dtype, operator and size class", "[shm][local]") {
  for (int ranks : {1, 2, 3}) {
    REQUIRE_NOTHROW(ddp::local::run(ranks, [](ddp::local::communicator& c) {
      shm_local comm(std::move(c), {.chunk_bytes = 4096});  // node found by host name
      shm_cases::run_all(comm, 4096, "local");
    }));
  }
}

TEST_CASE("shm over local threads: two simulated nodes, leaders on their own local world", "[shm][local]") {
  const std::vector<int> labels{0, 0, 1, 1, 1};
  ddp::local::world leaders(2);
  REQUIRE_NOTHROW(ddp::local::run(5, [&](ddp::local::communicator& c) {
    shm_local comm(std::move(c), {.chunk_bytes = 4096, .node_of_rank = labels},
                   [&](const ddp::shm::node_topology& t) { return std::optional(leaders.rank(t.node)); });
    SUITE_EXPECT(comm.topology().nodes == 2, "two nodes");
    shm_cases::run_all(comm, 4096, "local 2 nodes", 2);
  }));
}

// The Bucketer over a backend that stages its input (shm) hands it the gradients directly: no
// copy into buckets, averaging folded into the backend's copy in (a pre-multiplied sum). Checked:
// it is chosen by default and only then; a bucket's gradients hold the average as soon as its
// collective ran (before finalize(): the mark of the direct path); the bits equal those of the
// copy path on the same communicator, over several iterations, for f32 and bf16 gradients; the
// join shadow of a rank that ran out of data (zeros from bucket storage) still averages right.
#include <ddp/bucketer.hpp>
#include <ddp/bucketing/size_capped.hpp>
#include <ddp/join.hpp>

namespace {

struct direct_result {
  bool direct = false, copy_direct = true, early = false, same_bits = false;
  std::vector<float> first;  // gradient 0 after the last step
};

// Gradients: 3 f32 tensors and one bf16 tensor; value depends on rank, tensor, element, step.
float grad_value(int rank, std::size_t k, std::size_t i, int step) {
  return static_cast<float>(shm_cases::value(ddp::dtype::f32, rank * 7 + step, i * 5 + k));
}

}  // namespace

TEST_CASE("Bucketer over shm: the direct path (gradients handed to the backend, no bucket copies)",
          "[shm][local][bucketer]") {
  for (int ranks : {2, 3}) {
    std::vector<direct_result> out(static_cast<std::size_t>(ranks));
    REQUIRE_NOTHROW(ddp::local::run(ranks, [&](ddp::local::communicator& c) {
      shm_local comm(std::move(c), {.chunk_bytes = 4096});
      const int r = comm.rank();
      const std::vector<std::size_t> sizes{3000, 17, 5000};
      std::vector<std::vector<float>> a, b;  // direct, copy path
      for (std::size_t n : sizes) {
        a.emplace_back(n);
        b.emplace_back(n);
      }
      std::vector<ddp::bfloat16> ha(999), hb(999);
      ddp::Bucketer<ddp::bucketing::size_capped> direct(comm, {.cap_bytes = 8192});
      ddp::Bucketer<ddp::bucketing::size_capped> copy(comm, {.cap_bytes = 8192}, {.direct_when_staged = false});
      for (std::size_t k = 0; k < sizes.size(); ++k) {
        direct.add(a[k]);
        copy.add(b[k]);
      }
      direct.add(ha);
      copy.add(hb);
      direct.build();
      copy.build();
      auto& res = out[static_cast<std::size_t>(r)];
      res.direct = direct.direct();
      res.copy_direct = copy.direct();
      bool same = true;
      for (int step = 0; step < 3; ++step) {
        for (std::size_t k = 0; k < sizes.size(); ++k) {
          for (std::size_t i = 0; i < sizes[k]; ++i) a[k][i] = b[k][i] = grad_value(r, k, i, step);
        }
        for (std::size_t i = 0; i < ha.size(); ++i) ha[i] = hb[i] = ddp::bfloat16(grad_value(r, 3, i, step));
        // Backward order: last registered first (the default layout's order).
        for (std::size_t k = 4; k-- > 0;) direct.mark_ready(k);
        // Every bucket launched (synchronously, on shm): gradient 0 already holds the average.
        double want0 = 0;
        for (int q = 0; q < comm.size(); ++q) want0 += grad_value(q, 0, 0, step);
        want0 /= comm.size();
        res.early = std::abs(a[0][0] - want0) < 1e-6;
        direct.finalize();
        for (std::size_t k = 4; k-- > 0;) copy.mark_ready(k);
        copy.finalize();
        for (std::size_t k = 0; k < sizes.size(); ++k) same = same && a[k] == b[k];
        for (std::size_t i = 0; i < ha.size(); ++i) same = same && ha[i].bits == hb[i].bits;
      }
      res.same_bits = same;
      res.first = a[0];
    }));
    for (int r = 0; r < ranks; ++r) {
      const auto& res = out[static_cast<std::size_t>(r)];
      INFO("ranks " << ranks << ", rank " << r);
      CHECK(res.direct);
      CHECK_FALSE(res.copy_direct);
      CHECK(res.early);
      CHECK(res.same_bits);
      CHECK(res.first == out[0].first);
    }
  }
}

TEST_CASE("Bucketer over shm: direct path and join (a rank that ran out shadows with zeros)",
          "[shm][local][bucketer][join]") {
  constexpr int ranks = 3;
  std::vector<int> steps_done(ranks);
  REQUIRE_NOTHROW(ddp::local::run(ranks, [&](ddp::local::communicator& c) {
    shm_local comm(std::move(c), {.chunk_bytes = 4096});
    const int r = comm.rank();
    std::vector<float> g(2500);
    ddp::Bucketer<ddp::bucketing::size_capped> grads(comm, {.cap_bytes = 4096});
    grads.add(g);
    grads.build();
    SUITE_EXPECT(grads.direct(), "the direct path is chosen");
    ddp::JoinContext join({}, grads);
    const int steps = 2 + r;  // rank 0: 2 steps, rank 2: 4
    for (int s = 0; s < steps; ++s) {
      join.notify();
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = grad_value(r, 0, i, s);
      grads.mark_ready(0);
      grads.finalize();
      SUITE_EXPECT(grads.last_step().buckets.at(0).path == ddp::bucket_path::direct,
                   "the bucket reports the direct path");
      // Joined ranks contribute zeros; the divisor is the initial world size (the default).
      double want = 0;
      for (int q = 0; q < ranks; ++q) {
        if (s < 2 + q) want += grad_value(q, 0, 7, s);
      }
      SUITE_EXPECT(std::abs(g[7] - static_cast<float>(want / ranks)) < 1e-6,
                   "rank " << r << " step " << s << ": got " << g[7] << ", want " << want / ranks);
    }
    join.finish();
    steps_done[static_cast<std::size_t>(r)] = steps;
  }));
  CHECK(steps_done == std::vector<int>{2, 3, 4});
}
