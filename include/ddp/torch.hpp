#pragma once
/// @file torch.hpp
/// @brief The libtorch adapter: `at::Tensor` as a ddp tensor, gradient-ready hooks on libtorch's
/// autograd, and `register_module` for a `torch::nn::Module`'s parameters and buffers.
///
/// CMake: `find_package(ddp CONFIG REQUIRED COMPONENTS torch)` (finds Torch too) and link
/// `ddp::torch`. Never included by `<ddp/ddp.hpp>`: libtorch is a large dependency.
/// Everything lives in `ddp::libtorch` (not `ddp::torch`, which would hide libtorch's top-level
/// `torch` namespace).
///
/// - `<ddp/torch/tensor_traits.hpp>`: `tensor_traits<at::Tensor>`, `to_dtype`, `to_device`.
/// - `<ddp/torch/hook_registry.hpp>`: `hook_registry`, AccumulateGrad post hooks for
///   `Bucketer::attach`, removed when the Bucketer is destroyed.
/// - `<ddp/torch/register_module.hpp>`: `register_module`, `register_buffers`, the BatchNorm
///   buffer strategies.
///
/// See docs/torch.md and examples/libtorch_cnn.cpp.

#include <ddp/torch/hook_registry.hpp>
#include <ddp/torch/register_module.hpp>
#include <ddp/torch/tensor_traits.hpp>
