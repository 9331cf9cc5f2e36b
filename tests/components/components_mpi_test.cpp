// Bucketer and JoinContext over real MPI processes: the same cases as over local threads.
#include <catch2/catch.hpp>
#include <ddp/mpi.hpp>

#include "bucketer_cases.hpp"
#include "join_cases.hpp"

namespace {
ddp::mpi::communicator make_world() {
  ddp::mpi::options o;
  o.timeout = std::chrono::seconds(60);
  return ddp::mpi::communicator::world(o);
}
}  // namespace

TEST_CASE("Bucketer over MPI", "[mpi][bucketer]") {
  auto comm = make_world();
  REQUIRE_NOTHROW(bucketer_cases::run_all(comm));
}

TEST_CASE("Bucketer over MPI: ten re-creations on fresh communicators (seed 000)", "[mpi][bucketer]") {
  REQUIRE_NOTHROW(bucketer_cases::recreate_ten_times(make_world().rank(), [](int) { return make_world(); }));
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
