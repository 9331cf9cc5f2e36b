#pragma once
/// @file buffer_reducer.hpp
/// @brief `BufferReducer<Strategy>`: keeps model buffers (running statistics, counters, ...)
/// consistent across ranks, with a strategy per buffer and one collective per group of buffers
/// that share a strategy, a dtype and a device.
///
/// This header is the public class; its knobs are in buffer_reducer/options.hpp, what it
/// reports in buffer_reducer/stats.hpp, its join hook in buffer_reducer/join_hook.hpp, the
/// engine in buffer_reducer/engine.hpp, strategies in ddp/strategies/.
/// Copy and view paths, ordering, progress, join and errors: docs/buffer-reducer.md.

#include <concepts>
#include <cstddef>
#include <memory>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include <ddp/buffer_reducer/engine.hpp>
#include <ddp/buffer_reducer/join_hook.hpp>
#include <ddp/buffer_reducer/options.hpp>
#include <ddp/buffer_reducer/stats.hpp>
#include <ddp/communicator.hpp>
#include <ddp/dtype.hpp>
#include <ddp/joinable.hpp>
#include <ddp/strategies/any.hpp>
#include <ddp/strategies/broadcast.hpp>
#include <ddp/strategies/buffer_group.hpp>
#include <ddp/strategies/buffer_strategy.hpp>
#include <ddp/strategies/custom.hpp>
#include <ddp/tensor.hpp>
#include <ddp/timeline.hpp>
#include <ddp/work.hpp>

namespace ddp {

/// Typed handle of a buffer that lives in a reducer's storage (see `BufferReducer::emplace`).
template <element T>
struct buffer_handle {
  std::size_t index = 0;  ///< registration index
  /// Same registration index.
  friend bool operator==(const buffer_handle&, const buffer_handle&) = default;
};

namespace detail {
/// False for every type: a `static_assert` that fires only when its branch is instantiated.
template <class>
inline constexpr bool always_false = false;
}  // namespace detail

/// Keeps buffers consistent across ranks; see the file comment.
///
/// @tparam Strategy  the default strategy: what `add(buffer)` and `emplace<T>(count)` use.
///                   `add(buffer, strategy)` overrides it per buffer with any strategy type, or
///                   with a callable (wrapped in `strategies::custom`).
template <buffer_strategy Strategy = strategies::broadcast>
class BufferReducer {
 public:
  using strategy_type = Strategy;                   ///< the default strategy's type
  using join_hook_type = buffer_reducer_join_hook;  ///< what `join_hook()` returns

  /// @param comm              the communicator; must outlive the reducer and its pending work
  /// @param default_strategy  the strategy of buffers added without one
  /// @param options           the sync period
  /// @throws usage_error if `options.period` is 0
  explicit BufferReducer(communicator_ref comm, Strategy default_strategy = Strategy{},
                         buffer_reducer_options options = {})
      : default_(std::move(default_strategy)), state_(std::make_shared<detail::buffer_reducer_state>(comm, options)) {}

  /// With a default-constructed default strategy.
  /// @throws usage_error if `options.period` is 0
  BufferReducer(communicator_ref comm, buffer_reducer_options options) requires std::default_initializable<Strategy>
      : BufferReducer(comm, Strategy{}, options) {}

  /// Moving keeps pending work valid (the state is shared with it); a moved-from reducer may only
  /// be destroyed or assigned to.
  BufferReducer(BufferReducer&&) noexcept = default;
  /// As the move constructor; the reducer assigned to drops its state (pending work of its own
  /// keeps that state alive until done or destroyed).
  BufferReducer& operator=(BufferReducer&&) noexcept = default;
  BufferReducer(const BufferReducer&) = delete;
  BufferReducer& operator=(const BufferReducer&) = delete;
  /// Never communicates. Storage that a pending sync still uses stays alive until its work is
  /// done or destroyed.
  ~BufferReducer() = default;

  // ---- registration ---------------------------------------------------------------------------

  /// Registers a buffer the trainer owns (copy path), with the default strategy.
  /// @return its registration index (errors name buffers by it)
  template <class T>
  std::size_t add(T&& buffer) {
    return add(std::forward<T>(buffer), default_);
  }

