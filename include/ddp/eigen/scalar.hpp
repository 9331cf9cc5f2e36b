#pragma once
/// @file eigen/scalar.hpp
/// @brief Which Eigen scalar types ddp moves, and their dtypes: `ddp::eigen::scalar_dtype`.
///
/// The ddp element types (`float`, `double`, `std::int8_t`, `std::uint8_t`, `std::int32_t`,
/// `std::int64_t`, `long long`) map as everywhere in ddp; Eigen's own 2-byte floats
/// `Eigen::half` and `Eigen::bfloat16` map to `dtype::f16` and `dtype::bf16` (same encodings as
/// `ddp::half` and `ddp::bfloat16`). Any other scalar (`std::complex`, `bool`, `short`, ...) has
/// no dtype, so a matrix of it is not a `ddp::tensor`: a compile error where it is used.
///
/// Part of the `ddp::eigen` CMake component; not included by `<ddp/ddp.hpp>`.

#include <type_traits>

#include <Eigen/Core>

#include <ddp/dtype.hpp>

/// Eigen adapter (`<ddp/eigen.hpp>`).
namespace ddp::eigen {

/// The dtype of Eigen scalar type `S` as `value`; no `value` for scalars ddp does not move.
template <class S>
struct scalar_dtype {};

/// ddp element types map to their own dtype.
template <class S>
requires element<S>
struct scalar_dtype<S> : std::integral_constant<dtype, dtype_v<S>> {
};

/// `Eigen::half` (IEEE binary16) is `dtype::f16`.
template <>
struct scalar_dtype<Eigen::half> : std::integral_constant<dtype, dtype::f16> {};

/// `Eigen::bfloat16` is `dtype::bf16`.
template <>
struct scalar_dtype<Eigen::bfloat16> : std::integral_constant<dtype, dtype::bf16> {};

/// An Eigen scalar type with a ddp dtype.
template <class S>
concept scalar = requires {
  scalar_dtype<std::remove_cv_t<S>>::value;
};

/// `scalar_dtype<S>::value`.
template <scalar S>
inline constexpr dtype scalar_dtype_v = scalar_dtype<std::remove_cv_t<S>>::value;

static_assert(sizeof(Eigen::half) == 2 && sizeof(Eigen::bfloat16) == 2, "Eigen's 2-byte floats are 2 bytes");

}  // namespace ddp::eigen
