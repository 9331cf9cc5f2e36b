#pragma once
/// @file observe.hpp
/// @brief Umbrella of observability: straggler attribution (`straggler.hpp`), the per-rank
/// Chrome-trace timeline and its merge (`timeline.hpp`), progress of long operations
/// (`progress.hpp`). See docs/observability.md.

#include <ddp/progress.hpp>
#include <ddp/straggler.hpp>
#include <ddp/timeline.hpp>
