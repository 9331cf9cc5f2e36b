#pragma once
/// @file testing/emulated.hpp
/// @brief The host emulation of the device runtime (`ddp::emulated_device::runtime`) and a
/// device communicator over any host communicator (`ddp::emulated_device::communicator`).
///
/// A test backend: the components' device code paths run, and are tested, on CPUs without a GPU.
/// The model (memory, lazy streams, events, sticky errors, host syncs, test hooks, what is not
/// emulated): docs/gpu-training.md, "Testing without a GPU: the emulated device".

#include <ddp/testing/emulated_communicator.hpp>
#include <ddp/testing/emulated_runtime.hpp>
