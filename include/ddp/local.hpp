#pragma once
/// @file local.hpp
/// @brief The `local` backend: N ranks as threads of one process (tests, examples without mpirun).

#include <ddp/local/communicator.hpp>
#include <ddp/local/fabric.hpp>
