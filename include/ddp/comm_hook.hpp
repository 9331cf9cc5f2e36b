#pragma once
/// @file comm_hook.hpp
/// @brief The per-bucket collective of a Bucketer, as a replaceable hook.
///
/// A hook receives a `grad_bucket` and returns the work of whatever it launched. When that work
/// completes, `bucket.data` must hold the gradients averaged over `bucket.divisor` ranks: the
/// Bucketer only waits and copies back. On a rank that has joined (uneven inputs), the Bucketer
/// calls the same hook with `shadow = true` and zeroed data, so compression or routing through a
/// manager issues the same collectives everywhere.

#include <cstddef>
#include <functional>

#include <ddp/communicator.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp {

/// One bucket, as a comm hook sees it.
struct grad_bucket {
  std::size_t index = 0;        ///< position in launch order
  std::size_t num_buckets = 0;  ///< buckets of the step (`index < num_buckets`)
  tensor_view data;             ///< the flat bucket storage: this rank's gradients in, averages out
  communicator_ref comm;        ///< the Bucketer's communicator
  int divisor = 1;              ///< divide the sum by this (world size, or ranks still training)
  bool shadow = false;          ///< true on a joined rank: data is zeros, mirror the collectives
};

/// Any callable `work(grad_bucket&)`. Stored type-erased; must be copyable.
using comm_hook = std::function<work(grad_bucket&)>;

}  // namespace ddp
