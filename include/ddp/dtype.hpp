#pragma once
/// @file dtype.hpp
/// @brief Element types the library moves and reduces, and the 2-byte float storage types.

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <string_view>
#include <type_traits>

namespace ddp {

/// Element type of a tensor. f16 and bf16 are storage formats; host reductions accumulate them in f32.
enum class dtype : std::uint8_t { f16, bf16, f32, f64, i8, u8, i32, i64 };

/// Every dtype, in enumerator order: `all_dtypes[i]` is the dtype whose value is `i`. For loops
/// over every dtype and for tables indexed by `static_cast<std::size_t>(type)`.
inline constexpr std::array all_dtypes{dtype::f16, dtype::bf16, dtype::f32, dtype::f64,
                                       dtype::i8,  dtype::u8,   dtype::i32, dtype::i64};

/// Number of dtypes: the size of a table indexed by dtype.
inline constexpr std::size_t dtype_count = all_dtypes.size();

/// Bytes per element.
[[nodiscard]] constexpr std::size_t size_of(dtype t) noexcept {
  switch (t) {
    case dtype::i8:
    case dtype::u8: return 1;
    case dtype::f16:
    case dtype::bf16: return 2;
    case dtype::f32:
    case dtype::i32: return 4;
    case dtype::f64:
    case dtype::i64: return 8;
  }
  return 0;
}

/// Short name of `t` ("f32", "bf16", ...), as used in error messages; "?" if out of range.
[[nodiscard]] constexpr std::string_view name_of(dtype t) noexcept {
  switch (t) {
    case dtype::f16: return "f16";
    case dtype::bf16: return "bf16";
    case dtype::f32: return "f32";
    case dtype::f64: return "f64";
    case dtype::i8: return "i8";
    case dtype::u8: return "u8";
    case dtype::i32: return "i32";
    case dtype::i64: return "i64";
  }
  return "?";
}

namespace detail {
/// `all_dtypes` lists the enumerators in order, without gaps.
[[nodiscard]] constexpr bool dtypes_in_enumerator_order() noexcept {
  for (std::size_t i = 0; i < dtype_count; ++i) {
    if (static_cast<std::size_t>(all_dtypes[i]) != i) return false;
  }
  return true;
}
}  // namespace detail

static_assert(detail::dtypes_in_enumerator_order(), "all_dtypes must list every dtype in enumerator order");
// A new enumerator must be named in name_of (-Wswitch says so); then this fails until it is
// appended to all_dtypes too.
static_assert(name_of(static_cast<dtype>(dtype_count)) == "?", "all_dtypes misses a dtype");

/// True for f16, bf16, f32 and f64.
[[nodiscard]] constexpr bool is_floating(dtype t) noexcept {
  return t == dtype::f16 || t == dtype::bf16 || t == dtype::f32 || t == dtype::f64;
}

/// Writes `name_of(t)`.
inline std::ostream& operator<<(std::ostream& os, dtype t) { return os << name_of(t); }

/// IEEE 754 binary16 storage type. Arithmetic goes through float.
struct half {
  std::uint16_t bits = 0;  ///< raw binary16 encoding

  half() = default;
  /// `f` rounded to nearest even; out of range becomes infinity.
  explicit half(float f) noexcept : bits(from_float(f)) {}
  /// Exact conversion (every half is a float).
  explicit operator float() const noexcept { return to_float(bits); }
  /// Bitwise equality: +0 and -0 differ, a NaN equals itself.
  friend bool operator==(half a, half b) noexcept { return a.bits == b.bits; }

