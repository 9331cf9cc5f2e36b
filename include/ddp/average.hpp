#pragma once
/// @file average.hpp
/// @brief The one rule by which ddp averages over ranks, and `allreduce_average`, the one function
/// every component averages with: the Bucketer (its copy path and its default comm hook), the
/// `allreduce_mean` buffer strategy, the Manager's comm hook and the compression hooks.
///
/// Floating point: each rank multiplies by `1/d`, then the values are summed (f16 cannot
/// overflow; PyTorch DDP's order); integers: the sum, then a division truncating toward zero.
/// Why, the pre-multiplied sum and the test that holds every caller to the same bits:
/// docs/averaging.md.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/communicator.hpp>
#include <ddp/detail/host_reduce.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/reduce_op.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp {

/// What the tensors passed to `allreduce_average` hold.
enum class average_input : std::uint8_t {
  /// This rank's values as they are.
  raw,
  /// Floating-point tensors already hold `value * (1/d)` (`average_copy` wrote them); integer
  /// tensors hold their values as they are.
  divided,
};

/// True when the rule divides `t` before the sum (every floating dtype), false when it divides
/// the sum (integers).
[[nodiscard]] constexpr bool average_divides_first(dtype t) noexcept { return is_floating(t); }

/// `dst[i] = src[i] * (1/divisor)` for floating dtypes, in the rule's arithmetic; a plain copy for
/// integers (their division comes after the sum). One pass: the Bucketer's copy into a bucket.
inline void average_copy(dtype t, void* dst, const void* src, std::size_t n, int divisor) noexcept {
  detail::scaled_copy(t, dst, src, n, average_divides_first(t) ? 1.0 / divisor : 1.0);
}

/// `data[i] *= 1/divisor` for floating dtypes, in the rule's arithmetic (the same bits as
/// `average_copy`); integers are left alone.
inline void average_divide_in_place(dtype t, void* data, std::size_t n, int divisor) noexcept {
  if (average_divides_first(t)) detail::scale_in_place(t, data, n, 1.0 / divisor);
}

namespace detail {

// allreduce_average over device tensors: the device cannot be touched from here, so the division
// is the backend's: its pre-multiplied sum (NCCL: ncclRedOpCreatePreMulSum, the rule exactly), or,
// over every rank, its avg (NCCL's ncclAvg pre-multiplies floating types by 1/n and divides
// integer sums: the rule again).
[[nodiscard]] inline work allreduce_average_on_device(communicator_ref comm, std::span<const tensor_view> tensors,
                                                      int divisor, average_input input, std::string_view caller) {
  bool all_floating = true;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const tensor_view& t = tensors[i];
    if (t.where.is_host()) {
      throw usage_error(comm.rank(), std::string(caller),
                        "tensor " + std::to_string(i) + " is in host memory and tensor 0 is on " +
                            tensors[0].where.str() + ": one average is over device tensors or host tensors, not both");
    }
    all_floating = all_floating && average_divides_first(t.type);
  }
  if (input == average_input::divided || divisor == 1) return comm.allreduce(tensors, reduce_op::sum);
  if (all_floating && comm.has_premul_sum()) return comm.allreduce_premul_sum(tensors, 1.0 / divisor);
  if (divisor == comm.size()) return comm.allreduce(tensors, reduce_op::avg);
  throw usage_error(comm.rank(), std::string(caller),
                    "an average of device tensors over " + std::to_string(divisor) + " of " +
                        std::to_string(comm.size()) +
                        " ranks (a join round or a Manager quorum) needs floating-point tensors and a backend with a "
                        "pre-multiplied sum (the NCCL backend has one)");
}

}  // namespace detail

/// Launches the average over ranks of `tensors`, in place, by the rule above: on completion every
/// rank holds the same bits. `caller` names the operation in errors ("Bucketer", "BufferReducer::
/// sync", ...). Raw floating-point values go to the backend's pre-multiplied sum when it has one;
/// otherwise they are divided in place before the collective is issued (a failed average then
/// leaves them divided).
/// Device tensors (all of a call on the device) are averaged by the backend: its pre-multiplied
/// sum, or its `avg` over every rank (see `detail::allreduce_average_on_device`).
/// @throws usage_error if `divisor` < 1, if host and device tensors are mixed, or if device
///         tensors are averaged over fewer than all ranks without a pre-multiplied sum
[[nodiscard]] inline work allreduce_average(communicator_ref comm, std::span<const tensor_view> tensors, int divisor,
                                            average_input input = average_input::raw,
                                            std::string_view caller = "allreduce_average") {
  if (divisor < 1) {
    throw usage_error(comm.rank(), std::string(caller),
                      "an average over " + std::to_string(divisor) + " ranks: the divisor must be at least 1");
  }
  if (std::any_of(tensors.begin(), tensors.end(), [](const tensor_view& t) { return !t.where.is_host(); })) {
    return detail::allreduce_average_on_device(comm, tensors, divisor, input, caller);
  }
  // Raw floating-point values are scaled by the backend on their way in, when it can.
  const bool premul = input == average_input::raw && divisor > 1 && comm.has_premul_sum();
  const auto sum = [&] {
    return premul ? comm.allreduce_premul_sum(tensors, 1.0 / divisor) : comm.allreduce(tensors, reduce_op::sum);
  };
  bool any_integer = false;
  for (const tensor_view& t : tensors) {
    if (!average_divides_first(t.type)) {
      any_integer = true;
      continue;
    }
    if (premul || input == average_input::divided || divisor == 1 || t.count == 0) continue;
    average_divide_in_place(t.type, t.data, t.count, divisor);
  }
  if (!any_integer || divisor == 1) return sum();

  bool all_integer = true;
  for (const tensor_view& t : tensors) all_integer = all_integer && !average_divides_first(t.type);
  // Integers over every rank: the backend's own avg (sum, then divide toward zero) is the rule.
  if (all_integer && divisor == comm.size()) return comm.allreduce(tensors, reduce_op::avg);

  std::vector<tensor_view> integers;
  for (const tensor_view& t : tensors) {
    if (!average_divides_first(t.type)) integers.push_back(t);
  }
  work w = sum();
  w.then([integers = std::move(integers), divisor] {
    for (const tensor_view& t : integers) detail::divide_in_place(t.type, t.data, t.count, divisor);
  });
  return w;
}

/// `allreduce_average` of one tensor.
[[nodiscard]] inline work allreduce_average(communicator_ref comm, const tensor_view& tensor, int divisor,
                                            average_input input = average_input::raw,
                                            std::string_view caller = "allreduce_average") {
  return allreduce_average(comm, std::span<const tensor_view>(&tensor, 1), divisor, input, caller);
}

}  // namespace ddp
