// Bucketer and JoinContext over real MPI processes: the same cases as over local threads.
#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/mpi.hpp>
#include <ddp/shm.hpp>
#include <ddp/shm/mpi.hpp>
#include <ddp/world.hpp>

#include "../common/mpi_world.hpp"
#include "../common/test_hosts.hpp"
#include "average/average_cases.hpp"
#include "bucketer/bucketer_cases.hpp"
#include "join/join_cases.hpp"

using test_ranks::make_world;

TEST_CASE("Bucketer over MPI", "[mpi][bucketer]") {
  auto comm = make_world();
  REQUIRE_NOTHROW(bucketer_cases::run_all(comm));
}

TEST_CASE("Bucketer over MPI: ten re-creations on fresh communicators leave nothing attached", "[mpi][bucketer]") {
  REQUIRE_NOTHROW(bucketer_cases::recreate_ten_times(make_world().rank(), [](int) { return make_world(); }));
}

TEST_CASE("Averaging over MPI: every caller, the same bits, no f16 overflow", "[mpi][average]") {
  auto comm = make_world();
  REQUIRE_NOTHROW(average_cases::run_all(comm, "mpi"));
  // What the rule avoids: the backend's own avg sums f16 first, and two values near 60000 overflow.
  if (comm.size() >= 2) CHECK(average_cases::backend_avg_overflows_f16(comm));
}

TEST_CASE("Averaging over the shared-memory backend on MPI processes", "[mpi][average][shm]") {
  if (test_hosts::count() > 1) {  // across test hosts: the hierarchical path (leaders over MPI)
    auto comm = ddp::shm::mpi::world({.chunk_bytes = 4096});
    REQUIRE(comm.topology().nodes == test_hosts::count());
    REQUIRE_NOTHROW(average_cases::run_all(comm, "shm over mpi, across hosts"));
    return;
  }
  ddp::shm::communicator<ddp::mpi::communicator> comm(make_world(), {.chunk_bytes = 4096});
  REQUIRE_NOTHROW(average_cases::run_all(comm, "shm over mpi"));
}

// The default communicator (one node: shared memory; across test hosts: the hierarchical path).
TEST_CASE("Bucketer, JoinContext and averaging over ddp::world", "[mpi][bucketer][join][world]") {
  ddp::mpi::environment env;  // MPI is running already: adopted
  auto comm = ddp::world(env);
  REQUIRE(comm.topology().nodes == std::min(test_hosts::count(), comm.size()));
  REQUIRE_NOTHROW(bucketer_cases::run_all(comm));
  REQUIRE_NOTHROW(join_cases::run_all(comm));
  REQUIRE_NOTHROW(average_cases::run_all(comm, "world"));
}

TEST_CASE("JoinContext over MPI", "[mpi][join]") {
  auto comm = make_world();
  REQUIRE_NOTHROW(join_cases::run_all(comm));
}

TEST_CASE("JoinContext over MPI through the checked communicator", "[mpi][join]") {
  auto comm = make_world();
  ddp::checked_communicator checked(comm);
  REQUIRE_NOTHROW(join_cases::join_uneven_inputs(checked));
}

TEST_CASE("Bucketer over MPI: a rank that does not finalize costs the others one timeout, not one per bucket",
          "[mpi][bucketer][timeout]") {
  constexpr auto timeout = std::chrono::milliseconds(400);
  // MPI_Iallreduce (not ddp's recursive doubling, which moves only when tested): MPI completes
  // the leaked requests once the late rank joins, below.
  auto comm = ddp::mpi::communicator::world(
      {.timeout = timeout, .recursive_doubling_max_bytes = 0, .halving_doubling_max_bytes = 0});
  if (comm.size() < 2) return;
  // Deliberately never freed: after a timeout MPI may still write the buckets and gradients
  // (the leaked requests complete once the late rank joins, below).
  auto& g = *new std::vector<std::vector<float>>(4, std::vector<float>(100, 1.0f));
  auto& b = *new ddp::Bucketer(comm, ddp::bucketing::size_capped{.cap_bytes = 400, .small_bucket_bytes = 400});
  for (auto& x : g) b.add(x);
  b.build();
  REQUIRE(b.layout().size() == 4);  // 400-byte buckets: MPI_Iallreduce, progressed by any MPI call
  const bool late = comm.rank() == comm.size() - 1;
  if (!late) {
    for (std::size_t i = 0; i < g.size(); ++i) b.mark_ready(i);
    const auto start = std::chrono::steady_clock::now();
    std::string message;
    try {
      b.finalize();
      FAIL("finalize() completed without the last rank");
    } catch (const ddp::timeout_error& e) {
      message = e.what();
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    INFO(message);
    CHECK(ms < 2.5 * timeout.count());  // before: one timeout per bucket, one after the other
    CHECK_THAT(message, Catch::Contains("allreduce #1 (sum, f32 x 100)"));
    CHECK_THAT(message, Catch::Contains("400 ms timeout"));
    CHECK_THAT(message, Catch::Matches(".*waited [0-9]+ ms.*"));
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (late) {
    // Joins late; the others progress their leaked requests inside the barrier below.
    for (std::size_t i = 0; i < g.size(); ++i) b.mark_ready(i);
    REQUIRE_NOTHROW(b.finalize());
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("JoinContext over MPI: a Bucketer and a BufferReducer in one context, in both registration orders",
          "[mpi][join][order]") {
  auto comm = make_world();
  REQUIRE_NOTHROW(join_cases::bucketer_and_buffers(comm));
}

TEST_CASE("JoinContext over MPI: the issue order learned survives an iteration in which one joinable is silent",
          "[mpi][join][order]") {
  auto comm = make_world();
  REQUIRE_NOTHROW(join_cases::order_learned_across_no_sync(comm));
}

TEST_CASE("JoinContext over MPI: a rank without data shadows round 0 in the hinted order", "[mpi][join][order]") {
  auto comm = make_world();
  REQUIRE_NOTHROW(join_cases::rank_without_data(comm));
}

TEST_CASE("JoinContext over MPI: what the context learns about the issue order", "[mpi][join][order]") {
  auto comm = make_world();
  REQUIRE_NOTHROW(join_cases::learned_order(comm));
}

TEST_CASE("JoinContext over MPI: training ranks that issue their joinables in different orders get mismatch_error",
          "[mpi][join][order]") {
  auto comm = make_world();
  REQUIRE_NOTHROW(join_cases::order_disagreement(comm));
}
