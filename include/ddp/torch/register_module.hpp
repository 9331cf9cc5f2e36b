#pragma once
/// @file torch/register_module.hpp
/// @brief `ddp::libtorch::register_module`: registers a `torch::nn::Module`'s parameters with a
/// Bucketer and a hook registry, and its buffers with a BufferReducer, each with a strategy that
/// fits what it holds.
///
/// Saves a libtorch trainer the per-parameter and per-buffer registration, gradients
/// pre-allocated in place, BatchNorm statistics averaged. Order, what is skipped, the default
/// buffer strategies and when to call it: docs/torch.md ("register_module").
/// Part of the `ddp::torch` CMake component; not included by `<ddp/ddp.hpp>`.

#include <cstddef>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

// <ATen/core/ivalue.h> first: libtorch 1.13's <ATen/core/List.h> (included by torch/nn/module.h)
// instantiates std::vector<c10::IValue> while IValue is incomplete, which clang++ rejects under
// C++20 (pytorch/pytorch#93978, fixed in libtorch 2.1). With IValue complete it compiles.
#include <ATen/core/ivalue.h>
// (the rest in any order)
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/zeros_like.h>
#include <torch/nn/module.h>

#include <ddp/bucketer.hpp>
#include <ddp/buffer_reducer.hpp>
#include <ddp/strategies/allreduce.hpp>
#include <ddp/strategies/any.hpp>
#include <ddp/strategies/broadcast.hpp>
#include <ddp/tensor.hpp>
#include <ddp/torch/hook_registry.hpp>
#include <ddp/torch/tensor_traits.hpp>

namespace ddp::libtorch {

/// Picks the strategy of one buffer from its full name (`"layer1.bn.running_mean"`) and tensor;
/// `std::nullopt` means the reducer's default strategy.
using buffer_strategy_picker =
    std::function<std::optional<strategies::any>(const std::string& name, const at::Tensor& buffer)>;

/// The last component of a dotted module path: `"layer1.bn.running_mean"` -> `"running_mean"`.
[[nodiscard]] inline std::string_view leaf_name(std::string_view name) noexcept {
  const auto dot = name.rfind('.');
  return dot == std::string_view::npos ? name : name.substr(dot + 1);
}

/// The default picker: BatchNorm's (and InstanceNorm's) `running_mean` and `running_var` average
/// over ranks (`strategies::allreduce_mean`), `num_batches_tracked` is broadcast from rank 0 (a
/// mean of integers would truncate, and every rank counts the same steps anyway); any other
/// buffer gets the reducer's default strategy.
[[nodiscard]] inline std::optional<strategies::any> batchnorm_buffer_strategy(const std::string& name,
                                                                              const at::Tensor&) {
  const std::string_view leaf = leaf_name(name);
  if (leaf == "running_mean" || leaf == "running_var") return strategies::any(strategies::allreduce_mean{});
  if (leaf == "num_batches_tracked") return strategies::any(strategies::broadcast{.root = 0});
  return std::nullopt;
}

/// Knobs of `register_module`.
struct register_options {
  /// Strategy per buffer (see `buffer_strategy_picker`); an empty function means the reducer's
  /// default for every buffer.
  buffer_strategy_picker buffer_strategy = batchnorm_buffer_strategy;
};

/// One parameter or buffer that `register_module` registered.
struct registered_tensor {
  std::string name;       ///< full name in the module (`"conv1.weight"`)
  std::size_t index = 0;  ///< the Bucketer's gradient index (parameters) or the reducer's buffer index
  std::string strategy;   ///< buffers: the strategy's `name()`; parameters: empty
};

/// What `register_module` did.
struct module_registration {
  std::vector<registered_tensor> parameters;  ///< in registration order
  std::vector<registered_tensor> buffers;     ///< in registration order
  std::vector<std::string> skipped;           ///< "name: why" for parameters and buffers left out
};

/// Registers every parameter of `module` that requires a gradient: allocates its gradient
/// (zero-filled) if needed, adds (parameter, gradient) to `grads` and binds the gradient's index
/// to the parameter in `hooks`. Call `grads.attach(hooks)` after registering everything.
/// @throws usage_error for a parameter ddp cannot view (dtype, device, non-contiguous), or as
///   `Bucketer::add` (after `build()`) and `hook_registry::bind`
template <bucketing_policy Policy>
module_registration register_module(::torch::nn::Module& module, Bucketer<Policy>& grads, hook_registry& hooks) {
  module_registration out;
  hooks.set_rank(grads.communicator().rank());  // its errors then name the rank, as the Bucketer's do
  std::set<const void*> seen;                   // TensorImpls: a parameter shared by two submodules is registered once
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    at::Tensor parameter = item.value();
    const std::string& name = item.key();
    if (!parameter.defined()) {
      out.skipped.push_back(name + ": undefined");
      continue;
    }
    if (!seen.insert(parameter.unsafeGetTensorImpl()).second) {
      out.skipped.push_back(name + ": shared with a parameter registered before");
      continue;
    }
    if (!parameter.requires_grad()) {
      out.skipped.push_back(name + ": does not require a gradient");
      continue;
    }
    if (!parameter.grad().defined()) {
      at::NoGradGuard no_grad;
      parameter.mutable_grad() = at::zeros_like(parameter, at::MemoryFormat::Contiguous);
    }
    at::Tensor grad = parameter.grad();
    const std::size_t index = grads.add(ddp::view(parameter), ddp::view(grad), name);  // named in its errors
    hooks.bind(index, parameter, name);
    out.parameters.push_back({name, index, {}});
  }
  return out;
}

