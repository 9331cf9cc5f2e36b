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

/// Every loop runs in steps of `lanes` elements with a fixed-count inner loop over restrict
/// pointers, plus a scalar tail: g++ at -O2 vectorises only loops whose trip count needs no
/// runtime check (the same technique as the shm kernels). Vectorising changes no result: each
/// element is still one addition of the same two values.
inline constexpr std::size_t lanes = 16;

template <class T>
inline void add_distinct(T* __restrict dst, const T* __restrict a, const T* __restrict b, std::size_t n) noexcept {
  const std::size_t whole = n - n % lanes;
  for (std::size_t i = 0; i < whole; i += lanes) {
    for (std::size_t j = 0; j < lanes; ++j) dst[i + j] = a[i + j] + b[i + j];
  }
  for (std::size_t i = whole; i < n; ++i) dst[i] = a[i] + b[i];
}
template <class T>
inline void add_into_left(T* __restrict a, const T* __restrict b, std::size_t n) noexcept {
  const std::size_t whole = n - n % lanes;
  for (std::size_t i = 0; i < whole; i += lanes) {
    for (std::size_t j = 0; j < lanes; ++j) a[i + j] = a[i + j] + b[i + j];
  }
  for (std::size_t i = whole; i < n; ++i) a[i] = a[i] + b[i];
}
template <class T>
inline void add_into_right(const T* __restrict a, T* __restrict b, std::size_t n) noexcept {
  const std::size_t whole = n - n % lanes;
  for (std::size_t i = 0; i < whole; i += lanes) {
    for (std::size_t j = 0; j < lanes; ++j) b[i + j] = a[i + j] + b[i + j];
  }
  for (std::size_t i = whole; i < n; ++i) b[i] = a[i] + b[i];
}

/// dst[i] = a[i] + b[i], left operand `a`; `dst` may be `a` or `b`, or distinct from both.
template <class T>
inline void add(T* dst, const T* a, const T* b, std::size_t n) noexcept {
  if constexpr (ddp::detail::is_half_like<T>) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = T(static_cast<float>(a[i]) + static_cast<float>(b[i]));
  } else if (dst == a) {
    add_into_left(dst, b, n);
  } else if (dst == b) {
    add_into_right(a, dst, n);
  } else {
    add_distinct(dst, a, b, n);
  }
}

/// dst[i] = src[i] / divisor (a division, not a multiplication by the reciprocal: the same
/// operation at every world size, and the correctly rounded mean of the stored sum). `dst` and
/// `src` do not overlap.
template <class T>
inline void divide(T* __restrict dst, const T* __restrict src, std::size_t n, std::size_t divisor) noexcept {
  if constexpr (ddp::detail::is_half_like<T>) {
    const float d = static_cast<float>(divisor);
    for (std::size_t i = 0; i < n; ++i) dst[i] = T(static_cast<float>(src[i]) / d);
  } else {
    const T d = static_cast<T>(divisor);
    const std::size_t whole = n - n % lanes;
    for (std::size_t i = 0; i < whole; i += lanes) {
      for (std::size_t j = 0; j < lanes; ++j) dst[i + j] = src[i + j] / d;
    }
    for (std::size_t i = whole; i < n; ++i) dst[i] = src[i] / d;
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
  visit_floating(
      t, [&]<class T>(T) { add<T>(static_cast<T*>(dst), static_cast<const T*>(a), static_cast<const T*>(b), n); });
}

}  // namespace ddp::reproducible::detail