  /// Registers a buffer the trainer owns, with `strategy`: a `buffer_strategy`, or a callable
  /// taken as `strategies::custom`. What the reducer keeps depends on the buffer's type:
  /// - a handle (`ddp::is_tensor_handle_v`: `at::Tensor`-like types, `std::span`), lvalue or
  ///   temporary, const too if its traits take `const T&`: a copy, which shares the trainer's
  ///   storage, so `for (auto& kv : module->named_buffers()) buffers.add(kv.value())` is safe
  ///   after the temporary dictionary is gone;
  /// - any other tensor, as an lvalue: a reference, re-read at each sync (a std::vector may
  ///   reallocate); the object must outlive the reducer;
  /// - a `tensor_view`: the view;
  /// - a temporary of another type, or a const buffer whose traits need a mutable one: does not
  ///   compile.
  /// The size, dtype and device must stay as they were at registration.
  /// @throws usage_error after build(), or if the buffer's memory overlaps a registered buffer's
  ///         (same data pointer: registered twice)
  template <class T, class S>
  std::size_t add(T&& buffer, S&& strategy) {
    using D = std::remove_cvref_t<T>;
    constexpr bool is_view = std::same_as<D, tensor_view>;
    if constexpr (!is_view && !tensor<D>) {
      static_assert(
          detail::always_false<T>,
          "BufferReducer::add: the buffer must be a ddp::tensor (a contiguous range of a ddp element type, "
          "or a type with a ddp::tensor_traits<T> specialisation: see docs/tensors.md) or a ddp::tensor_view");
      return 0;
    } else if constexpr (!is_view && !tensor<std::remove_reference_t<T>>) {
      static_assert(detail::always_false<T>,
                    "BufferReducer::add: the buffer must be mutable (the reducer writes it): a const T is not a "
                    "ddp::tensor unless ddp::tensor_traits<T>::data takes a const T& (a handle such as at::Tensor, "
                    "whose constness does not protect its data: see docs/tensors.md)");
      return 0;
    } else if constexpr (is_view) {
      return state_->add(buffer, nullptr, nullptr, to_strategy(std::forward<S>(strategy)));
    } else if constexpr (is_tensor_handle_v<D>) {
      // A handle's copy shares the trainer's storage: hold it, never a reference that may dangle.
      auto held = std::make_shared<D>(std::forward<T>(buffer));
      const tensor_view v = ddp::view(*held);
      void* object = held.get();
      return state_->add(v, &detail::reread_view<D>, object, to_strategy(std::forward<S>(strategy)), std::move(held));
    } else if constexpr (!std::is_lvalue_reference_v<T>) {
      static_assert(detail::always_false<T>,
                    "BufferReducer::add: pass the buffer as an lvalue: the reducer keeps a reference to it and a "
                    "temporary container would dangle (handle types, ddp::is_tensor_handle_v, such as std::span, "
                    "may be temporaries: the reducer holds a copy)");
      return 0;
    } else {
      return state_->add(ddp::view(buffer), &detail::reread_view<std::remove_reference_t<T>>,
                         const_cast<D*>(std::addressof(buffer)), to_strategy(std::forward<S>(strategy)));
    }
  }

  /// Makes a buffer of `count` zeroed `T`s in the reducer's storage (view path: no copies), with
  /// the default strategy. Its memory exists once the reducer is built: get it with `span()`.
  template <element T>
  buffer_handle<T> emplace(std::size_t count) {
    return emplace<T>(count, default_);
  }

  /// As above, with `strategy`.
  template <element T, class S>
  buffer_handle<T> emplace(std::size_t count, S&& strategy) {
    return {state_->emplace(dtype_v<T>, count, to_strategy(std::forward<S>(strategy)))};
  }

  /// As above, for a dtype known at run time; read it back with `view(index)`.
  template <class S>
  std::size_t emplace(dtype type, std::size_t count, S&& strategy) {
    return state_->emplace(type, count, to_strategy(std::forward<S>(strategy)));
  }

  /// The memory of an emplaced buffer: stable for the reducer's lifetime.
  /// @throws usage_error before the reducer is built
  template <element T>
  [[nodiscard]] std::span<T> span(buffer_handle<T> handle) const {
    const tensor_view v = state_->view(handle.index);
    return {static_cast<T*>(v.data), v.count};
  }

  /// The current view of buffer `index` (its slice of the storage for an emplaced buffer).
  [[nodiscard]] tensor_view view(std::size_t index) const { return state_->view(index); }

