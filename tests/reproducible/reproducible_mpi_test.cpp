// The reproducible reduction over MPI processes: whatever the number of ranks of this run, the
// parameters after training are bit-identical to a DP=1 run of the same code computed in this
// process (over a one-rank local communicator). Registered for 1, 2, 3 and 4 ranks; rank 0
// prints the fingerprints, so the runs can also be compared with each other.
#include <cmath>
#include <cstdio>

#include <catch2/catch.hpp>
#include <ddp/local.hpp>
#include <ddp/mpi.hpp>
#include <ddp/reproducible.hpp>

#include "../common/mpi_world.hpp"
#include "training.hpp"

using test_ranks::make_world;

namespace {

template <class F>
auto on_one_local_rank(F&& f) {
  ddp::local::world w(1);
  auto c = w.rank(0);
  return f(ddp::communicator_ref(c));
}

}  // namespace

TEST_CASE("ReproducibleReducer over MPI: the same bits as DP=1", "[mpi][reproducible]") {
  auto comm = make_world();
  constexpr int steps = 10;
  for (std::size_t m : {1u, 5u, 8u, 12u, 13u}) {
    const auto got = repro_training::train_reproducible(comm, m, steps);
    const auto ref =
        on_one_local_rank([&](ddp::communicator_ref c) { return repro_training::train_reproducible(c, m, steps); });
    const auto plain = repro_training::train_default(comm, m, steps);
    const auto plain_ref =
        on_one_local_rank([&](ddp::communicator_ref c) { return repro_training::train_default(c, m, steps); });
    if (comm.rank() == 0) {
      std::printf("M=%2zu DP=%d reproducible %s (DP=1: %s)  default Bucketer %s (DP=1: %s)\n", m, comm.size(),
                  got.c_str(), ref.c_str(), plain.c_str(), plain_ref.c_str());
      std::fflush(stdout);
    }
    INFO("M=" << m << " DP=" << comm.size());
    CHECK(got == ref);
    if (comm.size() > 1 && m >= 5) CHECK(plain != plain_ref);  // without the tree, the bits follow DP
  }
}

TEST_CASE("ReproducibleReducer over MPI: large gradients in many chunks", "[mpi][reproducible]") {
  auto comm = make_world();
  constexpr std::size_t m = 7, n = 300001;
  auto run = [&](ddp::communicator_ref c, std::size_t chunk) {
    std::vector<float> g(n);
    std::vector<double> d(1000);
    ddp::ReproducibleReducer red(c, m, {.chunk_bytes = chunk, .max_chunks_in_flight = 3});
    red.add(g);
    red.add(d);
    for (std::size_t i : red.pending()) {
      for (std::size_t k = 0; k < n; ++k)
        g[k] = std::sin(static_cast<float>(k % 977) * 0.37f + static_cast<float>(i)) * 1e4f;
      for (std::size_t k = 0; k < d.size(); ++k) d[k] = std::cos(static_cast<double>(k + i)) * 1e-9;
      red.accumulate(i);
    }
    red.finalize();
    return std::make_pair(g, d);
  };
  const auto got = run(comm, std::size_t{256} << 10);
  const auto whole = run(comm, 0);
  const auto ref = on_one_local_rank([&](ddp::communicator_ref c) { return run(c, 0); });
  CHECK(got == ref);
  CHECK(whole == ref);
}
