// Bucketer, BufferReducer and JoinContext over device memory (the emulated device) on MPI
// processes: the same cases as over threads, over the emulated device communicator and the staged one.
#include <catch2/catch.hpp>
#include <ddp/mpi.hpp>

#include "../common/mpi_world.hpp"
#include "device_cases.hpp"

TEST_CASE("device components over MPI: Bucketer, BufferReducer, JoinContext", "[mpi][device]") {
  auto world = test_ranks::make_world();
  REQUIRE_NOTHROW(device_cases::run_all(world));
}

TEST_CASE("device components over MPI through the staged communicator (host copies behind gates)",
          "[mpi][device][staged]") {
  auto world = test_ranks::make_world();
  REQUIRE_NOTHROW(device_cases::run_all<device_cases::staged_rig>(world));
}
