// The backend-generic collective suite over ddp::mpi::communicator, once per allreduce path:
// MPI_Iallreduce only, ddp's ring only (with small segments, so blocks span several messages),
// ddp's recursive doubling only and its halving-doubling only (3 ranks: the fold), the default mix, and with the
// communicator serialising its MPI calls.
#include <catch2/catch.hpp>
#include <ddp/mpi.hpp>

#include "../common/collective_suite.hpp"

namespace {

ddp::mpi::options mpi_only() {
  return {
      .ring_min_bytes = ddp::mpi::options::never, .recursive_doubling_max_bytes = 0, .halving_doubling_max_bytes = 0};
}
// Every size through recursive doubling (up to 1 GiB): the suite's every dtype, op and rank count.
ddp::mpi::options recursive_doubling_only() {
  return {.ring_min_bytes = ddp::mpi::options::never, .recursive_doubling_max_bytes = std::size_t{1} << 30};
}
// Every size through halving-doubling (up to 1 GiB): 3 ranks fold, counts below the rank count
// leave some ranks owning nothing.
ddp::mpi::options halving_doubling_only() {
  return {.ring_min_bytes = ddp::mpi::options::never,
          .recursive_doubling_max_bytes = 0,
          .halving_doubling_max_bytes = std::size_t{1} << 30};
}
ddp::mpi::options ring_only() { return {.ring_min_bytes = 0, .ring_segment_bytes = 1000}; }
ddp::mpi::options serialized() { return {.max_thread_level = ddp::mpi::thread_level::serialized}; }

}  // namespace

TEST_CASE("mpi: the backend-generic collective suite, default options", "[mpi][suite]") {
  auto comm = ddp::mpi::communicator::world();
  REQUIRE_NOTHROW(suite::run_all(comm));
  REQUIRE_NOTHROW(suite::allreduce_coalesced_groups(comm, 100000));
  REQUIRE_NOTHROW(suite::large_allreduces_in_flight(comm, 300000));
}

TEST_CASE("mpi: the suite with MPI_Iallreduce only", "[mpi][suite]") {
  auto comm = ddp::mpi::communicator::world(mpi_only());
  REQUIRE_NOTHROW(suite::run_all(comm));
  REQUIRE_NOTHROW(suite::allreduce_coalesced_groups(comm, 100000));
}

TEST_CASE("mpi: the suite with the ring only, in small segments", "[mpi][suite]") {
  auto comm = ddp::mpi::communicator::world(ring_only());
  REQUIRE_NOTHROW(suite::run_all(comm));
  REQUIRE_NOTHROW(suite::allreduce_coalesced_groups(comm, 4099));
  REQUIRE_NOTHROW(suite::large_allreduces_in_flight(comm, 20011));
}

TEST_CASE("mpi: the suite with recursive doubling only", "[mpi][suite]") {
  auto comm = ddp::mpi::communicator::world(recursive_doubling_only());
  REQUIRE_NOTHROW(suite::run_all(comm));
  REQUIRE_NOTHROW(suite::allreduce_coalesced_groups(comm, 4099));
  REQUIRE_NOTHROW(suite::large_allreduces_in_flight(comm, 20011));
}

TEST_CASE("mpi: the suite with halving-doubling only", "[mpi][suite]") {
  auto comm = ddp::mpi::communicator::world(halving_doubling_only());
  REQUIRE_NOTHROW(suite::run_all(comm));
  REQUIRE_NOTHROW(suite::allreduce_coalesced_groups(comm, 4099));
  REQUIRE_NOTHROW(suite::large_allreduces_in_flight(comm, 20011));
}

TEST_CASE("mpi: the suite with the communicator serialising its MPI calls", "[mpi][suite]") {
  auto comm = ddp::mpi::communicator::world(serialized());
  REQUIRE(comm.threads() <= ddp::mpi::thread_level::serialized);
  REQUIRE_NOTHROW(suite::run_all(comm));
}

TEST_CASE("mpi: allreduce larger than 64 MiB, ring and MPI_Iallreduce", "[mpi][large]") {
  auto ring = ddp::mpi::communicator::world();
  REQUIRE_NOTHROW(suite::large_allreduce(ring));
  auto mpi = ddp::mpi::communicator::world(mpi_only());
  REQUIRE_NOTHROW(suite::large_allreduce(mpi));
}
