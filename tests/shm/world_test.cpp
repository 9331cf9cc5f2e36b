// ddp::world(env), the default communicator, over MPI processes: node-aware (one node here, and
// simulated nodes through options::node_of_rank, whose leaders then talk over MPI), with the
// Bucketer's default path on it. Checked: the Bucketer takes the direct path (no bucket copies);
// it averages right, with the same bits on every rank and the same bits as the bucket-copy path
// on the same communicator, for f32, f64 and bf16 gradients in several buckets, over several
// steps; the pre-multiplied sum of the communicator itself (every dtype and size class, through
// shm_cases) on the hierarchical path.
#include <catch2/catch.hpp>
#include <ddp/bucketer.hpp>
#include <ddp/bucketing/size_capped.hpp>
#include <ddp/mpi.hpp>
#include <ddp/world.hpp>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "../common/test_hosts.hpp"
#include "shm_cases.hpp"

namespace {

double grad_value(int rank, std::size_t k, std::size_t i, int step) {
  return shm_cases::value(ddp::dtype::f64, rank * 11 + step, i * 7 + k);
}

// Two Bucketers over `comm` (direct, and with bucket copies) on the same gradients; returns the
// number of elements that differ between them or from the average, after `steps` steps.
void bucketer_direct_matches_copies(ddp::world_communicator& comm, const std::string& label) {
  const int r = comm.rank();
  const int n = comm.size();
  std::vector<std::vector<float>> fa{std::vector<float>(70000), std::vector<float>(33), std::vector<float>(9000)};
  auto fb = fa;
  std::vector<double> da(5000), db(5000);
  std::vector<ddp::bfloat16> ha(4097), hb(4097);
  ddp::Bucketer<ddp::bucketing::size_capped> direct(comm, {.cap_bytes = 64 << 10, .small_bucket_bytes = 16 << 10});
  ddp::Bucketer<ddp::bucketing::size_capped> copies(comm, {.cap_bytes = 64 << 10, .small_bucket_bytes = 16 << 10},
                                                    {.direct_when_staged = false});
  for (auto& g : fa) direct.add(g);
  for (auto& g : fb) copies.add(g);
  direct.add(da);
  copies.add(db);
  direct.add(ha);
  copies.add(hb);
  direct.build();
  copies.build();
  SUITE_EXPECT(direct.direct(), label << ": the default Bucketer over ddp::world takes the direct path");
  SUITE_EXPECT(!copies.direct(), label << ": direct_when_staged = false copies");
  SUITE_EXPECT(direct.layout().size() >= 4, label << ": several buckets (" << direct.layout().size() << ")");
  for (int step = 0; step < 3; ++step) {
    for (std::size_t k = 0; k < fa.size(); ++k) {
      for (std::size_t i = 0; i < fa[k].size(); ++i)
        fa[k][i] = fb[k][i] = static_cast<float>(grad_value(r, k, i, step));
    }
    for (std::size_t i = 0; i < da.size(); ++i) da[i] = db[i] = grad_value(r, 3, i, step);
    for (std::size_t i = 0; i < ha.size(); ++i)
      ha[i] = hb[i] = ddp::bfloat16(static_cast<float>(grad_value(r, 4, i, step)));
    for (std::size_t k = 5; k-- > 0;) direct.mark_ready(k);
    direct.finalize();
    for (std::size_t k = 5; k-- > 0;) copies.mark_ready(k);
    copies.finalize();
    const std::string where = label + " step " + std::to_string(step);
    for (std::size_t k = 0; k < fa.size(); ++k) {
      SUITE_EXPECT(std::memcmp(fa[k].data(), fb[k].data(), fa[k].size() * 4) == 0,
                   where << ": f32 gradient " << k << " differs from the bucket-copy path");
      for (std::size_t i = 0; i < fa[k].size(); i += 97) {
        double want = 0;
        for (int q = 0; q < n; ++q) want += static_cast<float>(grad_value(q, k, i, step));
        SUITE_EXPECT(std::abs(fa[k][i] - want / n) <= 1e-6,
                     where << ": f32 gradient " << k << "[" << i << "] = " << fa[k][i] << ", want " << want / n);
      }
    }
    SUITE_EXPECT(da == db, where << ": f64 gradient differs from the bucket-copy path");
    SUITE_EXPECT(ha == hb, where << ": bf16 gradient differs from the bucket-copy path");
    suite::buffer mine(ddp::dtype::f32, fa[0].size());
    std::memcpy(mine.bytes.data(), fa[0].data(), mine.bytes.size());
    suite::expect_same_bits_everywhere(comm, mine, where + ": f32 gradient 0");
  }
}

}  // namespace

TEST_CASE("ddp::world: the real nodes (one, or one per test host); the Bucketer's direct path", "[shm][world]") {
  ddp::mpi::environment env;  // MPI is running already: adopted
  auto comm = ddp::world(env);
  const int hosts = test_hosts::count();
  REQUIRE(comm.topology().nodes == std::min(hosts, comm.size()));
  REQUIRE(comm.stages_input());
  REQUIRE(ddp::communicator_ref(comm).has_premul_sum());
  const std::string label = std::to_string(comm.topology().nodes) + " real node(s)";
  REQUIRE_NOTHROW(bucketer_direct_matches_copies(comm, label));
  if (hosts > 1) REQUIRE_NOTHROW(shm_cases::premul_sum_matches_scale_then_sum(comm, 4096, label));
}

TEST_CASE("ddp::world: simulated nodes (leaders over MPI); direct path and pre-multiplied sums", "[shm][world]") {
  ddp::mpi::environment env;
  int ranks = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const auto halves = shm_cases::halves(ranks);
  // Across test hosts (placed by block), halves that span a host are refused on every rank.
  const int per_host = ranks / test_hosts::count();
  bool spans_hosts = false;
  for (int r = 1; r < ranks; ++r) spans_hosts |= halves[r] == halves[r - 1] && r / per_host != (r - 1) / per_host;
  if (spans_hosts) {
    REQUIRE_THROWS_WITH(ddp::world(env, {.node_of_rank = halves}),
                        Catch::Contains("node_of_rank puts ranks of different hosts in node"));
    return;
  }
  auto comm = ddp::world(env, {.chunk_bytes = 4096, .node_of_rank = halves});
  REQUIRE(comm.topology().nodes == (comm.size() > 1 ? 2 : 1));
  REQUIRE_NOTHROW(bucketer_direct_matches_copies(comm, "two nodes"));
  REQUIRE_NOTHROW(shm_cases::premul_sum_matches_scale_then_sum(comm, 4096, "two nodes"));
}
