// Bucketer, BufferReducer and JoinContext over device memory (the emulated device) on MPI
// processes: the same cases as over threads.
#include <catch2/catch.hpp>
#include <ddp/mpi.hpp>

#include "../common/mpi_world.hpp"
#include "device_cases.hpp"

TEST_CASE("device components over MPI: Bucketer, BufferReducer, JoinContext", "[mpi][device]") {
  auto world = test_ranks::make_world();
  REQUIRE_NOTHROW(device_cases::run_all(world));
}
