#pragma once
/// @file shm/average_hook.hpp
/// @brief `average_hook`: a Bucketer comm hook that asks the communicator for `avg` instead of a
/// sum followed by a division pass.
///
/// Over `shm::communicator` the division happens inside the reduction kernel, on data already in
/// registers, so a bucket costs one pass over memory less than with `hooks::allreduce_average`
/// (which divides the whole bucket again after the sum). The result is bit-identical on every
/// rank either way. When the divisor is not the communicator size (a rank has joined, uneven
/// inputs) it falls back to the default hook, which divides by the divisor it is given.

#include <ddp/comm_hook.hpp>
#include <ddp/hooks/allreduce_average.hpp>
#include <ddp/reduce_op.hpp>

namespace ddp::shm {

/// Bucketer comm hook for the shared-memory path: the communicator's own `avg` (divided inside
/// the node reduction) when averaging over every rank, the default hook otherwise.
struct average_hook {
  /// Launches the bucket's average.
  work operator()(grad_bucket& b) const {
    if (b.divisor != b.comm.size()) return hooks::allreduce_average{}(b);
    return b.comm.allreduce(b.data, reduce_op::avg);
  }
};

}  // namespace ddp::shm
