#pragma once
/// @file reproducible.hpp
/// @brief World-size-invariant reproducible gradient reduction: the tree over global micro-batch
/// indices (`reproducible/tree.hpp`), the local accumulator (`reproducible/accumulator.hpp`) and
/// `ReproducibleReducer` (`reproducible/reducer.hpp`). See docs/reproducible.md.

#include <ddp/partition.hpp>
#include <ddp/reproducible/accumulator.hpp>
#include <ddp/reproducible/reducer.hpp>
#include <ddp/reproducible/tree.hpp>
