#pragma once
/// @file torch/tensor_traits.hpp
/// @brief `ddp::tensor_traits<at::Tensor>`: libtorch tensors (and `torch::Tensor`, the same type)
/// as ddp tensors, with the dtype and device mappings behind it.
///
/// An `at::Tensor` is a handle: copies share the storage, so a copy viewed by ddp is the tensor.
/// ddp sees a tensor as one block of `numel()` elements, so it must be contiguous (in the default
/// memory format), strided (not sparse or MKL-DNN), on the CPU or a CUDA device, and of a dtype
/// ddp moves (f16, bf16, f32, f64, i8, u8, i32, i64). Anything else is a `ddp::usage_error` whose
/// message names what was wrong (the dtype, the device, the strides), thrown when the tensor is
/// viewed (`ddp::view`, `Bucketer::add`, `BufferReducer::add`, ...), never later.
///
/// Part of the `ddp::torch` CMake component; not included by `<ddp/ddp.hpp>`.

#include <cstddef>
#include <sstream>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Layout.h>
#include <c10/core/ScalarType.h>

#include <ddp/device.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/tensor.hpp>

namespace ddp {

/// libtorch adapter (`<ddp/torch.hpp>`). Named `libtorch`, not `torch`, so that a `ddp::torch`
/// never hides libtorch's own top-level `torch` namespace in code that uses both (or
/// `using namespace ddp`).
namespace libtorch {

/// The ddp dtype of a libtorch scalar type.
/// @throws usage_error naming the type (`Bool`, `Short`, `ComplexFloat`, quantized types, ...)
///   for types ddp does not move
[[nodiscard]] inline dtype to_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Half: return dtype::f16;
    case c10::ScalarType::BFloat16: return dtype::bf16;
    case c10::ScalarType::Float: return dtype::f32;
    case c10::ScalarType::Double: return dtype::f64;
    case c10::ScalarType::Char: return dtype::i8;
    case c10::ScalarType::Byte: return dtype::u8;
    case c10::ScalarType::Int: return dtype::i32;
    case c10::ScalarType::Long: return dtype::i64;
    default: break;
  }
  throw usage_error(-1, "tensor_traits<at::Tensor>",
                    std::string("libtorch dtype ") + c10::toString(t) +
                        " is not supported by ddp (supported: Half, BFloat16, Float, Double, Char, Byte, Int, Long); "
                        "convert the tensor with .to(...) or keep it out of the Bucketer/BufferReducer");
}

/// The libtorch scalar type of a ddp dtype (every ddp dtype has one).
[[nodiscard]] constexpr c10::ScalarType to_scalar_type(dtype t) noexcept {
  switch (t) {
    case dtype::f16: return c10::ScalarType::Half;
    case dtype::bf16: return c10::ScalarType::BFloat16;
    case dtype::f32: return c10::ScalarType::Float;
    case dtype::f64: return c10::ScalarType::Double;
    case dtype::i8: return c10::ScalarType::Char;
    case dtype::u8: return c10::ScalarType::Byte;
    case dtype::i32: return c10::ScalarType::Int;
    case dtype::i64: return c10::ScalarType::Long;
  }
  return c10::ScalarType::Undefined;
}

/// The ddp device of a libtorch device: CPU is `device::host()`, CUDA `device::cuda(index)`
/// (index 0 when libtorch left it unspecified).
/// @throws usage_error naming the device for any other device type (MPS, XLA, meta, ...)
[[nodiscard]] inline device to_device(const c10::Device& d) {
  if (d.is_cpu()) return device::host();
  if (d.is_cuda()) return device::cuda(d.has_index() ? static_cast<int>(d.index()) : 0);
  throw usage_error(-1, "tensor_traits<at::Tensor>",
                    "tensor on libtorch device '" + d.str() + "': ddp supports CPU and CUDA tensors only");
}

/// Checks that ddp can view `t`: defined, strided, contiguous, on a supported device, of a
/// supported dtype (so each trait function fails the same way, whichever is called first).
/// @throws usage_error saying which condition failed (for a non-contiguous tensor: its sizes and
///   strides, and the fix)
inline void check_viewable(const at::Tensor& t) {
  if (!t.defined()) {
    throw usage_error(-1, "tensor_traits<at::Tensor>",
                      "undefined tensor (a default-constructed at::Tensor, or a .grad() that was never "
                      "allocated: ddp::libtorch::register_module pre-allocates gradients)");
  }
  if (t.layout() != c10::kStrided) {
    std::ostringstream os;
    os << "tensor with layout " << t.layout() << ": ddp supports strided (dense) tensors only";
    throw usage_error(-1, "tensor_traits<at::Tensor>", os.str());
  }
  if (!t.is_contiguous()) {
    std::ostringstream os;
    os << "non-contiguous tensor (sizes " << t.sizes() << ", strides " << t.strides()
       << "): ddp views a tensor as one block of numel() elements in row-major order. Make it contiguous "
          "(.contiguous() makes a copy: register the copy, and use it) or keep it in the default memory "
          "format (channels_last tensors are not contiguous in that sense)";
    throw usage_error(-1, "tensor_traits<at::Tensor>", os.str());
  }
  (void)to_device(t.device());
  (void)to_dtype(t.scalar_type());
}

}  // namespace libtorch

/// libtorch tensors are ddp tensors (see the file description). Every function checks the tensor
/// first and throws `usage_error` for one ddp cannot view. `data` takes a const handle: a const
/// `at::Tensor` still refers to mutable storage.
template <>
struct tensor_traits<at::Tensor> {
  /// A handle: copies share storage, so the BufferReducer and the Bucketer's parameters hold it
  /// by value and re-read `data_ptr()`. A gradient registered as its slot
  /// (`grads.add(p, p.mutable_grad())`) is followed when `zero_grad(set_to_none=true)` replaces it;
  /// `register_module` registers fixed views and its hooks reject a reallocated `.grad()`.
  static constexpr bool is_handle = true;
  /// `t.data_ptr()` (storage offset included).
  /// @throws usage_error for an undefined, non-strided or non-contiguous tensor, an unsupported
  ///   device or dtype (see `libtorch::check_viewable`)
  static void* data(const at::Tensor& t) {
    libtorch::check_viewable(t);
    return t.data_ptr();
  }
  /// `t.numel()`.
  /// @throws usage_error as `data`
  static std::size_t size(const at::Tensor& t) {
    libtorch::check_viewable(t);
    return static_cast<std::size_t>(t.numel());
  }
  /// The dtype of `t.scalar_type()`.
  /// @throws usage_error for a dtype ddp does not move, naming it, or as `data`
  static ddp::dtype dtype(const at::Tensor& t) {
    libtorch::check_viewable(t);
    return libtorch::to_dtype(t.scalar_type());
  }
  /// `device::host()` for CPU tensors, `device::cuda(index)` for CUDA tensors.
  /// @throws usage_error for other devices, naming them, or as `data`
  static ddp::device device(const at::Tensor& t) {
    libtorch::check_viewable(t);
    return libtorch::to_device(t.device());
  }
};

static_assert(tensor<at::Tensor>);

}  // namespace ddp
