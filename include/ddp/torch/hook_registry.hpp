#pragma once
/// @file torch/hook_registry.hpp
/// @brief `ddp::libtorch::hook_registry`: a `gradient_hook_registry` over libtorch's autograd, so
/// that `Bucketer::attach()` marks each gradient ready the moment libtorch has accumulated it.
///
/// Post hooks on each parameter's `AccumulateGrad` node (what PyTorch's DDP reducer hooks), kept
/// alive across iterations and removed with the Bucketer. What is hooked, why the accumulators
/// are kept, the replaced-gradient check and threads: docs/torch.md ("Hooks: hook_registry").
/// Part of the `ddp::torch` CMake component; not included by `<ddp/ddp.hpp>`.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <ddp/error.hpp>
#include <ddp/gradient_hooks.hpp>

namespace ddp::libtorch {

/// Gradient-ready hooks on libtorch parameters, keyed like the Bucketer's gradients: bind key `i`
/// to the parameter whose gradient is the Bucketer's gradient `i`, then `grads.attach(registry)`.
/// `register_module` does the binding. Neither copyable nor movable (attached hooks refer to it);
/// it must outlive every Bucketer attached to it.
class hook_registry {
 public:
  /// What `add_gradient_hook` returns and `remove_gradient_hook` takes.
  struct handle {
    std::size_t key = 0;           ///< the key the hook was added under
    std::uintptr_t torch_key = 0;  ///< libtorch's key of the post hook (`Node::del_post_hook`)
  };

  hook_registry() = default;
  /// A registry whose errors name `rank` (`register_module` sets it from the Bucketer's communicator).
  explicit hook_registry(int rank) noexcept : rank_(rank) {}
  hook_registry(const hook_registry&) = delete;
  hook_registry& operator=(const hook_registry&) = delete;
  /// Removes every hook still attached and releases the accumulators.
  ~hook_registry() { clear(); }

  /// Binds `key` to `parameter`: takes (and keeps alive) its gradient accumulator and records the
  /// memory of its current `grad()`, which hooks added from now on check. `name` appears in error
  /// messages. Binding a key again to the same parameter (registering a module again for a
  /// re-created Bucketer) only records the gradient memory and name again.
  /// @throws usage_error if `key` is bound to another parameter, or `parameter` is not a leaf that
  ///   requires a gradient, or its `grad()` is not allocated yet (allocate it first, e.g.
  ///   zero-filled: the Bucketer binds to that memory too)
  void bind(std::size_t key, const at::Tensor& parameter, std::string name = {}) {
    if (name.empty()) name = "#" + std::to_string(key);
    auto existing = entries_.find(key);
    if (existing != entries_.end() && !existing->second.parameter.is_same(parameter)) {
      throw usage_error(rank_, "libtorch::hook_registry::bind",
                        "key " + std::to_string(key) + " is already bound to parameter '" + existing->second.name +
                            "', not to '" + name + "'");
    }
    if (!parameter.defined() || !parameter.requires_grad() || !parameter.is_leaf()) {
      throw usage_error(rank_, "libtorch::hook_registry::bind",
                        "parameter '" + name + "' must be a defined leaf tensor that requires a gradient");
    }
    const at::Tensor& grad = parameter.grad();
    if (!grad.defined()) {
      throw usage_error(rank_, "libtorch::hook_registry::bind",
                        "parameter '" + name +
                            "' has no gradient tensor yet: allocate it before binding "
                            "(parameter.mutable_grad() = at::zeros_like(parameter); register_module does this)");
    }
    auto accumulator = ::torch::autograd::impl::grad_accumulator(parameter);
    if (!accumulator) {
      throw usage_error(rank_, "libtorch::hook_registry::bind", "parameter '" + name + "' has no gradient accumulator");
    }
    if (existing != entries_.end()) {
      existing->second.grad_data = grad.data_ptr();
      existing->second.name = std::move(name);
      return;
    }
    entries_.emplace(key, entry{parameter, std::move(accumulator), grad.data_ptr(), std::move(name), {}});
  }

  /// The rank named in this registry's errors (-1: not known).
  void set_rank(int rank) noexcept { rank_ = rank; }
  /// The rank named in this registry's errors (-1: not known).
  [[nodiscard]] int rank() const noexcept { return rank_; }

  /// Number of bound keys.
  [[nodiscard]] std::size_t size() const noexcept { return entries_.size(); }
  /// True if `key` is bound.
  [[nodiscard]] bool bound(std::size_t key) const noexcept { return entries_.count(key) != 0; }

