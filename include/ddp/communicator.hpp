#pragma once
/// @file communicator.hpp
/// @brief The `communicator` concept every backend models, and `communicator_ref`, the
/// non-owning type-erased reference through which components (Bucketer, JoinContext,
/// BufferReducer, Manager) talk to any backend without being templated on it.
///
/// The contract every model follows: docs/communicators.md ("The concept"). The optional
/// capabilities (pre-multiplied sum, staged input, device queue): docs/writing-a-backend.md
/// ("Optional capabilities").

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <type_traits>
#include <utility>

#include <ddp/device_runtime.hpp>
#include <ddp/reduce_op.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp {

template <class C>
concept communicator = requires(C& c, const C& cc, std::span<const tensor_view> ts, tensor_view a, tensor_view b,
                                reduce_op op, int root) {
  { cc.rank() } -> std::same_as<int>;
  { cc.size() } -> std::same_as<int>;
  { c.allreduce(ts, op) } -> std::same_as<work>;
  { c.broadcast(ts, root) } -> std::same_as<work>;
  { c.allgather(a, b) } -> std::same_as<work>;
  { c.reduce_scatter(a, b, op) } -> std::same_as<work>;
  { c.barrier() } -> std::same_as<work>;
  { c.abort() }
  noexcept;
};

/// A communicator with a pre-multiplied sum (docs/writing-a-backend.md, "Optional capabilities").
template <class C>
concept premul_sum_communicator = communicator<C> && requires(C& c, std::span<const tensor_view> ts, double factor) {
  { c.allreduce_premul_sum(ts, factor) } -> std::same_as<work>;
};

/// A pre-multiplied-sum communicator that says at run time whether the capability is there (a
/// wrapper over a backend chosen at run time; docs/writing-a-backend.md, "Optional capabilities").
template <class C>
concept dynamic_premul_sum_communicator = premul_sum_communicator<C> && requires(const C& cc) {
  { cc.has_premul_sum() } -> std::same_as<bool>;
};

/// A communicator that says whether it stages its inputs (docs/writing-a-backend.md, "Optional capabilities").
template <class C>
concept staging_communicator = communicator<C> && requires(const C& cc) {
  { cc.stages_input() } -> std::same_as<bool>;
};

/// A communicator whose collectives run on a device stream (see device_runtime.hpp).
template <class C>
concept device_communicator = communicator<C> && requires(const C& cc) {
  { cc.device_queue() } -> std::same_as<ddp::device_queue>;
};

/// A communicator that can compare the gradient layout of its ranks itself, whenever its members
/// change (the Manager and GroupManager do at every quorum): a Bucketer built over it offers it its
/// layout fingerprint; `adopt_layout` returns true if it took it (no quorum yet: nothing to run a
/// check over), false if the Bucketer should check over the current members itself (engine.hpp).
template <class C>
concept layout_adopting_communicator = communicator<C> && requires(C& c, std::uint64_t fingerprint) {
  { c.adopt_layout(fingerprint) } -> std::same_as<bool>;
};

/// A tensor of any tensor type, or a `tensor_view`: what the single-tensor collectives take.
template <class T>
concept single_tensor = tensor<T> || std::same_as<std::remove_cvref_t<T>, tensor_view>;

/// The single-tensor forms `allreduce(t, op)` and `broadcast(t, root)` of a communicator, written
/// once: a communicator derives from `single_tensor_calls<itself>` and brings them in beside its
/// span forms (`using single_tensor_calls<X>::allreduce; using single_tensor_calls<X>::broadcast;`).
/// Each forwards a one-element span of `view(t)`.
template <class Derived>
class single_tensor_calls {
 public:
  /// In-place allreduce of one tensor of any tensor type.
  template <single_tensor T>
  work allreduce(T& t, reduce_op op) {
    return self().allreduce(one{view(t)}.span(), op);
  }
  /// In-place broadcast of one tensor of any tensor type from `root`.
  template <single_tensor T>
  work broadcast(T& t, int root) {
    return self().broadcast(one{view(t)}.span(), root);
  }
  /// `allreduce(t, op)` through a const communicator whose span form is const (`communicator_ref`).
  template <single_tensor T, class D = Derived>  // D: checked at the call, once Derived is complete
  requires requires(const D& c, std::span<const tensor_view> ts, reduce_op op) { c.allreduce(ts, op); }
  work allreduce(T& t, reduce_op op) const { return self().allreduce(one{view(t)}.span(), op); }
  /// `broadcast(t, root)` through a const communicator whose span form is const.
  template <single_tensor T, class D = Derived>  // D: checked at the call, once Derived is complete
  requires requires(const D& c, std::span<const tensor_view> ts, int root) { c.broadcast(ts, root); }
  work broadcast(T& t, int root) const { return self().broadcast(one{view(t)}.span(), root); }

