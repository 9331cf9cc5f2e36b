// BufferReducer over ddp::mpi::communicator, 2 to 4 processes: the same suite as the local test
// (buffer_reducer_suite.hpp), plus the exact collective count seen by the backend.

#include <catch2/catch.hpp>
#include <ddp/buffer_reducer.hpp>
#include <ddp/mpi.hpp>
#include <ddp/strategies/allreduce.hpp>

#include "buffer_reducer_suite.hpp"

TEST_CASE("mpi: seed 003, counts allreduced and a running mean broadcast, in exactly 2 collectives",
          "[mpi][buffer_reducer]") {
  auto comm = ddp::mpi::communicator::world();
  REQUIRE_NOTHROW(br_suite::seed_003(comm, false));
  REQUIRE_NOTHROW(br_suite::seed_003(comm, true));

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

TEST_CASE("mpi: join hooks, by hand-made rounds and with the JoinContext", "[mpi][buffer_reducer][join]") {
  auto comm = ddp::mpi::communicator::world();
  REQUIRE_NOTHROW(br_suite::join_every_strategy(comm));
  REQUIRE_NOTHROW(br_suite::join_with_period(comm));
  for (std::uint64_t period : {1u, 2u, 3u}) {
    INFO("period " << period);
    REQUIRE_NOTHROW(br_suite::join_context_uneven(comm, period));
  }
}
