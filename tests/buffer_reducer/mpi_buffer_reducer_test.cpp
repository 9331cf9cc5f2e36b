// BufferReducer over ddp::mpi::communicator, 2 to 4 processes: the same suite as the local test
// (buffer_reducer_suite.hpp), plus the exact collective count seen by the backend.

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/buffer_reducer.hpp>
#include <ddp/mpi.hpp>
#include <ddp/strategies/allreduce.hpp>
#include <ddp/world.hpp>

#include "buffer_reducer_suite.hpp"

TEST_CASE("mpi: counts allreduced and a running mean broadcast, in exactly 2 collectives", "[mpi][buffer_reducer]") {
  auto comm = ddp::mpi::communicator::world();
  REQUIRE_NOTHROW(br_suite::counts_and_running_mean(comm, false));
  REQUIRE_NOTHROW(br_suite::counts_and_running_mean(comm, true));

  std::vector<std::int64_t> seen{comm.rank() + 1, 0};
  std::vector<float> running_mean(16, static_cast<float>(comm.rank()));
  ddp::BufferReducer buffers(comm);
  buffers.add(seen, ddp::strategies::allreduce_sum{});
  buffers.add(running_mean);
  buffers.build();
  const auto before = comm.issued();
  buffers.sync();
  CHECK(comm.issued() - before == 2);
  CHECK(seen[0] == comm.size() * (comm.size() + 1) / 2);
  CHECK(running_mean[0] == 0.0f);
}

TEST_CASE("mpi: every strategy, every dtype, copy and view paths", "[mpi][buffer_reducer]") {
  auto comm = ddp::mpi::communicator::world();
  REQUIRE_NOTHROW(br_suite::every_strategy(comm));
}

TEST_CASE("ddp::world: every strategy, every dtype, copy and view paths", "[mpi][buffer_reducer][world]") {
  ddp::mpi::environment env;    // MPI is running already: adopted
  auto comm = ddp::world(env);  // across test hosts (ddp-run --hosts): the hierarchical path
  REQUIRE_NOTHROW(br_suite::every_strategy(comm));
}

TEST_CASE("mpi: mixed strategies and dtypes coalesce into one collective per group", "[mpi][buffer_reducer]") {
  auto comm = ddp::mpi::communicator::world();
  REQUIRE_NOTHROW(br_suite::mixed_groups(comm));
  REQUIRE_NOTHROW(br_suite::many_buffers_one_collective(comm));
}

TEST_CASE("mpi: period, views and copies, non-blocking sync, custom strategies", "[mpi][buffer_reducer]") {
  auto comm = ddp::mpi::communicator::world();
  REQUIRE_NOTHROW(br_suite::period(comm));
  REQUIRE_NOTHROW(br_suite::views_and_copies(comm));
  REQUIRE_NOTHROW(br_suite::async_sync(comm));
  REQUIRE_NOTHROW(br_suite::custom_strategies(comm));
}

TEST_CASE("mpi: usage errors name the buffer and the rank", "[mpi][buffer_reducer]") {
  auto comm = ddp::mpi::communicator::world();
  REQUIRE_NOTHROW(br_suite::local_errors(comm));
  REQUIRE_NOTHROW(br_suite::layout_mismatch(comm));
}

TEST_CASE("mpi: issue #13 (7): handle buffers are held by value, never as references", "[mpi][buffer_reducer]") {
  auto comm = ddp::mpi::communicator::world();
  REQUIRE_NOTHROW(br_suite::handles_by_value(comm));
}

TEST_CASE("mpi: join hooks, by hand-made rounds and with the JoinContext", "[mpi][buffer_reducer][join]") {
  auto comm = ddp::mpi::communicator::world();
  REQUIRE_NOTHROW(br_suite::join_every_strategy(comm));
  REQUIRE_NOTHROW(br_suite::join_with_period(comm));
  REQUIRE_NOTHROW(br_suite::join_batchnorm_statistics(comm));
  for (std::uint64_t period : {1u, 2u, 3u}) {
    INFO("period " << period);
    REQUIRE_NOTHROW(br_suite::join_context_uneven(comm, period));
  }
}

TEST_CASE("mpi: a rank that does not sync costs the others one timeout for all groups",
          "[mpi][buffer_reducer][timeout]") {
  constexpr auto timeout = std::chrono::milliseconds(400);
  // MPI_Iallreduce (not ddp's recursive doubling, which moves only when tested): MPI completes
  // the leaked requests once the late rank joins, below.
  auto comm = ddp::mpi::communicator::world(
      {.timeout = timeout, .recursive_doubling_max_bytes = 0, .halving_doubling_max_bytes = 0});
  // Deliberately never freed: after a timeout MPI may still write the buffers (the leaked
  // requests complete once the late rank joins, below).
  auto& a = *new std::vector<float>(5, 1.0f);
  auto& b = *new std::vector<double>(6, 1.0);
  auto& c = *new std::vector<std::int32_t>(7, 1);
  auto& buffers = *new ddp::BufferReducer<ddp::strategies::allreduce_sum>(comm);
  buffers.add(a);
  buffers.add(b);
  buffers.add(c);
  buffers.build();
  REQUIRE(buffers.stats().collectives_per_sync == 3);
  const bool late = comm.rank() == comm.size() - 1;
  if (!late) {
    const auto start = std::chrono::steady_clock::now();
    std::string message;
    try {
      buffers.sync();
      FAIL("sync() completed without the last rank");
    } catch (const ddp::timeout_error& e) {
      message = e.what();
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    INFO(message);
    CHECK(ms < 2.5 * timeout.count());  // before: work::all's 5-minute default, then one timeout per group
    CHECK_THAT(message, Catch::Contains("allreduce #1"));
    CHECK_THAT(message, Catch::Contains("400 ms timeout"));
    CHECK_THAT(message, Catch::Matches(".*waited [0-9]+ ms.*"));
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (late) REQUIRE_NOTHROW(buffers.sync());  // the others progress their leaked requests in the barrier
  MPI_Barrier(MPI_COMM_WORLD);
}