  /// binary16 encoding of `f`: round to nearest even, overflow to infinity, NaN stays (quiet) NaN.
  static std::uint16_t from_float(float f) noexcept {
    const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
    const std::uint32_t sign = (x >> 16) & 0x8000u;
    const std::uint32_t abs = x & 0x7fffffffu;
    if (abs >= 0x47800000u) {  // too large for half: inf, or quiet nan
      return static_cast<std::uint16_t>(sign | (abs > 0x7f800000u ? 0x7e00u : 0x7c00u));
    }
    if (abs < 0x38800000u) {  // subnormal or zero in half: round to nearest even via float add
      const float magic = std::bit_cast<float>(0x3f000000u);  // 0.5, aligns mantissa to 2^-24 steps
      const float shifted = std::bit_cast<float>(abs) + magic;
      return static_cast<std::uint16_t>(sign | (std::bit_cast<std::uint32_t>(shifted) - 0x3f000000u));
    }
    // normal: rebias exponent and round to nearest even
    const std::uint32_t mant_odd = (abs >> 13) & 1u;
    std::uint32_t v = abs + 0xc8000fffu + mant_odd;  // -(127-15)<<23 plus rounding bias
    return static_cast<std::uint16_t>(sign | (v >> 13));
  }

  /// Exact float value of the binary16 encoding `h` (subnormals, infinities and NaN included).
  static float to_float(std::uint16_t h) noexcept {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    const std::uint32_t exp = (h >> 10) & 0x1fu;
    const std::uint32_t mant = h & 0x3ffu;
    if (exp == 0) {                                                     // zero or subnormal
      const float f = static_cast<float>(mant) * (1.0f / 16777216.0f);  // mant * 2^-24
      return std::bit_cast<float>(std::bit_cast<std::uint32_t>(f) | sign);
    }
    if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
    return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
  }
};

/// bfloat16 storage type (upper half of an IEEE float). Arithmetic goes through float.
struct bfloat16 {
  std::uint16_t bits = 0;  ///< raw encoding: the upper 16 bits of the float

  bfloat16() = default;
  /// `f` rounded to nearest even.
  explicit bfloat16(float f) noexcept : bits(from_float(f)) {}
  /// Exact conversion (every bfloat16 is a float).
  explicit operator float() const noexcept { return to_float(bits); }
  /// Bitwise equality: +0 and -0 differ, a NaN equals itself.
  friend bool operator==(bfloat16 a, bfloat16 b) noexcept { return a.bits == b.bits; }

  /// bfloat16 encoding of `f`: round to nearest even; NaN stays a (quiet) NaN.
  static std::uint16_t from_float(float f) noexcept {
    std::uint32_t x = std::bit_cast<std::uint32_t>(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);  // quiet nan
    x += 0x7fffu + ((x >> 16) & 1u);                                                            // round to nearest even
    return static_cast<std::uint16_t>(x >> 16);
  }
  /// Float value of the encoding `b` (exact: the low mantissa bits are zero).
  static float to_float(std::uint16_t b) noexcept { return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16); }
};

/// Maps a C++ element type to its dtype; `dtype_of<T>::value` exists only for supported types.
template <class T>
struct dtype_of {};
template <>
struct dtype_of<half> : std::integral_constant<dtype, dtype::f16> {};
template <>
struct dtype_of<bfloat16> : std::integral_constant<dtype, dtype::bf16> {};
template <>
struct dtype_of<float> : std::integral_constant<dtype, dtype::f32> {};
template <>
struct dtype_of<double> : std::integral_constant<dtype, dtype::f64> {};
template <>
struct dtype_of<std::int8_t> : std::integral_constant<dtype, dtype::i8> {};
template <>
struct dtype_of<std::uint8_t> : std::integral_constant<dtype, dtype::u8> {};
template <>
struct dtype_of<std::int32_t> : std::integral_constant<dtype, dtype::i32> {};
template <>
struct dtype_of<std::int64_t> : std::integral_constant<dtype, dtype::i64> {};

/// True for element types with a dtype. `long long` on LP64 is a distinct type from int64_t
/// (`long`); it maps too, so `std::vector<long long>` works out of the box.
template <class T>
concept element = requires {
  dtype_of<std::remove_cv_t<T>>::value;
};

template <class T>
requires(std::is_same_v<T, long long> && !std::is_same_v<long long, std::int64_t> &&
         sizeof(long long) == 8) struct dtype_of<T> : std::integral_constant<dtype, dtype::i64> {
};

/// The dtype of element type `T` (cv-qualifiers ignored): `dtype_v<float> == dtype::f32`.
template <element T>
inline constexpr dtype dtype_v = dtype_of<std::remove_cv_t<T>>::value;

}  // namespace ddp
