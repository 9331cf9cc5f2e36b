#pragma once
/// @file detail/host_reduce.hpp
/// @brief Element-wise reduction kernels over host memory, dispatched on dtype. Shared by the
/// local backend, the MPI backend's f16/bf16 operators, averaging and compression hooks.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <ddp/dtype.hpp>
#include <ddp/reduce_op.hpp>

namespace ddp::detail {

/// Calls `fn(T{})` with the C++ element type of `t`.
template <class F>
decltype(auto) visit_dtype(dtype t, F&& fn) {
  switch (t) {
    case dtype::f16: return fn(half{});
    case dtype::bf16: return fn(bfloat16{});
    case dtype::f32: return fn(float{});
    case dtype::f64: return fn(double{});
    case dtype::i8: return fn(std::int8_t{});
    case dtype::u8: return fn(std::uint8_t{});
    case dtype::i32: return fn(std::int32_t{});
    case dtype::i64: return fn(std::int64_t{});
  }
  return fn(float{});
}

template <class T>
inline constexpr bool is_half_like = std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;

/// Arithmetic type a T is computed in: f32 for the 2-byte floats, T otherwise.
template <class T>
using compute_t = std::conditional_t<is_half_like<T>, float, T>;

template <class T>
inline compute_t<T> load(const T& v) noexcept {
  if constexpr (is_half_like<T>) {
    return static_cast<float>(v);
  } else {
    return v;
  }
}
template <class T>
inline T store(compute_t<T> v) noexcept {
  if constexpr (is_half_like<T>) {
    return T(v);
  } else {
    return static_cast<T>(v);
  }
}

/// a + b; integers wrap around (two's complement) instead of overflowing, which is undefined
/// for signed types in C++: an integer sum that overflows gives the bits MPI and NCCL give in
/// practice, and no sanitizer report.
template <class C>
[[nodiscard, gnu::always_inline]] inline constexpr C wrapping_add(C a, C b) noexcept {
  if constexpr (std::is_integral_v<C>) {
    using U = std::common_type_t<std::make_unsigned_t<C>, unsigned>;  // never promoted to int
    return static_cast<C>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return static_cast<C>(a + b);
  }
}
/// a * b; integers wrap around as in `wrapping_add`.
template <class C>
[[nodiscard, gnu::always_inline]] inline constexpr C wrapping_mul(C a, C b) noexcept {
  if constexpr (std::is_integral_v<C>) {
    using U = std::common_type_t<std::make_unsigned_t<C>, unsigned>;
    return static_cast<C>(static_cast<U>(a) * static_cast<U>(b));
  } else {
    return static_cast<C>(a * b);
  }
}

template <class T>
inline compute_t<T> combine(reduce_op op, compute_t<T> a, compute_t<T> b) noexcept {
  switch (op) {
    case reduce_op::sum:
    case reduce_op::avg: return wrapping_add(a, b);
    case reduce_op::prod: return wrapping_mul(a, b);
    case reduce_op::min: return std::min(a, b);
    case reduce_op::max: return std::max(a, b);
  }
  return a;
}

/// acc[i] = acc[i] (op) in[i] for n elements. `avg` accumulates like `sum` (divide afterwards).
template <class T>
inline void reduce_typed(reduce_op op, T* acc, const T* in, std::size_t n) noexcept {
  if constexpr (!is_half_like<T>) {
    // Separate loops per op let the compiler vectorise.
    switch (op) {
      case reduce_op::sum:
      case reduce_op::avg:
        for (std::size_t i = 0; i < n; ++i) acc[i] = wrapping_add(acc[i], in[i]);
        return;
      case reduce_op::prod:
        for (std::size_t i = 0; i < n; ++i) acc[i] = wrapping_mul(acc[i], in[i]);
        return;
      case reduce_op::min:
        for (std::size_t i = 0; i < n; ++i) acc[i] = std::min(acc[i], in[i]);
        return;
      case reduce_op::max:
        for (std::size_t i = 0; i < n; ++i) acc[i] = std::max(acc[i], in[i]);
        return;
    }
  } else {
    for (std::size_t i = 0; i < n; ++i) acc[i] = store<T>(combine<T>(op, load(acc[i]), load(in[i])));
  }
}

inline void reduce_into(dtype t, reduce_op op, void* acc, const void* in, std::size_t n) noexcept {
  visit_dtype(t, [&]<class T>(T) { reduce_typed<T>(op, static_cast<T*>(acc), static_cast<const T*>(in), n); });
}

/// data[i] /= divisor. Integers: truncation toward zero (documented rounding rule of `avg`).
inline void divide_in_place(dtype t, void* data, std::size_t n, std::int64_t divisor) noexcept {
  if (divisor == 1) return;
  visit_dtype(t, [&]<class T>(T) {
    T* p = static_cast<T*>(data);
    if constexpr (is_half_like<T>) {
      const float d = static_cast<float>(divisor);
      for (std::size_t i = 0; i < n; ++i) p[i] = T(static_cast<float>(p[i]) / d);
    } else if constexpr (std::is_floating_point_v<T>) {
      const T d = static_cast<T>(divisor);
      for (std::size_t i = 0; i < n; ++i) p[i] = p[i] / d;
    } else {
      for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<T>(static_cast<std::int64_t>(p[i]) / divisor);
    }
  });
}

/// data[i] *= factor (floating dtypes only; integers are left alone).
inline void scale_in_place(dtype t, void* data, std::size_t n, double factor) noexcept {
  if (factor == 1.0) return;
  visit_dtype(t, [&]<class T>(T) {
    T* p = static_cast<T*>(data);
    if constexpr (is_half_like<T>) {
      const float f = static_cast<float>(factor);
      for (std::size_t i = 0; i < n; ++i) p[i] = T(static_cast<float>(p[i]) * f);
    } else if constexpr (std::is_floating_point_v<T>) {
      const T f = static_cast<T>(factor);
      for (std::size_t i = 0; i < n; ++i) p[i] = p[i] * f;
    }
  });
}

/// dst[i] = src[i] * factor for floating dtypes (one pass: the copy and the scaling fused);
/// a plain copy for integers.
inline void scaled_copy(dtype t, void* dst, const void* src, std::size_t n, double factor) noexcept {
  if (factor == 1.0 || !is_floating(t)) {
    std::memcpy(dst, src, n * size_of(t));
    return;
  }
  visit_dtype(t, [&]<class T>(T) {
    T* __restrict d = static_cast<T*>(dst);
    const T* __restrict s = static_cast<const T*>(src);
    if constexpr (is_half_like<T>) {
      const float f = static_cast<float>(factor);
      for (std::size_t i = 0; i < n; ++i) d[i] = T(static_cast<float>(s[i]) * f);
    } else if constexpr (std::is_floating_point_v<T>) {
      const T f = static_cast<T>(factor);
      for (std::size_t i = 0; i < n; ++i) d[i] = s[i] * f;
    }
  });
}

/// Converts n elements between dtypes (through double; f16/bf16 through float).
inline void convert(dtype from, const void* src, dtype to, void* dst, std::size_t n) noexcept {
  if (from == to) {
    std::memcpy(dst, src, n * size_of(from));
    return;
  }
  visit_dtype(from, [&]<class S>(S) {
    visit_dtype(to, [&]<class D>(D) {
      const S* s = static_cast<const S*>(src);
      D* d = static_cast<D*>(dst);
      for (std::size_t i = 0; i < n; ++i) {
        if constexpr (is_half_like<D>) {
          d[i] = D(static_cast<float>(load(s[i])));
        } else {
          d[i] = static_cast<D>(load(s[i]));
        }
      }
    });
  });
}

}  // namespace ddp::detail
