// Local steps over MPI processes (1-4 ranks): the same cases as over threads. The equivalences
// hold bit for bit on any backend; a serial reference sums ranks in rank order, which ddp's MPI
// algorithms need not do at 3-4 ranks, so there the native and bf16 wires are compared within
// rounding (int8 sums in rank order on every rank by construction: bit for bit everywhere).
#include <cmath>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/local_steps.hpp>
#include <ddp/mpi.hpp>

#include "../common/mpi_world.hpp"
#include "local_steps_cases.hpp"

using namespace local_steps_cases;
using test_ranks::make_world;

namespace {

// Every rank's `v`, by rank.
template <class T>
std::vector<std::vector<T>> gather(ddp::communicator_ref c, std::vector<T> v) {
  std::vector<T> all(v.size() * static_cast<std::size_t>(c.size()));
  c.allgather(ddp::view(v), ddp::view(all)).wait();
  std::vector<std::vector<T>> out;
  for (int r = 0; r < c.size(); ++r) out.emplace_back(all.begin() + r * v.size(), all.begin() + (r + 1) * v.size());
  return out;
}

// `got` equals `want`: bit for bit when `exact`, else within rounding (relative `eps`: a bf16
// wire summed in another order may differ by one bf16 unit, which later outer steps carry on).
void check_close(const std::vector<float>& got, const std::vector<float>& want, bool exact, double eps = 1e-3) {
  if (exact) {
    CHECK(same_bits(got, want));
    return;
  }
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).epsilon(eps).margin(eps / 10));
}

}  // namespace

TEST_CASE("LocalSGD and DiLoCo over MPI: the same bits on every rank, the serial reference's values",
          "[mpi][local_steps]") {
  auto comm = make_world();
  const int n = comm.size();
  const run_setup s{.steps = 12};
  const auto lsgd = gather(comm, run_local_sgd<float>(comm, 3, s));
  const auto lsgd_ref = reference_local_sgd<float>(n, 3, s);
  for (int r = 0; r < n; ++r) {
    CHECK(same_bits(lsgd[0], lsgd[r]));
    check_close(lsgd[r], lsgd_ref[r], n <= 2);
  }
  for (auto wire : {ddp::outer_wire::native, ddp::outer_wire::bf16, ddp::outer_wire::int8}) {
    INFO("wire " << name_of(wire));
    const ddp::diloco_options<> o{.sync_every = 4, .outer = {.lr = 0.7, .momentum = 0.9}, .wire = wire};
    const auto got = gather(comm, run_diloco<float>(comm, o, s));
    const auto want = reference_streaming<float>(
        n, {.sync_every = 4, .fragments = 1, .delay = 0, .alpha = 1, .outer = o.outer, .wire = wire}, s);
    for (int r = 0; r < n; ++r) {
      CHECK(same_bits(got[0], got[r]));
      check_close(got[r], want[r], n <= 2 || wire == ddp::outer_wire::int8,
                  wire == ddp::outer_wire::bf16 ? 2e-2 : 1e-3);
    }
  }
}

TEST_CASE("DiLoCo with H = 1, outer lr 1, no momentum is data-parallel SGD over MPI, bit for bit",
          "[mpi][local_steps]") {
  auto comm = make_world();
  const ddp::diloco_options<> o{.sync_every = 1, .outer = {.lr = 1, .momentum = 0, .nesterov = false}};
  const run_setup s{.steps = 4, .eta = 1.0 / 256, .kind = data_kind::exact};
  bool exact = true;
  const auto dl = run_diloco<double>(comm, o, s, &exact);
  REQUIRE(exact);
  CHECK(same_bits(run_sync_dp<double>(comm, s), dl));
}

TEST_CASE("Streaming DiLoCo over MPI: one fragment is DiLoCo; fragments match the reference", "[mpi][local_steps]") {
  auto comm = make_world();
  const int n = comm.size();
  const ddp::outer_sgd outer{.lr = 0.7, .momentum = 0.9, .nesterov = true};
  const run_setup s{.steps = 14};
  CHECK(same_bits(run_diloco<float>(comm, {.sync_every = 4, .outer = outer}, s),
                  run_streaming<float>(comm, {.sync_every = 4, .outer = outer}, s)));
  const ddp::streaming_diloco_options<> o{.sync_every = 6, .fragments = 3, .delay = 1, .alpha = 0.5, .outer = outer};
  const run_setup s18{.steps = 18};
  const auto got = gather(comm, run_streaming<float>(comm, o, s18));
  const auto want = reference_streaming<float>(n, o, s18);
  for (int r = 0; r < n; ++r) check_close(got[r], want[r], n <= 2);
}
