#pragma once
/// @file detail/fnv1a.hpp
/// @brief 64-bit FNV-1a, the hash ddp computes where the value must be the same in every process:
/// layout fingerprints compared across ranks, the stores' frame checksum (kept in files and Redis)
/// and the file store's file names, the host hash of timeline traces. Not the Manager's state
/// hash: that is XXH64 (manager/heal.hpp says why).
///
/// std::hash promises nothing across processes or library versions; FNV-1a is fixed by its
/// definition (offset basis 0xcbf29ce484222325, prime 0x100000001b3, one XOR and one multiply per
/// byte), so the values here must never change: `tests/unit/fnv1a_test.cpp` pins some.
///
/// Every function takes the hash to continue from (default: the offset basis, the hash of no
/// bytes), so `fnv1a(b, fnv1a(a))` is the hash of the bytes of `a` followed by those of `b`.

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>

namespace ddp::detail {

/// FNV-1a 64 offset basis: the hash of no bytes, where every hash starts.
inline constexpr std::uint64_t fnv1a_offset_basis = 0xcbf29ce484222325ull;
/// FNV-1a 64 prime: what each step multiplies by.
inline constexpr std::uint64_t fnv1a_prime = 0x100000001b3ull;

/// `h` continued by one byte.
[[nodiscard]] constexpr std::uint64_t fnv1a_byte(unsigned char byte, std::uint64_t h = fnv1a_offset_basis) noexcept {
  return (h ^ byte) * fnv1a_prime;
}

/// `h` continued by `bytes`, in order.
[[nodiscard]] constexpr std::uint64_t fnv1a(std::span<const std::byte> bytes,
                                            std::uint64_t h = fnv1a_offset_basis) noexcept {
  for (const std::byte b : bytes) h = fnv1a_byte(static_cast<unsigned char>(b), h);
  return h;
}

/// `h` continued by the characters of `text` (no terminator).
[[nodiscard]] constexpr std::uint64_t fnv1a(std::string_view text, std::uint64_t h = fnv1a_offset_basis) noexcept {
  for (const char c : text) h = fnv1a_byte(static_cast<unsigned char>(c), h);
  return h;
}

/// `h` continued by the 8 bytes of `value`, least significant first: the same on every machine,
/// whatever its byte order.
[[nodiscard]] constexpr std::uint64_t fnv1a_u64(std::uint64_t value, std::uint64_t h = fnv1a_offset_basis) noexcept {
  for (int i = 0; i < 8; ++i) h = fnv1a_byte(static_cast<unsigned char>((value >> (8 * i)) & 0xffu), h);
  return h;
}

/// `h` continued by the object representation of `value`, in this machine's byte order: equal
/// across processes of one machine type; use `fnv1a_u64` for integers that other machines hash.
/// Only for types without padding (whose bytes would be indeterminate) and floating types.
template <class T>
requires std::is_trivially_copyable_v<T> &&(std::has_unique_object_representations_v<T> || std::is_floating_point_v<T>)
    [[nodiscard]] constexpr std::uint64_t fnv1a_object(const T& value, std::uint64_t h = fnv1a_offset_basis) noexcept {
  const auto bytes = std::bit_cast<std::array<std::byte, sizeof(T)>>(value);
  return fnv1a(std::span<const std::byte>(bytes), h);
}

}  // namespace ddp::detail
