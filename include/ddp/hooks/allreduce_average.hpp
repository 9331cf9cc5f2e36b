#pragma once
/// @file hooks/allreduce_average.hpp
/// @brief The default comm hook: one in-place sum allreduce per bucket, divided on completion.
///
/// Divides after the sum (one rounding, the same on every rank), except for f16, which it divides
/// before the sum: f16 overflows at 65504, so the sum of large gradients could become infinite
/// (PyTorch's reasoning for fp16 buckets). bf16 has f32's range and keeps the exact order.

#include <ddp/comm_hook.hpp>
#include <ddp/detail/host_reduce.hpp>

namespace ddp::hooks {

/// The Bucketer's default `comm_hook` (stateless, copyable).
struct allreduce_average {
  /// Averages `b.data` over `b.divisor` ranks in place. When the divisor is the communicator size
  /// (and the bucket is not f16), this is a single `reduce_op::avg` allreduce; otherwise a sum
  /// allreduce with the division as a continuation (before the sum, for f16).
  work operator()(grad_bucket& b) const {
    const tensor_view data = b.data;
    const int divisor = b.divisor;
    // Dividing by the communicator size is the backend's own `avg`, which can do better than a
    // pass over the bucket after the sum (the MPI ring divides each rank's block once, inside
    // the collective).
    if (divisor == b.comm.size() && data.type != dtype::f16) return b.comm.allreduce(data, reduce_op::avg);
    const bool predivide = data.type == dtype::f16;
    if (predivide) detail::scale_in_place(data.type, data.data, data.count, 1.0 / divisor);
    work w = b.comm.allreduce(data, reduce_op::sum);
    if (!predivide) {
      w.then([data, divisor] { detail::divide_in_place(data.type, data.data, data.count, divisor); });
    }
    return w;
  }
};

}  // namespace ddp::hooks
