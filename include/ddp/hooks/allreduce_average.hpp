#pragma once
/// @file hooks/allreduce_average.hpp
/// @brief The default comm hook: the bucket's average over `divisor` ranks, by ddp's one rule
/// for averaging (`ddp/average.hpp`: floating point divided before the sum, integers after).

#include <ddp/average.hpp>
#include <ddp/comm_hook.hpp>

namespace ddp::hooks {

/// The Bucketer's default `comm_hook` (stateless, copyable): `allreduce_average` of the bucket.
/// The Bucketer itself skips the hook on its copy path, where the division is already folded
/// into the copy into the bucket; the hook runs for zero-copy buckets and for integer buckets.
struct allreduce_average {
  /// Averages `b.data` over `b.divisor` ranks in place.
  work operator()(grad_bucket& b) const {
    return ddp::allreduce_average(b.comm, b.data, b.divisor, average_input::raw, "comm hook allreduce_average");
  }
};

}  // namespace ddp::hooks
