#pragma once
/// @file strategies/any.hpp
/// @brief `strategies::any`: holds any buffer strategy, chosen at run time.
///
/// The reducer stores every buffer's strategy as an `any`, so buffers of one reducer may use
/// strategies of different types. It is a strategy itself: `BufferReducer<strategies::any>` takes
/// its default strategy from configuration. Copies share the held strategy (it is immutable).

#include <concepts>
#include <memory>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>

#include <ddp/strategies/buffer_group.hpp>
#include <ddp/strategies/buffer_strategy.hpp>
#include <ddp/work.hpp>

namespace ddp::strategies {

/// A type-erased buffer strategy. Two `any` are equal when they hold strategies of the same type
/// that compare equal.
class any {
 public:
  /// Holds a copy of `s`.
  template <class S>
  requires(!std::same_as<std::remove_cvref_t<S>, any>) &&
      buffer_strategy<S> any(S s)  // NOLINT(google-explicit-constructor): any strategy converts, like std::function
      : impl_(std::make_shared<const model<S>>(std::move(s))) {}

  /// The held strategy's `sync(g)`.
  [[nodiscard]] work sync(const buffer_group& g) const { return impl_->sync(g); }
  /// The held strategy's `name()`.
  [[nodiscard]] std::string name() const { return impl_->name(); }
  /// The held strategy's `communicates()`, or true if it has none.
  [[nodiscard]] bool communicates() const { return impl_->communicates(); }
  /// The held strategy's `reads_local_data(g)`, or true if it has none.
  [[nodiscard]] bool reads_local_data(const buffer_group& g) const { return impl_->reads_local_data(g); }
  /// The held strategy's `writes_local_data(g)`, or true if it has none.
  [[nodiscard]] bool writes_local_data(const buffer_group& g) const { return impl_->writes_local_data(g); }

  /// The held strategy if it is an `S`, else null (like `std::function::target`).
  template <buffer_strategy S>
  [[nodiscard]] const S* target() const noexcept {
    return impl_->tag() == &model<S>::tag_ ? &static_cast<const model<S>&>(*impl_).strategy : nullptr;
  }

  /// Same held object (copies of one `any`), or held strategies of the same type that compare equal.
  friend bool operator==(const any& a, const any& b) {
    return a.impl_.get() == b.impl_.get() || a.impl_->equals(*b.impl_);
  }
  /// Writes `name()`.
  friend std::ostream& operator<<(std::ostream& os, const any& a) { return os << a.name(); }

 private:
  struct concept_base {
    concept_base() = default;
    concept_base(const concept_base&) = delete;
    concept_base& operator=(const concept_base&) = delete;
    virtual ~concept_base() = default;
    [[nodiscard]] virtual work sync(const buffer_group& g) const = 0;
    [[nodiscard]] virtual std::string name() const = 0;
    [[nodiscard]] virtual bool communicates() const = 0;
    [[nodiscard]] virtual bool reads_local_data(const buffer_group& g) const = 0;
    [[nodiscard]] virtual bool writes_local_data(const buffer_group& g) const = 0;
    [[nodiscard]] virtual bool equals(const concept_base& other) const = 0;
    /// Address unique to the held type: type identity without RTTI.
    [[nodiscard]] virtual const void* tag() const noexcept = 0;
  };

  template <class S>
  struct model final : concept_base {
    explicit model(S s) : strategy(std::move(s)) {}
    work sync(const buffer_group& g) const override { return strategy.sync(g); }
    std::string name() const override { return strategy.name(); }
    bool communicates() const override { return ddp::detail::strategy_communicates(strategy); }
    bool reads_local_data(const buffer_group& g) const override {
      return ddp::detail::strategy_reads_local_data(strategy, g);
    }
    bool writes_local_data(const buffer_group& g) const override {
      return ddp::detail::strategy_writes_local_data(strategy, g);
    }
    bool equals(const concept_base& other) const override {
      return other.tag() == &tag_ && static_cast<const model&>(other).strategy == strategy;
    }
    const void* tag() const noexcept override { return &tag_; }

    static constexpr char tag_ = 0;
    S strategy;
  };

  std::shared_ptr<const concept_base> impl_;
};

static_assert(buffer_strategy<any>);

}  // namespace ddp::strategies
