#pragma once
/// @file fault_tolerance.hpp
/// @brief Umbrella of fault-tolerant training: the `Manager` (quorums, healing, commit), checkpoints
/// (`checkpoint_dir`), what a replica hands over (`training_state`), the owning communicator its
/// factory returns (`any_communicator`) and the backend-free rendezvous stores (in memory, in a
/// directory, prefixed). The Redis store needs `ddp::redis` (`<ddp/stores/redis_store.hpp>`), the
/// gloo and NCCL communicator factories their backends. See docs/fault-tolerance.md.

#include <ddp/any_communicator.hpp>
#include <ddp/checkpoint.hpp>
#include <ddp/manager.hpp>
#include <ddp/store.hpp>
#include <ddp/stores/file_store.hpp>
#include <ddp/stores/memory_store.hpp>
#include <ddp/stores/prefix_store.hpp>
#include <ddp/training_state.hpp>
