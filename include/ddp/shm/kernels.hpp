#pragma once
/// @file shm/kernels.hpp
/// @brief The reduction kernel of the shared-memory allreduce: k inputs into one output, in a
/// fixed input (rank) order, computed in blocks that stay in L1.
///
/// Why blocks: the output may be one of the inputs (a rank reduces its slice in place), so the
/// result is accumulated in a small local array and stored once per block; every inner loop then
/// runs over two restrict pointers and a compile-time operator, which compilers vectorise. f16
/// and bf16 are widened to f32 a block at a time with branch-free (vectorisable) conversions
/// that give exactly the bits of `ddp::half` / `ddp::bfloat16`, accumulated in f32, and rounded
/// once at the end.

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <ddp/detail/host_reduce.hpp>
#include <ddp/dtype.hpp>
#include <ddp/reduce_op.hpp>

namespace ddp::shm::detail {

using ddp::detail::compute_t;
using ddp::detail::is_half_like;

/// Elements per block: 1024 (4 KiB of f32 accumulator, 8 KiB of f64).
inline constexpr std::size_t kernel_block = 1024;

// ---- 2-byte float conversions, branch-free -------------------------------------------------

inline void widen(float* __restrict out, const half* __restrict in, std::size_t n) noexcept {
  const auto* h = reinterpret_cast<const std::uint16_t*>(in);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t x = h[i];
    const std::uint32_t sign = (x & 0x8000u) << 16;
    const std::uint32_t em = x & 0x7fffu;
    std::uint32_t o = (em << 13) + 0x38000000u;          // rebias the exponent: 127 - 15
    o = em >= 0x7c00u ? o + 0x38000000u : o;             // inf / nan: exponent all ones
    // zero / subnormal: build 2^-14 * (1 + m/1024) and subtract 2^-14, exact in float
    const float sub = std::bit_cast<float>(o + 0x00800000u) - std::bit_cast<float>(0x38800000u);
    o = em < 0x0400u ? std::bit_cast<std::uint32_t>(sub) : o;
    out[i] = std::bit_cast<float>(o | sign);
  }
}

inline void widen(float* __restrict out, const bfloat16* __restrict in, std::size_t n) noexcept {
  const auto* b = reinterpret_cast<const std::uint16_t*>(in);
  for (std::size_t i = 0; i < n; ++i) out[i] = std::bit_cast<float>(static_cast<std::uint32_t>(b[i]) << 16);
}

/// Same rounding as `half::from_float` (nearest even; overflow to inf; nan stays nan).
inline void narrow(half* __restrict out, const float* __restrict in, std::size_t n) noexcept {
  auto* h = reinterpret_cast<std::uint16_t*>(out);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t x = std::bit_cast<std::uint32_t>(in[i]);
    const std::uint32_t sign = (x >> 16) & 0x8000u;
    const std::uint32_t abs = x & 0x7fffffffu;
    const std::uint32_t big = abs > 0x7f800000u ? 0x7e00u : 0x7c00u;
    const float shifted = std::bit_cast<float>(abs < 0x38800000u ? abs : 0u) + 0.5f;
    const std::uint32_t small = std::bit_cast<std::uint32_t>(shifted) - 0x3f000000u;
    const std::uint32_t normal = (abs + 0xc8000fffu + ((abs >> 13) & 1u)) >> 13;
    const std::uint32_t v = abs >= 0x47800000u ? big : (abs < 0x38800000u ? small : normal);
    h[i] = static_cast<std::uint16_t>(sign | v);
  }
}

/// Same rounding as `bfloat16::from_float`.
inline void narrow(bfloat16* __restrict out, const float* __restrict in, std::size_t n) noexcept {
  auto* b = reinterpret_cast<std::uint16_t*>(out);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t x = std::bit_cast<std::uint32_t>(in[i]);
    const std::uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    const std::uint32_t nan = (x >> 16) | 0x40u;
    b[i] = static_cast<std::uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
  }
}

// ---- element-wise loops, one per operator ---------------------------------------------------

template <reduce_op Op, class C>
inline void combine(C* __restrict acc, const C* __restrict in, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    if constexpr (Op == reduce_op::sum || Op == reduce_op::avg) {
      acc[i] = static_cast<C>(acc[i] + in[i]);
    } else if constexpr (Op == reduce_op::prod) {
      acc[i] = static_cast<C>(acc[i] * in[i]);
    } else if constexpr (Op == reduce_op::min) {
      acc[i] = in[i] < acc[i] ? in[i] : acc[i];
    } else {
      acc[i] = acc[i] < in[i] ? in[i] : acc[i];
    }
  }
}

