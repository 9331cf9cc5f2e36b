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

class any_communicator {
 public:
  any_communicator() = default;
  template <communicator C>
    requires(!std::same_as<std::remove_cvref_t<C>, any_communicator>)
  any_communicator(C&& comm)  // NOLINT(google-explicit-constructor): takes ownership of a backend
      : impl_(std::make_unique<model<std::remove_cvref_t<C>>>(std::forward<C>(comm))) {}

  any_communicator(any_communicator&&) noexcept = default;
  any_communicator& operator=(any_communicator&&) noexcept = default;

  [[nodiscard]] explicit operator bool() const noexcept { return static_cast<bool>(impl_); }

  [[nodiscard]] int rank() const { return impl_->ref().rank(); }
  [[nodiscard]] int size() const { return impl_->ref().size(); }
  work allreduce(std::span<const tensor_view> ts, reduce_op op) { return impl_->ref().allreduce(ts, op); }
  work broadcast(std::span<const tensor_view> ts, int root) { return impl_->ref().broadcast(ts, root); }
  work allgather(tensor_view in, tensor_view out) { return impl_->ref().allgather(in, out); }
  work reduce_scatter(tensor_view in, tensor_view out, reduce_op op) {
    return impl_->ref().reduce_scatter(in, out, op);
  }
  work barrier() { return impl_->ref().barrier(); }
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

}  // namespace ddp
