#pragma once
/// @file shm/mpi.hpp
/// @brief The shared-memory allreduce over MPI processes: `ddp::shm::mpi::world()`,
/// `ddp::shm::mpi::make_communicator()`, `ddp::shm::mpi::window_segment`. Link `ddp::mpi`.
/// (Without <mpi.h> on the include path this header declares nothing.)

#include <ddp/shm.hpp>
#include <ddp/shm/mpi/make_communicator.hpp>
#include <ddp/shm/mpi/window_segment.hpp>