 protected:
  /// Only as a base of `Derived`.
  single_tensor_calls() = default;

 private:
  // One tensor as a one-element span; the temporary lives until the call it is passed to returns.
  struct one {
    tensor_view v;
    [[nodiscard]] std::span<const tensor_view> span() const noexcept { return {&v, 1}; }
  };
  Derived& self() noexcept { return static_cast<Derived&>(*this); }
  const Derived& self() const noexcept { return static_cast<const Derived&>(*this); }
};

/// Non-owning reference to any communicator. Cheap to copy; the referenced communicator must
/// outlive every component holding the reference.
class communicator_ref : public single_tensor_calls<communicator_ref> {
 public:
  using single_tensor_calls<communicator_ref>::allreduce;
  using single_tensor_calls<communicator_ref>::broadcast;

  /// Refers to `comm` (implicit, so any communicator can be passed where a `communicator_ref`
  /// is expected). Rvalues are rejected: the reference would dangle.
  template <communicator C>
  requires(!std::same_as<std::remove_cvref_t<C>, communicator_ref>) communicator_ref(C& comm)
  noexcept  // NOLINT(google-explicit-constructor): a reference converts implicitly
      : obj_(&comm), vt_(&table_for<C>) {}
  template <communicator C>
  requires(!std::same_as<std::remove_cvref_t<C>, communicator_ref>) communicator_ref(C&&)
  = delete;  // would dangle

  /// Rank of the calling process in the referenced communicator.
  [[nodiscard]] int rank() const { return vt_->rank(obj_); }
  /// Number of ranks of the referenced communicator.
  [[nodiscard]] int size() const { return vt_->size(obj_); }

  /// Forwards to the referenced communicator; semantics as in the concept's contract (file docs).
  work allreduce(std::span<const tensor_view> ts, reduce_op op) const { return vt_->allreduce(obj_, ts, op); }
  /// @copydoc allreduce(std::span<const tensor_view>, reduce_op) const
  work broadcast(std::span<const tensor_view> ts, int root) const { return vt_->broadcast(obj_, ts, root); }
  /// @copydoc allreduce(std::span<const tensor_view>, reduce_op) const
  work allgather(tensor_view in, tensor_view out) const { return vt_->allgather(obj_, in, out); }
  /// @copydoc allreduce(std::span<const tensor_view>, reduce_op) const
  work reduce_scatter(tensor_view in, tensor_view out, reduce_op op) const {
    return vt_->reduce_scatter(obj_, in, out, op);
  }
  /// @copydoc allreduce(std::span<const tensor_view>, reduce_op) const
  work barrier() const { return vt_->barrier(obj_); }
  /// Aborts the referenced communicator: its pending work fails, later calls throw.
  void abort() const noexcept { vt_->abort(obj_); }

  /// True if the referenced backend has `allreduce_premul_sum` (docs/writing-a-backend.md).
  [[nodiscard]] bool has_premul_sum() const {
    return vt_->premul_sum != nullptr && (vt_->has_premul_sum == nullptr || vt_->has_premul_sum(obj_));
  }
  /// The referenced backend's pre-multiplied sum.
  /// @throws usage_error if it has none (ask `has_premul_sum()` first)
  work allreduce_premul_sum(std::span<const tensor_view> ts, double factor) const {
    if (!has_premul_sum()) {
      throw usage_error(rank(), "allreduce_premul_sum", "this communicator has no pre-multiplied sum");
    }
    return vt_->premul_sum(obj_, ts, factor);
  }
  /// True if the referenced backend copies every input into its own memory (docs/writing-a-backend.md).
  [[nodiscard]] bool stages_input() const { return vt_->stages_input != nullptr && vt_->stages_input(obj_); }
  /// True if the referenced backend runs its collectives on a device stream now: it models
  /// `device_communicator` and its queue has a runtime (a wrapper such as `any_communicator` or
  /// the Manager reports an empty queue when what it forwards to has none).
  [[nodiscard]] bool has_device_queue() const { return device_queue().runtime != nullptr; }
  /// The referenced backend's runtime, stream and device; an empty queue (null runtime) if it has none.
  [[nodiscard]] ddp::device_queue device_queue() const {
    return vt_->device_queue != nullptr ? vt_->device_queue(obj_) : ddp::device_queue{};
  }

