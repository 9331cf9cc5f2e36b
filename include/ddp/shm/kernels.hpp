#pragma once
/// @file shm/kernels.hpp
/// @brief The reduction kernel of the shared-memory allreduce: k inputs into one output, in a
/// fixed input (rank) order, computed in blocks that stay in L1.
///
/// Why blocks: the output may be one of the inputs (a rank reduces its slice in place), so the
/// result is accumulated in a small local array and stored once per block; every inner loop then
/// runs over restrict pointers and a compile-time operator, which compilers vectorise (see
/// `lanes`). f16 and bf16 are widened to f32 a block at a time with branch-free conversions that
/// give exactly the bits of `ddp::half` / `ddp::bfloat16`, accumulated in f32, and rounded once
/// at the end.
///
/// Measured (g++ 12 -O2, SSE2 baseline, 128 Ki elements in L2): f32 sum of two inputs 22 us
/// (memcpy of the same bytes: 7-12 us); the scalar loops this replaces took 60 us; f16 is about
/// 8x slower than f32 (conversions), bf16 3x.

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <ddp/detail/host_reduce.hpp>
#include <ddp/dtype.hpp>
#include <ddp/reduce_op.hpp>

// Helpers are forced inline so that each kernel entry point (baseline, AVX2) compiles them with
// its own instruction set.
#if defined(__GNUC__) || defined(__clang__)
#define DDP_SHM_INLINE [[gnu::always_inline]]
#else
#define DDP_SHM_INLINE
#endif
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define DDP_SHM_X86_DISPATCH 1
#else
#define DDP_SHM_X86_DISPATCH 0
#endif

namespace ddp::shm::detail {

using ddp::detail::compute_t;
using ddp::detail::is_half_like;

/// Elements per block: 1024 (4 KiB of f32 accumulator, 8 KiB of f64).
inline constexpr std::size_t kernel_block = 1024;

/// Every loop below runs in steps of `lanes` elements with a fixed-count inner loop, plus a
/// scalar tail. Why: g++ at -O2 vectorises only loops whose trip count needs no runtime
/// epilogue ("very cheap" cost model); a 16-element inner loop is a whole number of vectors of
/// any element type, so it vectorises at -O2 and -O3 alike, with clang too. Selects are written
/// as bit masks for the same reason (a branch inside the loop stops g++ at -O2).
inline constexpr std::size_t lanes = 16;

[[nodiscard]] constexpr std::uint32_t mask_if(bool b) noexcept { return 0u - static_cast<std::uint32_t>(b); }

// ---- 2-byte float conversions, branch-free -------------------------------------------------

DDP_SHM_INLINE [[nodiscard]] inline float half_to_float(std::uint16_t h) noexcept {
  const std::uint32_t x = h;
  const std::uint32_t sign = (x & 0x8000u) << 16;
  const std::uint32_t em = x & 0x7fffu;
  const std::uint32_t inf_or_nan = mask_if(em >= 0x7c00u);
  const std::uint32_t subnormal = mask_if(em < 0x0400u);
  // normal: rebias the exponent (127 - 15); inf / nan: exponent all ones
  const std::uint32_t normal = (em << 13) + 0x38000000u + (inf_or_nan & 0x38000000u);
  // zero / subnormal: mantissa * 2^-24, exact in float
  const std::uint32_t tiny = std::bit_cast<std::uint32_t>(static_cast<float>(static_cast<std::int32_t>(em)) * 0x1p-24f);
  return std::bit_cast<float>(((tiny & subnormal) | (normal & ~subnormal)) | sign);
}

/// Same rounding as `half::from_float` (nearest even; overflow to inf; nan becomes 0x7e00).
DDP_SHM_INLINE [[nodiscard]] inline std::uint16_t float_to_half(float f) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t abs = x & 0x7fffffffu;
  const std::uint32_t big = mask_if(abs >= 0x47800000u);
  const std::uint32_t small = mask_if(abs < 0x38800000u);
  const std::uint32_t overflow = 0x7c00u | (mask_if(abs > 0x7f800000u) & 0x0200u);
  // subnormal or zero in half: round to nearest even by a float add of 0.5
  const std::uint32_t sub = std::bit_cast<std::uint32_t>(std::bit_cast<float>(abs & small) + 0.5f) - 0x3f000000u;
  const std::uint32_t normal = (abs + 0xc8000fffu + ((abs >> 13) & 1u)) >> 13;  // rebias, round to nearest even
  return static_cast<std::uint16_t>(sign | (overflow & big) | (sub & small) | (normal & ~(big | small)));
}

DDP_SHM_INLINE [[nodiscard]] inline float bfloat_to_float(std::uint16_t b) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

