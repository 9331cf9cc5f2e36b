#pragma once
/// @file eigen.hpp
/// @brief The Eigen adapter: Eigen's dense matrices and arrays (and contiguous maps and refs of
/// them) and the Tensor module's tensors are ddp tensors.
///
/// CMake: `find_package(ddp CONFIG REQUIRED COMPONENTS eigen)` (finds Eigen3 too) and link
/// `ddp::eigen`. Never included by `<ddp/ddp.hpp>`.
///
/// - `<ddp/eigen/scalar.hpp>`: scalar types and their dtypes (`Eigen::half` is f16, ...).
/// - `<ddp/eigen/dense.hpp>`: `Eigen::Matrix`, `Eigen::Array`, `Eigen::Map`, `Eigen::Ref`.
/// - `<ddp/eigen/tensor_module.hpp>`: `Eigen::Tensor`, `Eigen::TensorFixedSize`, `Eigen::TensorMap`.
///
/// See docs/eigen.md and examples/eigen_regression.cpp.

#include <ddp/eigen/dense.hpp>
#include <ddp/eigen/scalar.hpp>
#include <ddp/eigen/tensor_module.hpp>