  /// True if the referenced communicator compares its ranks' layouts itself (`layout_adopting_communicator`).
  [[nodiscard]] bool adopts_layout() const noexcept { return vt_->adopt_layout != nullptr; }
  /// Offers the referenced communicator a layout fingerprint to compare; true if it took it.
  [[nodiscard]] bool adopt_layout(std::uint64_t fingerprint) const {
    return vt_->adopt_layout != nullptr && vt_->adopt_layout(obj_, fingerprint);
  }

  /// Identity of the referenced object (two refs to the same communicator compare equal).
  friend bool operator==(const communicator_ref& a, const communicator_ref& b) noexcept { return a.obj_ == b.obj_; }

 private:
  struct vtable {
    int (*rank)(const void*);
    int (*size)(const void*);
    work (*allreduce)(void*, std::span<const tensor_view>, reduce_op);
    work (*broadcast)(void*, std::span<const tensor_view>, int);
    work (*allgather)(void*, tensor_view, tensor_view);
    work (*reduce_scatter)(void*, tensor_view, tensor_view, reduce_op);
    work (*barrier)(void*);
    void (*abort)(void*) noexcept;
    work (*premul_sum)(void*, std::span<const tensor_view>, double);  // null: no such capability
    bool (*has_premul_sum)(const void*);                              // null: as premul_sum says
    bool (*stages_input)(const void*);                                // null: never stages
    ddp::device_queue (*device_queue)(const void*);                   // null: host collectives only
    bool (*adopt_layout)(void*, std::uint64_t);                       // null: compares no layouts
  };

  template <class C>
  static constexpr auto premul_sum_entry() -> work (*)(void*, std::span<const tensor_view>, double) {
    if constexpr (premul_sum_communicator<C>) {
      return [](void* o, std::span<const tensor_view> ts, double f) {
        return static_cast<C*>(o)->allreduce_premul_sum(ts, f);
      };
    } else {
      return nullptr;
    }
  }
  template <class C>
  static constexpr auto has_premul_sum_entry() -> bool (*)(const void*) {
    if constexpr (dynamic_premul_sum_communicator<C>) {
      return [](const void* o) { return static_cast<const C*>(o)->has_premul_sum(); };
    } else {
      return nullptr;
    }
  }
  template <class C>
  static constexpr auto stages_input_entry() -> bool (*)(const void*) {
    if constexpr (staging_communicator<C>) {
      return [](const void* o) { return static_cast<const C*>(o)->stages_input(); };
    } else {
      return nullptr;
    }
  }

  template <class C>
  static constexpr auto device_queue_entry() -> ddp::device_queue (*)(const void*) {
    if constexpr (device_communicator<C>) {
      return [](const void* o) { return static_cast<const C*>(o)->device_queue(); };
    } else {
      return nullptr;
    }
  }

  template <class C>
  static constexpr auto adopt_layout_entry() -> bool (*)(void*, std::uint64_t) {
    if constexpr (layout_adopting_communicator<C>) {
      return [](void* o, std::uint64_t fp) { return static_cast<C*>(o)->adopt_layout(fp); };
    } else {
      return nullptr;
    }
  }

  template <class C>
  static constexpr vtable table_for = {
      [](const void* o) { return static_cast<const C*>(o)->rank(); },
      [](const void* o) { return static_cast<const C*>(o)->size(); },
      [](void* o, std::span<const tensor_view> ts, reduce_op op) { return static_cast<C*>(o)->allreduce(ts, op); },
      [](void* o, std::span<const tensor_view> ts, int root) { return static_cast<C*>(o)->broadcast(ts, root); },
      [](void* o, tensor_view a, tensor_view b) { return static_cast<C*>(o)->allgather(a, b); },
      [](void* o, tensor_view a, tensor_view b, reduce_op op) { return static_cast<C*>(o)->reduce_scatter(a, b, op); },
      [](void* o) { return static_cast<C*>(o)->barrier(); },
      [](void* o) noexcept { static_cast<C*>(o)->abort(); },
      premul_sum_entry<C>(),
      has_premul_sum_entry<C>(),
      stages_input_entry<C>(),
      device_queue_entry<C>(),
      adopt_layout_entry<C>(),
  };

  void* obj_;
  const vtable* vt_;
};

static_assert(communicator<communicator_ref>, "communicator_ref must itself model the concept");

}  // namespace ddp
