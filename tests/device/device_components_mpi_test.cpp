// Bucketer, BufferReducer and JoinContext over device memory (the emulated device) on MPI
// processes: the same cases as over threads.
#include <chrono>

#include <catch2/catch.hpp>
#include <ddp/mpi.hpp>

#include "device_cases.hpp"

TEST_CASE("device components over MPI: Bucketer, BufferReducer, JoinContext", "[mpi][device]") {
  ddp::mpi::options o;
  o.timeout = std::chrono::seconds(60);
  auto world = ddp::mpi::communicator::world(o);
  REQUIRE_NOTHROW(device_cases::run_all(world));
}
