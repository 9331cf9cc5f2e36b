// ddp::shm::communicator on one node of MPI processes: the backend-generic suite plus every
// dtype, operator and size class (0, 1, 7, not divisible by the rank count, around and above
// the chunk, > 64 MiB), checked against a double reference and for bit equality across ranks,
// over both backings (MPI-3 shared window, POSIX shared memory) and both set-up paths (the MPI
// factory, the generic constructor over any communicator).
#include <catch2/catch.hpp>
#include <ddp/mpi.hpp>
#include <ddp/shm.hpp>
#include <ddp/shm/mpi.hpp>

#include <cstring>

#include "../common/test_hosts.hpp"
#include "shm_cases.hpp"

namespace {

constexpr std::size_t small_chunk = 4096;  // many chunks per call, even for small tensors

// Rounding levels of half types: once on one node, once more across test hosts (hierarchical).
int levels() { return test_hosts::count() > 1 ? 2 : 1; }

ddp::shm::mpi::setup_options posix() { return {.backing = ddp::shm::mpi::segment_backing::posix}; }

}  // namespace

TEST_CASE("shm: suite and size classes, MPI window, small chunks", "[shm][suite]") {
  auto comm = ddp::shm::mpi::world({.chunk_bytes = small_chunk});
  // One node, or one per test host (ddp-run --hosts: the same cases over the hierarchical path).
  REQUIRE(comm.topology().nodes == test_hosts::count());
  REQUIRE(comm.topology().node_size == comm.size() / test_hosts::count());
  if (comm.topology().node_size > 1) REQUIRE(std::strcmp(comm.backing(), "mpi window") == 0);
  REQUIRE_NOTHROW(shm_cases::run_all(comm, small_chunk, "window", levels()));
  REQUIRE_NOTHROW(suite::large_allreduces_in_flight(comm, 20011));
}

TEST_CASE("shm: suite and size classes, POSIX segment, small chunks", "[shm][suite]") {
  auto comm = ddp::shm::mpi::world({.chunk_bytes = small_chunk}, posix());
  if (comm.topology().node_size > 1) REQUIRE(std::strcmp(comm.backing(), "posix") == 0);
  REQUIRE_NOTHROW(shm_cases::run_all(comm, small_chunk, "posix", levels()));
}

TEST_CASE("shm: default options (256 KiB chunks), sizes around the chunk", "[shm][suite]") {
  auto comm = ddp::shm::mpi::world();
  const std::size_t chunk = comm.options().chunk_bytes;
  REQUIRE_NOTHROW(suite::run_all(comm));
  for (ddp::dtype t : {ddp::dtype::f32, ddp::dtype::bf16, ddp::dtype::f64, ddp::dtype::i8}) {
    for (ddp::reduce_op op : {ddp::reduce_op::sum, ddp::reduce_op::avg, ddp::reduce_op::max}) {
      for (std::size_t n : shm_cases::size_classes(comm.size(), chunk / ddp::size_of(t))) {
        REQUIRE_NOTHROW(shm_cases::check_allreduce(comm, t, op, n, "default", levels()));
      }
    }
  }
}

TEST_CASE("shm: the generic constructor (host-name detection, POSIX segment) over any communicator", "[shm][suite]") {
  if (test_hosts::count() > 1) {
    // Across hosts the generic constructor needs the leaders' communicator: a usage error on every rank.
    REQUIRE_THROWS_AS(
        ddp::shm::communicator<ddp::mpi::communicator>(ddp::mpi::communicator::world(), {.chunk_bytes = small_chunk}),
        ddp::usage_error);
    return;
  }
  ddp::shm::communicator<ddp::mpi::communicator> comm(ddp::mpi::communicator::world(), {.chunk_bytes = small_chunk});
  REQUIRE(comm.topology().nodes == 1);
  REQUIRE_NOTHROW(shm_cases::every_dtype_op_and_size(comm, small_chunk, "generic"));

  // Wrapping a non-owning reference works the same.
  auto mpi = ddp::mpi::communicator::world();
  ddp::shm::communicator<ddp::communicator_ref> by_ref(ddp::communicator_ref(mpi), {.chunk_bytes = small_chunk});
  REQUIRE_NOTHROW(suite::run_all(by_ref));
}

TEST_CASE("shm: allreduce larger than 64 MiB", "[shm][large]") {
  auto comm = ddp::shm::mpi::world();
  REQUIRE_NOTHROW(suite::large_allreduce(comm));
  // bf16 above 64 MiB too: the block-wise conversions at scale, against the reference.
  REQUIRE_NOTHROW(shm_cases::check_allreduce(comm, ddp::dtype::bf16, ddp::reduce_op::avg, (64u << 20) / 2 + 4099,
                                             "large", levels()));
}

TEST_CASE("shm: components pick it up unchanged (communicator_ref, concept)", "[shm]") {
  static_assert(ddp::communicator<ddp::shm::mpi_communicator>);
  auto comm = ddp::shm::mpi::world();
  ddp::communicator_ref ref(comm);
  std::vector<float> v(1000, static_cast<float>(comm.rank() + 1));
  ref.allreduce(v, ddp::reduce_op::sum).wait();
  const float want = static_cast<float>(comm.size() * (comm.size() + 1) / 2);
  for (float x : v) REQUIRE(x == want);
}
