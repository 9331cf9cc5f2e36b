#pragma once
/// @file nccl.hpp
/// @brief The NCCL backend: `ddp::nccl::communicator` and its helpers. Needs the CUDA runtime
/// API and `nccl.h` (link `ddp::nccl`); compiles with the host C++ compiler, no nvcc needed.

#include <ddp/nccl/communicator.hpp>
#include <ddp/nccl/device.hpp>
#include <ddp/nccl/error.hpp>
#include <ddp/nccl/features.hpp>
#include <ddp/nccl/group_guard.hpp>
#include <ddp/nccl/manager_factory.hpp>
#include <ddp/nccl/options.hpp>
#include <ddp/nccl/types.hpp>
#include <ddp/nccl/unique_id.hpp>