  /// Adds a post hook to the accumulator of the parameter bound to `key`; it calls `on_ready`
  /// after each backward pass accumulated that parameter's gradient.
  /// @throws usage_error if `key` is not bound
  handle add_gradient_hook(std::size_t key, std::function<void()> on_ready) {
    auto it = entries_.find(key);
    if (it == entries_.end()) {
      throw usage_error(rank_, "libtorch::hook_registry::add_gradient_hook",
                        "no parameter is bound to gradient " + std::to_string(key) +
                            ": bind every gradient the Bucketer has (register_module binds the module's), or call "
                            "mark_ready for it yourself instead of attach()");
    }
    entry& e = it->second;
    const std::uintptr_t torch_key = e.accumulator->add_post_hook(
        std::make_unique<post_hook>(e.parameter, e.grad_data, e.name, rank_, std::move(on_ready)));
    e.live.push_back(torch_key);
    return {key, torch_key};
  }

  /// Removes a hook added by `add_gradient_hook` (from libtorch's accumulator). Removing one
  /// that is already gone does nothing.
  void remove_gradient_hook(handle h) noexcept {
    auto it = entries_.find(h.key);
    if (it == entries_.end()) return;
    entry& e = it->second;
    for (auto k = e.live.begin(); k != e.live.end(); ++k) {
      if (*k == h.torch_key) {
        e.accumulator->del_post_hook(h.torch_key);
        e.live.erase(k);
        return;
      }
    }
  }

  /// Hooks this registry added and has not removed yet.
  [[nodiscard]] std::size_t live_hooks() const noexcept {
    std::size_t n = 0;
    for (const auto& [key, e] : entries_) n += e.live.size();
    return n;
  }

  /// Removes every hook still attached and unbinds every key (releasing the accumulators). A
  /// Bucketer still attached must not be used for attached gradients afterwards.
  void clear() noexcept {
    for (auto& [key, e] : entries_) {
      for (const std::uintptr_t k : e.live) e.accumulator->del_post_hook(k);
    }
    entries_.clear();
  }

  /// Post hooks on `parameter`'s gradient accumulator as libtorch counts them (every hook, not
  /// only this registry's); 0 if the parameter has no live accumulator. For tests and leak checks.
  [[nodiscard]] static std::size_t post_hook_count(const at::Tensor& parameter) {
    const auto accumulator = ::torch::autograd::impl::try_get_grad_accumulator(parameter);
    return accumulator ? accumulator->post_hooks().size() : 0;
  }

 private:
  // libtorch calls operator() after AccumulateGrad ran: parameter.grad() holds the final gradient.
  class post_hook final : public ::torch::autograd::FunctionPostHook {
   public:
    post_hook(at::Tensor parameter, const void* grad_data, std::string name, int rank, std::function<void()> on_ready)
        : parameter_(std::move(parameter)),
          grad_data_(grad_data),
          name_(std::move(name)),
          rank_(rank),
          on_ready_(std::move(on_ready)) {}

    ::torch::autograd::variable_list operator()(const ::torch::autograd::variable_list& outputs,
                                                const ::torch::autograd::variable_list& /*inputs*/) override {
      const at::Tensor& grad = parameter_.grad();
      if (!grad.defined() || grad.data_ptr() != grad_data_) {
        throw usage_error(rank_, "libtorch::hook_registry",
                          "the gradient of parameter '" + name_ +
                              (grad.defined() ? "' was reallocated" : "' was reset to undefined") +
                              " after it was registered, and the Bucketer reads the memory it was given. Zero "
                              "gradients in place (optimizer.zero_grad() in libtorch 1.x, module->zero_grad(false)), "
                              "never with set_to_none = true, and never assign a new tensor to mutable_grad()");
      }
      on_ready_();
      return outputs;
    }

   private:
    at::Tensor parameter_;
    const void* grad_data_;
    std::string name_;
    int rank_;
    std::function<void()> on_ready_;
  };

  struct entry {
    at::Tensor parameter;
    std::shared_ptr<::torch::autograd::Node> accumulator;  // kept alive: see the file description
    const void* grad_data = nullptr;
    std::string name;
    std::vector<std::uintptr_t> live;  // libtorch keys of this registry's hooks on `accumulator`
  };

  std::map<std::size_t, entry> entries_;
  int rank_ = -1;
};

static_assert(gradient_hook_registry<hook_registry>);

}  // namespace ddp::libtorch
