#pragma once
/// @file any_communicator.hpp
/// @brief `any_communicator`: an owning, type-erased communicator. For code that builds a new
/// communicator at run time whose backend it does not know statically (the fault-tolerance
/// Manager rebuilds one per quorum through a user-supplied factory).

#include <memory>
#include <span>
#include <type_traits>
#include <utility>

#include <ddp/communicator.hpp>

namespace ddp {

/// Owns one communicator of any backend and models `communicator` itself. Move-only. The
/// collectives forward to the owned communicator; calling them on an empty object is undefined.
///
/// It also models the optional capabilities of communicator.hpp, each reporting what the owned
/// communicator has: `allreduce_premul_sum` with `has_premul_sum()`, `stages_input()`, and
/// `device_queue()` (an empty queue, null runtime, when it runs host collectives only or nothing
/// is owned; `communicator_ref::has_device_queue()` is then false).
class any_communicator {
 public:
  /// Empty: owns nothing (`bool(*this)` is false).
  any_communicator() = default;
  /// Takes ownership of `comm`, moved (or copied, from an lvalue) into the object.
  template <communicator C>
  requires(!std::same_as<std::remove_cvref_t<C>, any_communicator>)
      any_communicator(C&& comm)  // NOLINT(google-explicit-constructor): takes ownership of a backend
      : impl_(std::make_unique<model<std::remove_cvref_t<C>>>(std::forward<C>(comm))) {}

  /// Takes over the owned communicator; the source becomes empty.
  any_communicator(any_communicator&&) noexcept = default;
  /// Destroys the currently owned communicator, then takes over the source's.
  any_communicator& operator=(any_communicator&&) noexcept = default;

  /// True if a communicator is owned.
  [[nodiscard]] explicit operator bool() const noexcept { return static_cast<bool>(impl_); }

  /// Rank in the owned communicator.
  [[nodiscard]] int rank() const { return impl_->ref().rank(); }
  /// Size of the owned communicator.
  [[nodiscard]] int size() const { return impl_->ref().size(); }
  /// Forwards to the owned communicator (contract: communicator.hpp).
  work allreduce(std::span<const tensor_view> ts, reduce_op op) { return impl_->ref().allreduce(ts, op); }
  /// @copydoc allreduce
  work broadcast(std::span<const tensor_view> ts, int root) { return impl_->ref().broadcast(ts, root); }
  /// @copydoc allreduce
  work allgather(tensor_view in, tensor_view out) { return impl_->ref().allgather(in, out); }
  /// @copydoc allreduce
  work reduce_scatter(tensor_view in, tensor_view out, reduce_op op) {
    return impl_->ref().reduce_scatter(in, out, op);
  }
  /// @copydoc allreduce
  work barrier() { return impl_->ref().barrier(); }
  /// The owned communicator's pre-multiplied sum (`premul_sum_communicator`).
  /// @throws usage_error if it has none (`has_premul_sum()` is false)
  work allreduce_premul_sum(std::span<const tensor_view> ts, double factor) {
    return impl_->ref().allreduce_premul_sum(ts, factor);
  }
  /// True if a communicator is owned and has a pre-multiplied sum.
  [[nodiscard]] bool has_premul_sum() const { return impl_ && impl_->ref().has_premul_sum(); }
  /// True if a communicator is owned and copies every input into its own memory
  /// (`staging_communicator`).
  [[nodiscard]] bool stages_input() const { return impl_ && impl_->ref().stages_input(); }
  /// The owned communicator's runtime, stream and device (`device_communicator`); an empty queue
  /// (null runtime) if it has none or nothing is owned.
  [[nodiscard]] ddp::device_queue device_queue() const {
    return impl_ ? impl_->ref().device_queue() : ddp::device_queue{};
  }
  /// Aborts the owned communicator; a no-op when empty.
  void abort() noexcept {
    if (impl_) impl_->ref().abort();
  }

  /// The owned backend object, if it is a `C`.
  template <class C>
  [[nodiscard]] C* get() noexcept {
    auto* m = dynamic_cast<model<C>*>(impl_.get());
    return m ? &m->comm : nullptr;
  }

 private:
  struct concept_base {
    virtual ~concept_base() = default;
    virtual communicator_ref ref() = 0;
  };
  template <class C>
  struct model final : concept_base {
    explicit model(C&& c) : comm(std::move(c)) {}
    explicit model(const C& c) : comm(c) {}
    communicator_ref ref() override { return communicator_ref(comm); }
    C comm;
  };
  std::unique_ptr<concept_base> impl_;
};

static_assert(communicator<any_communicator>);
static_assert(device_communicator<any_communicator>);
static_assert(dynamic_premul_sum_communicator<any_communicator>);
static_assert(staging_communicator<any_communicator>);

}  // namespace ddp
