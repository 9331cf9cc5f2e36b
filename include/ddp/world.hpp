#pragma once
/// @file world.hpp
/// @brief `ddp::world(env)`: the communicator a trainer starts from. It is node-aware: ranks that
/// share a node reduce through shared memory, and one leader per node allreduces with the other
/// nodes' leaders over ddp's own TCP ring (`shm::options::inter_node`, default
/// `across_nodes::sockets`; docs/backends-sockets.md). MPI carries the set-up and every other
/// collective. Link `ddp::mpi`.
///
/// What a "node" is: the ranks MPI puts in one `MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`
/// group, i.e. the processes that can map the same memory (Open MPI: the same host). No
/// environment variable decides it. `shm::options::node_of_rank` overrides it (tests simulate
/// several nodes on one machine with it).
///
/// Every component takes it as it takes any communicator. On one node its allreduce is complete
/// when the call returns (the copies and the sums are the work, done by the calling core); across
/// nodes over the ring it runs on a thread of the communicator's, in call order, and completes with
/// its `work` (docs/shm-allreduce.md, "Synchronisation"). Broadcast, allgather, reduce_scatter and
/// barrier go to the MPI communicator it wraps (`inner()`). The Bucketer hands it the gradients
/// directly (no bucket copies: see bucketer.hpp), and averaging is folded into its copy into
/// shared memory.
///
/// For a plain MPI communicator (every collective over MPI, non-blocking), use
/// `ddp::mpi::communicator::world(env)`.

#include <utility>

#include <ddp/mpi/environment.hpp>
#include <ddp/shm/mpi/make_communicator.hpp>
#include <ddp/shm/options.hpp>

namespace ddp {

/// The type `world()` returns: the shared-memory communicator over MPI processes.
using world_communicator = shm::mpi_communicator;

/// The node-aware communicator over every process of the job (see the file comment). Collective
/// over MPI_COMM_WORLD.
/// @throws segment_error (every rank) if the node's shared memory cannot be set up
/// @throws usage_error, mpi_error as `shm::mpi::make_communicator`
[[nodiscard]] inline world_communicator world(const mpi::environment& env, shm::options options = {},
                                              shm::mpi::setup_options setup = {}) {
  return shm::mpi::world(env, std::move(options), std::move(setup));
}

}  // namespace ddp
