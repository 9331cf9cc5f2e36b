#pragma once
/// @file reproducible/detail/kernels.hpp
/// @brief The only arithmetic of the reproducible reduction: `dst = a + b` and `dst = src / d`,
/// element-wise, for the floating dtypes.
///
/// Each element is one IEEE addition of two stored values, so no compiler option can reassociate
/// it (there is nothing to reassociate: a single `a + b` per element per tree node), and the
/// same inputs give the same bits in every process of the same binary. 2-byte floats are added
/// in f32 and rounded back to their type after every addition, so a node's value is always a
/// value of the storage type, wherever it was computed.

#include <cstddef>
#include <type_traits>

#include <ddp/detail/host_reduce.hpp>
#include <ddp/dtype.hpp>

namespace ddp::reproducible::detail {

/// dst[i] = a[i] + b[i]; `dst` may be `a` or `b` (element-wise, so aliasing is harmless).
template <class T>
inline void add(T* dst, const T* a, const T* b, std::size_t n) noexcept {
  if constexpr (ddp::detail::is_half_like<T>) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = T(static_cast<float>(a[i]) + static_cast<float>(b[i]));
  } else {
    for (std::size_t i = 0; i < n; ++i) dst[i] = a[i] + b[i];
  }
}

/// dst[i] = src[i] / divisor (a division, not a multiplication by the reciprocal: the same
/// operation at every world size, and the correctly rounded mean of the stored sum).
template <class T>
inline void divide(T* dst, const T* src, std::size_t n, std::size_t divisor) noexcept {
  if constexpr (ddp::detail::is_half_like<T>) {
    const float d = static_cast<float>(divisor);
    for (std::size_t i = 0; i < n; ++i) dst[i] = T(static_cast<float>(src[i]) / d);
  } else {
    const T d = static_cast<T>(divisor);
    for (std::size_t i = 0; i < n; ++i) dst[i] = src[i] / d;
  }
}

/// Calls `fn(T{})` for the floating dtypes; returns false (without calling) for the others.
template <class F>
inline bool visit_floating(dtype t, F&& fn) {
  switch (t) {
    case dtype::f16: fn(half{}); return true;
    case dtype::bf16: fn(bfloat16{}); return true;
    case dtype::f32: fn(float{}); return true;
    case dtype::f64: fn(double{}); return true;
    default: return false;
  }
}

/// Type-erased `add`.
inline void add(dtype t, void* dst, const void* a, const void* b, std::size_t n) noexcept {
  visit_floating(t, [&]<class T>(T) { add<T>(static_cast<T*>(dst), static_cast<const T*>(a), static_cast<const T*>(b), n); });
}

}  // namespace ddp::reproducible::detail