/// Registers every defined buffer of `module` with `buffers`, with the strategy
/// `options.buffer_strategy` picks (or the reducer's default). Buffers are registered as views of
/// their current memory.
/// @throws usage_error for a buffer ddp cannot view, or as `BufferReducer::add`
template <buffer_strategy Strategy>
module_registration register_buffers(::torch::nn::Module& module, BufferReducer<Strategy>& buffers,
                                     const register_options& options = {}) {
  module_registration out;
  std::set<const void*> seen;
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    at::Tensor buffer = item.value();
    const std::string& name = item.key();
    if (!buffer.defined()) {
      out.skipped.push_back(name + ": undefined");
      continue;
    }
    if (!seen.insert(buffer.unsafeGetTensorImpl()).second) {
      out.skipped.push_back(name + ": shared with a buffer registered before");
      continue;
    }
    // A view: the memory is fixed (modules update their buffers in place), so nothing has to keep
    // this handle alive for the reducer.
    const tensor_view v = ddp::view(buffer);
    std::optional<strategies::any> strategy;
    if (options.buffer_strategy) strategy = options.buffer_strategy(name, buffer);
    if (strategy) {
      std::string strategy_name = strategy->name();
      const std::size_t index = buffers.add(v, std::move(*strategy));
      out.buffers.push_back({name, index, std::move(strategy_name)});
    } else {
      const std::size_t index = buffers.add(v);
      out.buffers.push_back({name, index, buffers.default_strategy().name()});
    }
  }
  return out;
}

/// Both: `register_module(module, grads, hooks)` for the parameters, then `register_buffers` for
/// the buffers; one combined report.
/// @throws usage_error as the two
template <bucketing_policy Policy, buffer_strategy Strategy>
module_registration register_module(::torch::nn::Module& module, Bucketer<Policy>& grads, hook_registry& hooks,
                                    BufferReducer<Strategy>& buffers, const register_options& options = {}) {
  module_registration out = register_module(module, grads, hooks);
  module_registration b = register_buffers(module, buffers, options);
  out.buffers = std::move(b.buffers);
  out.skipped.insert(out.skipped.end(), b.skipped.begin(), b.skipped.end());
  return out;
}

}  // namespace ddp::libtorch
