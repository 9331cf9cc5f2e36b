// Observability over MPI processes: the delayed rank is named; per-rank traces merge.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>

#include <catch2/catch.hpp>
#include <ddp/mpi.hpp>

#include "../common/mpi_world.hpp"
#include "observe_cases.hpp"

using namespace std::chrono_literals;

using test_ranks::make_world;

namespace {
const ddp::mpi::options world_options{.timeout = 50s};
}  // namespace

TEST_CASE("straggler over MPI: the delayed rank is named", "[mpi][straggler]") {
  auto comm = make_world(world_options);
  observe_cases::straggler_result r;
  REQUIRE_NOTHROW(r = observe_cases::delayed_rank_is_named(comm, 60ms, 4, 1));
  if (comm.rank() == 0) {
    std::printf("MPI %d ranks: delayed rank named in %d of %d iterations (smallest lateness %.1f ms for 60 ms)\n",
                comm.size(), r.named, r.iterations, r.min_late_ms);
  }
}

TEST_CASE("straggler over MPI: exchange period and join", "[mpi][straggler]") {
  auto comm = make_world(world_options);
  REQUIRE_NOTHROW(observe_cases::exchange_period(comm));
  REQUIRE_NOTHROW(observe_cases::exchange_under_join(comm));
}

TEST_CASE("timeline over MPI: per-rank files parse, hold the expected events and merge", "[mpi][timeline]") {
  auto comm = make_world(world_options);
  std::vector<std::int64_t> tag{static_cast<std::int64_t>(std::random_device{}() & 0x7fffffff)};
  comm.broadcast(tag, 0).wait();  // one directory for all ranks
  const auto dir = std::filesystem::temp_directory_path() / ("ddp-observe-mpi-" + std::to_string(tag[0]));
  if (comm.rank() == 0) std::filesystem::create_directories(dir);
  comm.barrier().wait();
  REQUIRE_NOTHROW(observe_cases::timeline_of_training(comm, dir));
  if (comm.rank() == 0) std::filesystem::remove_all(dir);
}