  /// Collective: groups the buffers, allgathers a fingerprint (count, dtype, device kind, group,
  /// strategy per buffer; the period) and allocates the storage. The first sync (or join hook)
  /// builds if this was not called. Calling it again does nothing.
  /// @throws usage_error on every rank if ranks disagree, naming the first differing buffer and rank
  void build() { state_->build(); }
  /// True once built (explicitly or by the first sync / join hook).
  [[nodiscard]] bool built() const noexcept { return state_->built(); }

  // ---- synchronisation ------------------------------------------------------------------------

  /// Collective: synchronises every group with its strategy and waits. With a period, only every
  /// period-th call communicates. Call it at the start of each step (before forward), as DDP does.
  /// @throws usage_error (bad layout, a previous sync_async still pending, a resized buffer, a
  ///         custom strategy returning no work); communication errors from the backend
  void sync() { sync_async().wait(); }

  /// Collective, non-blocking form of `sync()`: issues one collective per group and returns at
  /// once, e.g. to overlap the forward pass. The buffers must not be touched until the work
  /// completed; copy-path buffers are written by its continuation. The first call builds (blocking).
  [[nodiscard]] work sync_async() { return state_->sync_async(); }

  /// Whether the next `sync()` communicates (the period).
  [[nodiscard]] bool will_communicate() const noexcept { return state_->will_communicate(); }

  /// Records each sync, from issue to observed completion, in `rec` (track `buffers`; null:
  /// stop). `rec` must outlive the reducer's pending work, or be unset first.
  void set_recorder(timeline::recorder* rec) noexcept { state_->set_recorder(rec); }

  // ---- joinable (see joinable.hpp) -------------------------------------------------------------

  /// A hook that mirrors this reducer's syncs on a rank that ran out of data.
  [[nodiscard]] join_hook_type join_hook(const join_hook_options& = {}) const { return join_hook_type(state_); }
  /// Same as `communicator()`: the join bookkeeping runs there.
  [[nodiscard]] communicator_ref join_communicator() const noexcept { return state_->comm(); }
  /// Whether the next `sync()` communicates (asked by the JoinContext at `notify()`).
  [[nodiscard]] bool join_will_communicate() const noexcept { return will_communicate(); }
  /// Records the round for the next `sync()`: it picks a training broadcast root and the mean's
  /// divisor from it, exactly as the joined ranks' hooks do.
  void join_notified(const join_round& round) { state_->record_round(round); }
  /// Syncs run at the start of the step (the context's first guess at the issue order).
  [[nodiscard]] static constexpr join_phase join_issue_phase() noexcept { return join_phase::before_forward; }

  // ---- introspection ----------------------------------------------------------------------------

  /// What the reducer did so far.
  [[nodiscard]] const buffer_reducer_stats& stats() const noexcept { return state_->stats(); }
  /// The options.
  [[nodiscard]] const buffer_reducer_options& options() const noexcept { return state_->options(); }
  /// The strategy of buffers added without one.
  [[nodiscard]] const Strategy& default_strategy() const noexcept { return default_; }
  /// Communicator of every collective of this reducer.
  [[nodiscard]] communicator_ref communicator() const noexcept { return state_->comm(); }
  /// Registered buffers.
  [[nodiscard]] std::size_t size() const noexcept { return state_->size(); }
  /// The groups, once built.
  [[nodiscard]] std::vector<buffer_group_info> groups() const { return state_->groups(); }

 private:
  template <class S>
  static strategies::any to_strategy(S&& s) {
    using D = std::remove_cvref_t<S>;
    if constexpr (buffer_strategy<D>) {
      return strategies::any(D(std::forward<S>(s)));
    } else if constexpr (strategies::custom_callable<D>) {
      return strategies::any(strategies::custom<D>(D(std::forward<S>(s))));
    } else {
      static_assert(detail::always_false<S>,
                    "BufferReducer: a strategy must model ddp::buffer_strategy (work sync(const ddp::buffer_group&) "
                    "const, std::string name() const, ==, copyable) or be a callable f(const ddp::buffer_group&) or "
                    "f(std::span<const ddp::tensor_view>, ddp::communicator_ref) returning ddp::work or "
                    "std::optional<ddp::work>");
      return strategies::any(strategies::broadcast{});
    }
  }

  Strategy default_;
  std::shared_ptr<detail::buffer_reducer_state> state_;
};

static_assert(joinable<BufferReducer<>>);

}  // namespace ddp
