#pragma once
/// @file strategies/allreduce.hpp
/// @brief `strategies::allreduce<Op>`: every rank receives the element-wise reduction over ranks,
/// and its names `allreduce_sum`, `allreduce_mean`, `allreduce_min`, `allreduce_max`.
///
/// Sums for counters, means for running statistics (ddp's averaging rule, ddp/average.hpp),
/// min/max for bounds. What a joined rank contributes, the mean's divisor under join and
/// silent integer overflow: docs/buffer-reducer.md ("Strategies", "Join").

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <ostream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <ddp/average.hpp>
#include <ddp/detail/device_fill.hpp>
#include <ddp/detail/host_reduce.hpp>
#include <ddp/error.hpp>
#include <ddp/reduce_op.hpp>
#include <ddp/strategies/buffer_group.hpp>
#include <ddp/strategies/buffer_strategy.hpp>
#include <ddp/work.hpp>

namespace ddp::strategies {

/// What a mean over ranks (`allreduce_mean`) divides by in a join round, when some ranks ran out
/// of data and contribute zeros. Outside a `JoinContext` a mean always divides by the
/// communicator's size.
enum class mean_divisor : std::uint8_t {
  /// The ranks still training in the round (default): the mean of the live ranks' values, what
  /// running statistics such as BatchNorm's means and variances need.
  training_ranks,
  /// The communicator's size: joined ranks count as zeros, and the mean shrinks as they join.
  world_size,
  /// `join_round::divisor()`: whatever `join_hook_options::divide_by_initial_world_size` says,
  /// as for the Bucketer's gradients.
  join_options,
};

/// "training ranks", "world size", "join options".
[[nodiscard]] constexpr std::string_view mean_divisor_name(mean_divisor d) noexcept {
  switch (d) {
    case mean_divisor::training_ranks: return "training ranks";
    case mean_divisor::world_size: return "world size";
    case mean_divisor::join_options: return "join options";
  }
  return "?";
}

/// One allreduce with `Op` per group and sync.
template <reduce_op Op>
struct allreduce {
  static constexpr reduce_op op = Op;  ///< the reduction
  /// For a mean (`Op == reduce_op::avg`) in a join round: what it divides by (ignored by the
  /// other reductions). Ranks compare it when the reducer is built (it is part of `name()`).
  mean_divisor divide_by = mean_divisor::training_ranks;

  /// The divisor of a mean of group `g`: the communicator's size outside a join round, else per
  /// `divide_by`.
  [[nodiscard]] int mean_divisor_of(const buffer_group& g) const noexcept {
    const int size = g.comm.size();
    if (g.round == nullptr) return size;
    switch (divide_by) {
      case mean_divisor::training_ranks: return g.round->training > 0 ? g.round->training : size;
      case mean_divisor::world_size: return size;
      case mean_divisor::join_options: return g.round->divisor();
    }
    return size;
  }

  /// Allreduces the group with `Op`, after filling it with `Op`'s identity on a joined rank; a mean
  /// is `allreduce_average` over `mean_divisor_of(g)` ranks.
  /// @throws usage_error if a group is on a device the communicator has no stream for, or a mean
  ///         of device buffers over some ranks needs a pre-multiplied sum the backend lacks
  [[nodiscard]] work sync(const buffer_group& g) const {
    if (g.joined) fill_identity(g);
    if constexpr (Op == reduce_op::avg) {
      // Every rank (joined or not) derives the same divisor from the same round, so all issue the
      // same collective and end with the same bits.
      return allreduce_average(g.comm, g.tensors, mean_divisor_of(g), average_input::raw, "BufferReducer::sync");
    } else {
      return g.comm.allreduce(g.tensors, Op);
    }
  }

  /// "allreduce(sum)", "allreduce(avg)", ...; a mean with a non-default divisor says so:
  /// "allreduce(avg, divided by world size)".
  [[nodiscard]] std::string name() const {
    std::string s = "allreduce(" + std::string(name_of(Op));
    if (Op == reduce_op::avg && divide_by != mean_divisor::training_ranks) {
      s += ", divided by " + std::string(mean_divisor_name(divide_by));
    }
    return s + ")";
  }

  /// A joined rank overwrites its values with the identity: nothing to pack.
  [[nodiscard]] bool reads_local_data(const buffer_group& g) const noexcept { return !g.joined; }

  /// Same reduction; for a mean, also the same `divide_by`.
  friend bool operator==(const allreduce& a, const allreduce& b) noexcept {
    return Op != reduce_op::avg || a.divide_by == b.divide_by;
  }
  /// Writes `name()`.
  friend std::ostream& operator<<(std::ostream& os, const allreduce& a) { return os << a.name(); }

 private:
  /// The value that leaves any other operand unchanged under `Op`.
  template <class T>
  static T identity() noexcept {
    using C = ddp::detail::compute_t<T>;
    if constexpr (Op == reduce_op::sum || Op == reduce_op::avg) {
      return T{};
    } else if constexpr (Op == reduce_op::prod) {
      return ddp::detail::store<T>(C{1});
    } else if constexpr (std::numeric_limits<C>::has_infinity) {
      return ddp::detail::store<T>(Op == reduce_op::min ? std::numeric_limits<C>::infinity()
                                                        : -std::numeric_limits<C>::infinity());
    } else {
      return Op == reduce_op::min ? std::numeric_limits<T>::max() : std::numeric_limits<T>::lowest();
    }
  }

  // A joined rank's neutral contribution: zeros enqueued on a device's stream; any other identity
  // built on the host and copied (ddp/detail/device_fill.hpp).
  static void fill_identity(const buffer_group& g) {
    for (const tensor_view& t : g.tensors) {
      const std::string what = g.describe() + ": a joined rank's neutral contribution";
      if constexpr (Op == reduce_op::sum || Op == reduce_op::avg) {
        ddp::detail::zero_fill(g.comm, t, "BufferReducer::sync", what);
      } else {
        ddp::detail::visit_dtype(t.type, [&]<class T>(T) {
          const T value = identity<T>();
          ddp::detail::pattern_fill(g.comm, t, std::as_bytes(std::span<const T>(&value, 1)), "BufferReducer::sync",
                                    what);
        });
      }
    }
  }
};

/// Sum over ranks (counters).
using allreduce_sum = allreduce<reduce_op::sum>;
/// Mean over ranks (running statistics).
using allreduce_mean = allreduce<reduce_op::avg>;
/// Element-wise minimum over ranks.
using allreduce_min = allreduce<reduce_op::min>;
/// Element-wise maximum over ranks.
using allreduce_max = allreduce<reduce_op::max>;

static_assert(buffer_strategy<allreduce_sum> && buffer_strategy<allreduce_mean> && buffer_strategy<allreduce_min> &&
              buffer_strategy<allreduce_max>);

}  // namespace ddp::strategies
