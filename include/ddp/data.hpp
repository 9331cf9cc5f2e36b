#pragma once
/// @file data.hpp
/// @brief Umbrella of the data side: `data::global_batch_sampler` (every sample of every epoch
/// trained on exactly once, whatever the quorum) and the contiguous partition of items over ranks
/// it uses (`partition.hpp`). See docs/exactly-once.md.

#include <ddp/data/global_batch_sampler.hpp>
#include <ddp/partition.hpp>