/// Same rounding as `bfloat16::from_float`.
DDP_SHM_INLINE [[nodiscard]] inline std::uint16_t float_to_bfloat(float f) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const std::uint32_t nan = mask_if((x & 0x7fffffffu) > 0x7f800000u);
  return static_cast<std::uint16_t>((((x >> 16) | 0x40u) & nan) | (rounded & ~nan));
}

template <class T>
DDP_SHM_INLINE inline float to_float(std::uint16_t bits) noexcept {
  return std::is_same_v<T, half> ? half_to_float(bits) : bfloat_to_float(bits);
}
template <class T>
DDP_SHM_INLINE inline std::uint16_t from_float(float v) noexcept {
  return std::is_same_v<T, half> ? float_to_half(v) : float_to_bfloat(v);
}

template <class T>
DDP_SHM_INLINE inline void widen(float* __restrict out, const T* __restrict in, std::size_t n) noexcept {
  const auto* h = reinterpret_cast<const std::uint16_t*>(in);
  const std::size_t whole = n - n % lanes;
  for (std::size_t i = 0; i < whole; i += lanes) {
    for (std::size_t j = 0; j < lanes; ++j) out[i + j] = to_float<T>(h[i + j]);
  }
  for (std::size_t i = whole; i < n; ++i) out[i] = to_float<T>(h[i]);
}

template <class T>
DDP_SHM_INLINE inline void narrow(T* __restrict out, const float* __restrict in, std::size_t n) noexcept {
  auto* h = reinterpret_cast<std::uint16_t*>(out);
  const std::size_t whole = n - n % lanes;
  for (std::size_t i = 0; i < whole; i += lanes) {
    for (std::size_t j = 0; j < lanes; ++j) h[i + j] = from_float<T>(in[i + j]);
  }
  for (std::size_t i = whole; i < n; ++i) h[i] = from_float<T>(in[i]);
}

// ---- element-wise loops, one per operator ---------------------------------------------------

template <reduce_op Op, class C>
DDP_SHM_INLINE [[nodiscard]] inline C apply(C a, C b) noexcept {
  if constexpr (Op == reduce_op::sum || Op == reduce_op::avg) {
    return ddp::detail::wrapping_add(a, b);  // integers wrap instead of overflowing
  } else if constexpr (Op == reduce_op::prod) {
    return ddp::detail::wrapping_mul(a, b);
  } else if constexpr (Op == reduce_op::min) {
    return b < a ? b : a;  // std::min(a, b)
  } else {
    return a < b ? b : a;  // std::max(a, b)
  }
}

/// acc = acc op in.
template <reduce_op Op, class C>
DDP_SHM_INLINE inline void combine(C* __restrict acc, const C* __restrict in, std::size_t n) noexcept {
  const std::size_t whole = n - n % lanes;
  for (std::size_t i = 0; i < whole; i += lanes) {
    for (std::size_t j = 0; j < lanes; ++j) acc[i + j] = apply<Op>(acc[i + j], in[i + j]);
  }
  for (std::size_t i = whole; i < n; ++i) acc[i] = apply<Op>(acc[i], in[i]);
}

/// acc = a op b.
template <reduce_op Op, class C>
DDP_SHM_INLINE inline void combine2(C* __restrict acc, const C* __restrict a, const C* __restrict b,
                                    std::size_t n) noexcept {
  const std::size_t whole = n - n % lanes;
  for (std::size_t i = 0; i < whole; i += lanes) {
    for (std::size_t j = 0; j < lanes; ++j) acc[i + j] = apply<Op>(a[i + j], b[i + j]);
  }
  for (std::size_t i = whole; i < n; ++i) acc[i] = apply<Op>(a[i], b[i]);
}

/// acc = (a * factor) op (b * factor), each product rounded to C before `op` (the bits of a
/// scaling pass followed by the reduction, in one pass).
template <reduce_op Op, class C>
DDP_SHM_INLINE inline void combine2_scaled(C* __restrict acc, const C* __restrict a, const C* __restrict b, C factor,
                                           std::size_t n) noexcept {
  const std::size_t whole = n - n % lanes;
  for (std::size_t i = 0; i < whole; i += lanes) {
    for (std::size_t j = 0; j < lanes; ++j) acc[i + j] = apply<Op>(C(a[i + j] * factor), C(b[i + j] * factor));
  }
  for (std::size_t i = whole; i < n; ++i) acc[i] = apply<Op>(C(a[i] * factor), C(b[i] * factor));
}

