#pragma once
/// @file eigen/tensor_module.hpp
/// @brief `ddp::tensor_traits` for the tensors of Eigen's unsupported Tensor module:
/// `Eigen::Tensor`, `Eigen::TensorFixedSize` and `Eigen::TensorMap` of them.
///
/// Each is one contiguous block of `size()` coefficients in its storage order (column-major
/// unless `Eigen::RowMajor`); ddp sees exactly that block. TensorMaps of const tensors are not
/// ddp tensors (ddp writes the memory). Host memory only.
///
/// Part of the `ddp::eigen` CMake component; not included by `<ddp/ddp.hpp>`.

#include <cstddef>
#include <type_traits>

#include <unsupported/Eigen/CXX11/Tensor>

#include <ddp/device.hpp>
#include <ddp/dtype.hpp>
#include <ddp/eigen/scalar.hpp>
#include <ddp/tensor.hpp>

namespace ddp::eigen {

/// A tensor of Eigen's Tensor module whose mutable coefficients have a ddp dtype.
template <class T>
concept mutable_tensor = scalar<typename T::Scalar> && requires(T& t) {
  { t.data() } -> std::same_as<typename T::Scalar*>;
  { t.size() } -> std::convertible_to<Eigen::Index>;
};

/// The `tensor_traits` of an Eigen Tensor-module tensor `T` (the specialisations below derive
/// from it).
template <mutable_tensor T>
struct tensor_module_traits {
  /// `t.data()`.
  static void* data(T& t) noexcept { return static_cast<void*>(t.data()); }
  /// `t.size()`: the product of the dimensions.
  static std::size_t size(const T& t) noexcept { return static_cast<std::size_t>(t.size()); }
  /// The dtype of `T::Scalar`.
  static ddp::dtype dtype(const T&) noexcept { return scalar_dtype_v<typename T::Scalar>; }
  /// Always host memory.
  static ddp::device device(const T&) noexcept { return device::host(); }
};

}  // namespace ddp::eigen

namespace ddp {

/// `Eigen::Tensor` of a supported scalar: see `eigen::tensor_module_traits`.
template <class S, int Rank, int Options, class Index>
requires eigen::scalar<S>
struct tensor_traits<Eigen::Tensor<S, Rank, Options, Index>>
    : eigen::tensor_module_traits<Eigen::Tensor<S, Rank, Options, Index>> {
};

/// `Eigen::TensorFixedSize` of a supported scalar: see `eigen::tensor_module_traits`.
template <class S, class Dimensions, int Options, class Index>
requires eigen::scalar<S>
struct tensor_traits<Eigen::TensorFixedSize<S, Dimensions, Options, Index>>
    : eigen::tensor_module_traits<Eigen::TensorFixedSize<S, Dimensions, Options, Index>> {
};

/// `Eigen::TensorMap` of a mutable tensor: see `eigen::tensor_module_traits`.
template <class Plain, int Options, template <class> class MakePointer>
requires eigen::mutable_tensor<Eigen::TensorMap<Plain, Options, MakePointer>>
struct tensor_traits<Eigen::TensorMap<Plain, Options, MakePointer>>
    : eigen::tensor_module_traits<Eigen::TensorMap<Plain, Options, MakePointer>> {
};

static_assert(tensor<Eigen::Tensor<float, 3>> && tensor<Eigen::TensorMap<Eigen::Tensor<double, 2>>>);
static_assert(!tensor<Eigen::TensorMap<const Eigen::Tensor<float, 2>>>);

}  // namespace ddp
