#pragma once
/// @file strategies/custom.hpp
/// @brief `strategies::custom`: a user callable as a strategy (PyTorch's buffer comm hook,
/// RFC #63041), for reductions the built-in strategies do not cover.
///
/// Accepts `f(const buffer_group&)` or `f(span<const tensor_view>, communicator_ref)` returning
/// `work` or `std::optional<work>`. What `std::nullopt` means, grouping of copies and joined
/// ranks: docs/buffer-reducer.md ("Custom strategies").

#include <concepts>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include <ddp/communicator.hpp>
#include <ddp/detail/device_fill.hpp>
#include <ddp/error.hpp>
#include <ddp/strategies/buffer_group.hpp>
#include <ddp/strategies/buffer_strategy.hpp>
#include <ddp/work.hpp>

namespace ddp::detail {
/// What a custom strategy's callable may return.
template <class R>
inline constexpr bool is_sync_result = std::same_as<R, work> || std::same_as<R, std::optional<work>>;
}  // namespace ddp::detail

namespace ddp::strategies {

/// A callable taking the whole group: `f(const buffer_group&) -> work | std::optional<work>`.
template <class F>
concept group_callable = std::invocable<F&, const buffer_group&> &&
    ddp::detail::is_sync_result<std::invoke_result_t<F&, const buffer_group&>>;

/// A callable taking the buffers and the communicator:
/// `f(std::span<const tensor_view>, communicator_ref) -> work | std::optional<work>`.
template <class F>
concept buffers_callable = std::invocable<F&, std::span<const tensor_view>, communicator_ref> &&
    ddp::detail::is_sync_result<std::invoke_result_t<F&, std::span<const tensor_view>, communicator_ref>>;

/// What `custom` (and `BufferReducer::add` with a callable) accepts.
template <class F>
concept custom_callable = std::copy_constructible<std::decay_t<F>> &&
    (group_callable<std::decay_t<F>> || buffers_callable<std::decay_t<F>>);

/// A user callable as a buffer strategy. See the file comment for its contract.
template <class F>
class custom {
  static_assert(custom_callable<F>,
                "ddp::strategies::custom<F>: F must be copyable and callable as f(const ddp::buffer_group&) or as "
                "f(std::span<const ddp::tensor_view> buffers, ddp::communicator_ref comm), returning ddp::work "
                "(an empty work means 'nothing to wait for') or std::optional<ddp::work> (std::nullopt means "
                "'no work' and is reported as an error)");

 public:
  /// @param fn     the callable; shared by every copy of this strategy
  /// @param label  its name in errors and in the cross-rank check of the reducer's layout
  explicit custom(F fn, std::string label = "custom")
      : fn_(std::make_shared<F>(std::move(fn))), label_(std::move(label)) {}

  /// @throws usage_error if the callable returns std::nullopt, or if a joined rank's buffers are
  ///         not in host memory (they cannot be zeroed) for the two-argument form
  [[nodiscard]] work sync(const buffer_group& g) const {
    if constexpr (group_callable<F>) {
      return checked(g, std::invoke(*fn_, g));
    } else if constexpr (buffers_callable<F>) {
      if (g.joined) zero(g);
      return checked(g, std::invoke(*fn_, g.buffers, g.comm));
    } else {
      return work::ready();  // unreachable: the static_assert above fired
    }
  }

  /// The label given at construction.
  [[nodiscard]] std::string name() const { return label_; }

  /// The callable (for tests and introspection).
  [[nodiscard]] const F& callable() const noexcept { return *fn_; }

  /// Copies of one object are equal: they share the callable.
  friend bool operator==(const custom& a, const custom& b) noexcept { return a.fn_ == b.fn_; }
  /// Writes the label.
  friend std::ostream& operator<<(std::ostream& os, const custom& c) { return os << c.label_; }

 private:
  work checked(const buffer_group&, work w) const { return w; }
  work checked(const buffer_group& g, std::optional<work> w) const {
    if (!w) {
      throw usage_error(g.comm.rank(), "BufferReducer::sync",
                        "custom strategy '" + label_ + "' for " + g.describe() +
                            " returned no work (std::nullopt); return ddp::work::ready() when there is nothing to do");
    }
    return std::move(*w);
  }

  // A joined rank's zeros: on a device, enqueued on the communicator's stream before the collective.
  static void zero(const buffer_group& g) {
    for (const tensor_view& t : g.tensors) {
      ddp::detail::zero_fill(g.comm, t, "BufferReducer join hook", g.describe() + " for a joined rank");
    }
  }

  std::shared_ptr<F> fn_;
  std::string label_;
};

/// Deduces the callable's type: `strategies::custom(my_lambda)`.
template <class F>
custom(F) -> custom<F>;
/// Deduces the callable's type: `strategies::custom(my_lambda, "my label")`.
template <class F>
custom(F, std::string) -> custom<F>;

}  // namespace ddp::strategies
