#pragma once
/// @file mpi.hpp
/// @brief The MPI backend: `ddp::mpi::environment` and `ddp::mpi::communicator`. Link `ddp::mpi`.

#include <ddp/mpi/communicator.hpp>
#include <ddp/mpi/datatype.hpp>
#include <ddp/mpi/environment.hpp>
#include <ddp/mpi/error.hpp>
#include <ddp/mpi/options.hpp>
#include <ddp/mpi/thread_level.hpp>
