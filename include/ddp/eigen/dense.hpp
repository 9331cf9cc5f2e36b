#pragma once
/// @file eigen/dense.hpp
/// @brief `ddp::tensor_traits` for Eigen's dense types: `Eigen::Matrix`, `Eigen::Array` (always
/// contiguous), and `Eigen::Map` / `Eigen::Ref` of them (contiguous ones only, checked at run time).
///
/// ddp sees a matrix as its `size()` coefficients in storage order (column-major unless
/// `Eigen::RowMajor`): element-wise averaging does not care about the order, and every rank
/// stores the same type the same way. A `Map` or `Ref` with gaps (a block of a larger matrix, an
/// inner stride) is a `usage_error` when viewed. Maps and Refs of const scalars are not tensors
/// (ddp writes the memory). Host memory only.
///
/// Part of the `ddp::eigen` CMake component; not included by `<ddp/ddp.hpp>`.

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>

#include <Eigen/Core>

#include <ddp/device.hpp>
#include <ddp/dtype.hpp>
#include <ddp/eigen/scalar.hpp>
#include <ddp/error.hpp>
#include <ddp/tensor.hpp>

namespace ddp::eigen {

/// An Eigen dense object (`Matrix`, `Array`, `Map`, `Ref`) whose mutable coefficients have a ddp dtype.
template <class T>
concept mutable_dense = scalar<typename T::Scalar> && requires(T& m) {
  { m.data() } -> std::same_as<typename T::Scalar*>;
  { m.size() } -> std::convertible_to<Eigen::Index>;
  { m.innerStride() } -> std::convertible_to<Eigen::Index>;
  { m.outerStride() } -> std::convertible_to<Eigen::Index>;
};

/// The `tensor_traits` of a dense Eigen object `T` (the specialisations below derive from it).
/// For a `Map` or `Ref` it checks contiguity on every call.
template <mutable_dense T>
struct dense_traits {
  /// `m.data()`.
  /// @throws usage_error if `m`'s coefficients are not one gap-free block
  static void* data(T& m) {
    check_contiguous(m);
    return static_cast<void*>(m.data());
  }
  /// `m.size()`: rows times columns.
  /// @throws usage_error as `data`
  static std::size_t size(const T& m) {
    check_contiguous(m);
    return static_cast<std::size_t>(m.size());
  }
  /// The dtype of `T::Scalar`.
  static ddp::dtype dtype(const T&) noexcept { return scalar_dtype_v<typename T::Scalar>; }
  /// Always host memory.
  static ddp::device device(const T&) noexcept { return device::host(); }

  /// @throws usage_error if `m` has an inner stride, or an outer stride larger than its inner size
  static void check_contiguous(const T& m) {
    const Eigen::Index inner = m.innerSize(), outer = m.outerSize();
    if (m.size() == 0 || (m.innerStride() == 1 && (outer <= 1 || m.outerStride() == inner))) return;
    throw usage_error(-1, "tensor_traits<Eigen dense>",
                      "a " + std::to_string(m.rows()) + "x" + std::to_string(m.cols()) +
                          " Eigen map/ref with inner stride " + std::to_string(m.innerStride()) + " and outer stride " +
                          std::to_string(m.outerStride()) +
                          " is not one contiguous block: ddp needs its coefficients back to back (copy it into a "
                          "plain Matrix/Array and register that)");
  }
};

}  // namespace ddp::eigen

namespace ddp {

/// `Eigen::Matrix` of a supported scalar: see `eigen::dense_traits`.
template <class S, int Rows, int Cols, int Options, int MaxRows, int MaxCols>
requires eigen::scalar<S>
struct tensor_traits<Eigen::Matrix<S, Rows, Cols, Options, MaxRows, MaxCols>>
    : eigen::dense_traits<Eigen::Matrix<S, Rows, Cols, Options, MaxRows, MaxCols>> {
};

/// `Eigen::Array` of a supported scalar: see `eigen::dense_traits`.
template <class S, int Rows, int Cols, int Options, int MaxRows, int MaxCols>
requires eigen::scalar<S>
struct tensor_traits<Eigen::Array<S, Rows, Cols, Options, MaxRows, MaxCols>>
    : eigen::dense_traits<Eigen::Array<S, Rows, Cols, Options, MaxRows, MaxCols>> {
};

/// `Eigen::Map` of a mutable Matrix or Array: see `eigen::dense_traits` (contiguity checked).
template <class Plain, int MapOptions, class Stride>
requires eigen::mutable_dense<Eigen::Map<Plain, MapOptions, Stride>>
struct tensor_traits<Eigen::Map<Plain, MapOptions, Stride>>
    : eigen::dense_traits<Eigen::Map<Plain, MapOptions, Stride>> {
};

/// `Eigen::Ref` of a mutable Matrix or Array: see `eigen::dense_traits` (contiguity checked).
template <class Plain, int RefOptions, class Stride>
requires eigen::mutable_dense<Eigen::Ref<Plain, RefOptions, Stride>>
struct tensor_traits<Eigen::Ref<Plain, RefOptions, Stride>>
    : eigen::dense_traits<Eigen::Ref<Plain, RefOptions, Stride>> {
};

static_assert(tensor<Eigen::MatrixXf> && tensor<Eigen::ArrayXd> && tensor<Eigen::Map<Eigen::VectorXf>>);
static_assert(!tensor<Eigen::Map<const Eigen::VectorXf>> && !tensor<Eigen::MatrixXcf>);

}  // namespace ddp
