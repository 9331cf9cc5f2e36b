#pragma once
/// @file shm.hpp
/// @brief The shared-memory, hierarchical allreduce: `ddp::shm::communicator<Inner>` wraps any
/// communicator. Needs no backend; for MPI processes include `<ddp/shm/mpi.hpp>` (MPI-3 shared
/// windows, node detection, leaders' communicator). Never includes <mpi.h>.

#include <ddp/shm/arena.hpp>
#include <ddp/shm/communicator.hpp>
#include <ddp/shm/kernels.hpp>
#include <ddp/shm/layout.hpp>
#include <ddp/shm/node_engine.hpp>
#include <ddp/shm/options.hpp>
#include <ddp/shm/posix_segment.hpp>
#include <ddp/shm/segment.hpp>
#include <ddp/shm/spin_wait.hpp>
#include <ddp/shm/tensor_group.hpp>
#include <ddp/shm/topology.hpp>
