#pragma once
/// @file shm/mpi.hpp
/// @brief The shared-memory allreduce over MPI processes: `ddp::shm::mpi::world()`,
/// `ddp::shm::mpi::make_communicator()`, `ddp::shm::mpi::window_segment`. Link `ddp::mpi` (these
/// headers include <mpi.h>, like every header under ddp/mpi/).

#include <ddp/shm.hpp>
#include <ddp/shm/mpi/make_communicator.hpp>
#include <ddp/shm/mpi/window_segment.hpp>
