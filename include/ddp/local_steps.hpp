#pragma once
/// @file local_steps.hpp
/// @brief Training across slow links: replicas take local steps and synchronise periodically.
/// `local_sgd` (parameters averaged every H steps), `diloco` (an outer optimizer applies the
/// averaged outer gradient every H steps), `streaming_diloco` (fragments on a staggered schedule,
/// exchanges overlapped with inner steps, merged with a mixing factor); outer gradients in their
/// own type, bf16 or 8 bits (`outer_wire`). Over any communicator; `fault_tolerant_diloco`
/// takes its outer steps as the steps of a `Manager`. docs/local-steps.md.

#include <ddp/local_steps/cost_model.hpp>
#include <ddp/local_steps/diloco.hpp>
#include <ddp/local_steps/fault_tolerant_diloco.hpp>
#include <ddp/local_steps/local_sgd.hpp>
#include <ddp/local_steps/outer_exchange.hpp>
#include <ddp/local_steps/outer_sgd.hpp>
#include <ddp/local_steps/streaming_diloco.hpp>