/// acc = acc op (in * factor), the product rounded to C first.
template <reduce_op Op, class C>
DDP_SHM_INLINE inline void combine_scaled(C* __restrict acc, const C* __restrict in, C factor, std::size_t n) noexcept {
  const std::size_t whole = n - n % lanes;
  for (std::size_t i = 0; i < whole; i += lanes) {
    for (std::size_t j = 0; j < lanes; ++j) acc[i + j] = apply<Op>(acc[i + j], C(in[i + j] * factor));
  }
  for (std::size_t i = whole; i < n; ++i) acc[i] = apply<Op>(acc[i], C(in[i] * factor));
}

/// acc /= divisor: floating point divides (no reciprocal: the same rounding as everywhere else
/// in ddp); integers truncate toward zero.
template <class C>
DDP_SHM_INLINE inline void divide(C* __restrict acc, std::size_t n, std::int64_t divisor) noexcept {
  if constexpr (std::is_floating_point_v<C>) {
    const C d = static_cast<C>(divisor);
    const std::size_t whole = n - n % lanes;
    for (std::size_t i = 0; i < whole; i += lanes) {
      for (std::size_t j = 0; j < lanes; ++j) acc[i + j] = acc[i + j] / d;
    }
    for (std::size_t i = whole; i < n; ++i) acc[i] = acc[i] / d;
  } else {
    for (std::size_t i = 0; i < n; ++i) acc[i] = static_cast<C>(static_cast<std::int64_t>(acc[i]) / divisor);
  }
}

/// out = in * factor, rounded to T (the bits of ddp::detail::scaled_copy: floats multiply in their
/// own type, f16/bf16 in f32 and round once).
template <class T>
DDP_SHM_INLINE inline void scale_block(T* __restrict out, const T* __restrict in, std::size_t n,
                                       double factor) noexcept {
  const std::size_t whole = n - n % lanes;
  if constexpr (is_half_like<T>) {
    const float f = static_cast<float>(factor);
    auto* o = reinterpret_cast<std::uint16_t*>(out);
    const auto* h = reinterpret_cast<const std::uint16_t*>(in);
    for (std::size_t i = 0; i < whole; i += lanes) {
      for (std::size_t j = 0; j < lanes; ++j) o[i + j] = from_float<T>(to_float<T>(h[i + j]) * f);
    }
    for (std::size_t i = whole; i < n; ++i) o[i] = from_float<T>(to_float<T>(h[i]) * f);
  } else {
    const T f = static_cast<T>(factor);
    for (std::size_t i = 0; i < whole; i += lanes) {
      for (std::size_t j = 0; j < lanes; ++j) out[i + j] = in[i + j] * f;
    }
    for (std::size_t i = whole; i < n; ++i) out[i] = in[i] * f;
  }
}

/// Whether a product and the sum after it may share one loop. Not where the compiler may change
/// their rounding: fuse them into one multiply-add where the target has FMA (GCC contracts across
/// statements, clang with -ffp-contract=fast; `__FMA__` on x86 with -march=native or -mfma,
/// `__FP_FAST_FMA*` / `__ARM_FEATURE_FMA` on AArch64), reassociate them (-ffast-math), or keep
/// the products in extended precision (x87, `__FLT_EVAL_METHOD__` != 0). The pass through L1 is
/// kept there: its products are stored, so they are rounded. The AVX2 entry point below enables
/// no FMA, so it never contracts.
#if defined(__FP_FAST_FMA) || defined(__FP_FAST_FMAF) || defined(__FMA__) || defined(__ARM_FEATURE_FMA) || \
    defined(__FAST_MATH__) || (defined(__FLT_EVAL_METHOD__) && __FLT_EVAL_METHOD__ != 0)
inline constexpr bool fused_scaling = false;
#else
inline constexpr bool fused_scaling = true;
#endif

