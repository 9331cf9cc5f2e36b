#pragma once
// The MPI communicator of a test program's process (every rank of the `ddp-run` launch), with a
// deadline that names a hung collective well before ctest's limit. Thread-backend tests use
// `on_ranks` (ranks.hpp) instead.

#include <chrono>

#include <ddp/mpi.hpp>

namespace test_ranks {

/// `ddp::mpi::communicator::world(o)`; by default every blocking wait bounded by 60 s.
inline ddp::mpi::communicator make_world(ddp::mpi::options o = {.timeout = std::chrono::seconds(60)}) {
  return ddp::mpi::communicator::world(o);
}

}  // namespace test_ranks