/// acc /= divisor: floating point divides (no reciprocal: the same rounding as everywhere else
/// in ddp); integers truncate toward zero.
template <class C>
inline void divide(C* __restrict acc, std::size_t n, std::int64_t divisor) noexcept {
  if constexpr (std::is_floating_point_v<C>) {
    const C d = static_cast<C>(divisor);
    for (std::size_t i = 0; i < n; ++i) acc[i] = acc[i] / d;
  } else {
    for (std::size_t i = 0; i < n; ++i) acc[i] = static_cast<C>(static_cast<std::int64_t>(acc[i]) / divisor);
  }
}

// acc = a op b, one pass.
template <reduce_op Op, class C>
inline void combine2(C* __restrict acc, const C* __restrict a, const C* __restrict b, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    if constexpr (Op == reduce_op::sum || Op == reduce_op::avg) {
      acc[i] = static_cast<C>(a[i] + b[i]);
    } else if constexpr (Op == reduce_op::prod) {
      acc[i] = static_cast<C>(a[i] * b[i]);
    } else if constexpr (Op == reduce_op::min) {
      acc[i] = b[i] < a[i] ? b[i] : a[i];
    } else {
      acc[i] = a[i] < b[i] ? b[i] : a[i];
    }
  }
}

template <class T, reduce_op Op>
void reduce_many_typed(T* out, T* out2, const T* const* in, int k, std::size_t n, std::int64_t divisor) noexcept {
  using C = compute_t<T>;
  alignas(64) C acc[kernel_block];
  alignas(64) C wide[is_half_like<T> ? kernel_block : 1];
  for (std::size_t b = 0; b < n; b += kernel_block) {
    const std::size_t m = std::min(kernel_block, n - b);
    if constexpr (is_half_like<T>) {
      widen(acc, in[0] + b, m);
      for (int q = 1; q < k; ++q) {
        widen(wide, in[q] + b, m);
        combine<Op>(acc, wide, m);
      }
    } else if (k == 1) {
      std::memcpy(acc, in[0] + b, m * sizeof(T));
    } else {
      combine2<Op>(acc, in[0] + b, in[1] + b, m);
      for (int q = 2; q < k; ++q) combine<Op>(acc, in[q] + b, m);
    }
    if (divisor > 1) divide(acc, m, divisor);
    if constexpr (is_half_like<T>) {
      narrow(out + b, acc, m);
      if (out2 != nullptr) std::memcpy(out2 + b, out + b, m * sizeof(T));
    } else {
      std::memcpy(out + b, acc, m * sizeof(T));
      if (out2 != nullptr) std::memcpy(out2 + b, acc, m * sizeof(T));
    }
  }
}

/// out[i] = in[0][i] op in[1][i] op ... op in[k-1][i], left to right, for i < n; then divided by
/// `divisor` if it exceeds 1 (for `avg`, pass the number of contributing ranks; the sum is the
/// operator then). `out` may equal any `in[q]`; other overlaps are not allowed. `out2`, if not
/// null, receives the same bits (written from the block still in L1).
inline void reduce_many(dtype t, reduce_op op, void* out, void* out2, const void* const* in, int k, std::size_t n,
                        std::int64_t divisor) noexcept {
  if (n == 0 || k <= 0) return;
  ddp::detail::visit_dtype(t, [&]<class T>(T) {
    auto* o = static_cast<T*>(out);
    auto* o2 = static_cast<T*>(out2);
    const auto* const* i = reinterpret_cast<const T* const*>(in);
    switch (op) {
      case reduce_op::sum: reduce_many_typed<T, reduce_op::sum>(o, o2, i, k, n, 1); break;
      case reduce_op::avg: reduce_many_typed<T, reduce_op::sum>(o, o2, i, k, n, divisor); break;
      case reduce_op::prod: reduce_many_typed<T, reduce_op::prod>(o, o2, i, k, n, 1); break;
      case reduce_op::min: reduce_many_typed<T, reduce_op::min>(o, o2, i, k, n, 1); break;
      case reduce_op::max: reduce_many_typed<T, reduce_op::max>(o, o2, i, k, n, 1); break;
    }
  });
}

}  // namespace ddp::shm::detail
