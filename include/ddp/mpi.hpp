#pragma once
/// @file mpi.hpp
/// @brief The MPI backend: `ddp::mpi::environment`, `ddp::mpi::communicator`, and `ddp::world(env)`,
/// the node-aware default communicator (shared memory inside a node, ddp's TCP ring between node
/// leaders, MPI for set-up and the other collectives). Link `ddp::mpi`.

#include <ddp/mpi/communicator.hpp>
#include <ddp/mpi/datatype.hpp>
#include <ddp/mpi/environment.hpp>
#include <ddp/mpi/error.hpp>
#include <ddp/mpi/options.hpp>
#include <ddp/mpi/thread_level.hpp>
#include <ddp/world.hpp>