template <class T, reduce_op Op>
DDP_SHM_INLINE inline void reduce_many_body(T* out, T* out2, const T* const* in, int k, std::size_t n,
                                            std::int64_t divisor, double factor) noexcept {
  using C = compute_t<T>;
  constexpr bool floating = std::is_floating_point_v<T> || is_half_like<T>;
  alignas(64) C acc[kernel_block];
  alignas(64) C wide[is_half_like<T> ? kernel_block : 1];
  alignas(64) unsigned char scaled_bytes[floating ? kernel_block * sizeof(T) : 1];
  auto* scaled = reinterpret_cast<T*>(scaled_bytes);
  const bool scaling = floating && factor != 1.0;
  for (std::size_t b = 0; b < n; b += kernel_block) {
    const std::size_t m = std::min(kernel_block, n - b);
    // Input q of this block; multiplied by `factor` in L1 first when scaling (a pre-multiplied
    // sum: each product rounded to T, then summed, the bits of scaling in place and summing).
    const auto input = [&](int q) -> const T* {
      if constexpr (floating) {
        if (scaling) {
          scale_block(scaled, in[q] + b, m, factor);
          return scaled;
        }
      }
      return in[q] + b;
    };
    if constexpr (is_half_like<T>) {
      widen(acc, input(0), m);
      for (int q = 1; q < k; ++q) {
        widen(wide, input(q), m);
        combine<Op>(acc, wide, m);
      }
    } else if (fused_scaling && scaling) {
      // One pass per input (products rounded to T, then reduced): f32 pre-multiplied sums at the
      // speed of plain sums (measured: the staged form below cost 19% on 2 ranks).
      if constexpr (floating) {  // integers never scale
        const T f = static_cast<T>(factor);
        if (k == 1) {
          scale_block(acc, in[0] + b, m, factor);
        } else {
          combine2_scaled<Op>(acc, in[0] + b, in[1] + b, f, m);
          for (int q = 2; q < k; ++q) combine_scaled<Op>(acc, in[q] + b, f, m);
        }
      }
    } else if (k == 1 || scaling) {
      std::memcpy(acc, input(0), m * sizeof(T));
      for (int q = 1; q < k; ++q) combine<Op>(acc, input(q), m);
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

template <class T, reduce_op Op>
void reduce_many_baseline(T* out, T* out2, const T* const* in, int k, std::size_t n, std::int64_t divisor,
                          double factor) noexcept {
  reduce_many_body<T, Op>(out, out2, in, k, n, divisor, factor);
}

#if DDP_SHM_X86_DISPATCH
// The same loops compiled for AVX2: 32-byte vectors, and conversions twice as wide (f16/bf16
// about 2x faster, f32 about 15% in L2). Chosen at run time, so the library needs no -mavx2.
template <class T, reduce_op Op>
[[gnu::target("avx2")]] void reduce_many_avx2(T* out, T* out2, const T* const* in, int k, std::size_t n,
                                              std::int64_t divisor, double factor) noexcept {
  reduce_many_body<T, Op>(out, out2, in, k, n, divisor, factor);
}

[[nodiscard]] inline bool have_avx2() noexcept {
  static const bool yes = __builtin_cpu_supports("avx2") != 0;
  return yes;
}
#endif

template <class T, reduce_op Op>
void reduce_many_typed(T* out, T* out2, const T* const* in, int k, std::size_t n, std::int64_t divisor,
                       double factor) noexcept {
#if DDP_SHM_X86_DISPATCH
  if (have_avx2()) {
    reduce_many_avx2<T, Op>(out, out2, in, k, n, divisor, factor);
    return;
  }
#endif
  reduce_many_baseline<T, Op>(out, out2, in, k, n, divisor, factor);
}

/// out[i] = in[0][i] op in[1][i] op ... op in[k-1][i], left to right, for i < n; then divided by
/// `divisor` if it exceeds 1 (for `avg`, pass the number of contributing ranks; the sum is the
/// operator then). `out` may equal any `in[q]`; other overlaps are not allowed. `out2`, if not
/// null, receives the same bits (written from the block still in L1). `factor` != 1: every input
/// is read multiplied by it, each product rounded to the dtype (a pre-multiplied sum; floating
/// dtypes only, integers ignore it).
inline void reduce_many(dtype t, reduce_op op, void* out, void* out2, const void* const* in, int k, std::size_t n,
                        std::int64_t divisor, double factor = 1.0) noexcept {
  if (n == 0 || k <= 0) return;
  ddp::detail::visit_dtype(t, [&]<class T>(T) {
    auto* o = static_cast<T*>(out);
    auto* o2 = static_cast<T*>(out2);
    const auto* const* i = reinterpret_cast<const T* const*>(in);
    switch (op) {
      case reduce_op::sum: reduce_many_typed<T, reduce_op::sum>(o, o2, i, k, n, 1, factor); break;
      case reduce_op::avg: reduce_many_typed<T, reduce_op::sum>(o, o2, i, k, n, divisor, factor); break;
      case reduce_op::prod: reduce_many_typed<T, reduce_op::prod>(o, o2, i, k, n, 1, factor); break;
      case reduce_op::min: reduce_many_typed<T, reduce_op::min>(o, o2, i, k, n, 1, factor); break;
      case reduce_op::max: reduce_many_typed<T, reduce_op::max>(o, o2, i, k, n, 1, factor); break;
    }
  });
}

}  // namespace ddp::shm::detail

#undef DDP_SHM_INLINE
#undef DDP_SHM_X86_DISPATCH
