#pragma once
/// @file stores/codec.hpp
/// @brief Checks and framing shared by the stores: key validation, value-size limits, and the
/// self-describing frame every stored value is wrapped in.
///
/// A store is shared with other processes, other jobs and whoever else can write to the
/// directory or the Redis server, so what comes back from it is checked like network input.
/// Frame layout (little endian): magic "ddpv", version 1, 3 zero bytes, payload length (u64),
/// FNV-1a 64 checksum of the payload (u64), payload. A torn write, a truncated file, a value
/// someone else put under our key or a flipped bit then fails loudly instead of being parsed
/// as an address.

#include <array>
#include <charconv>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/detail/fnv1a.hpp>
#include <ddp/error.hpp>
#include <ddp/store.hpp>

namespace ddp::stores::detail {

inline constexpr std::size_t frame_header_bytes = 24;
inline constexpr std::array<unsigned char, 4> frame_magic{'d', 'd', 'p', 'v'};
inline constexpr unsigned char frame_version = 1;

[[nodiscard]] inline bool is_key_char(char c) noexcept {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.' ||
         c == ':' || c == '/' || c == '@' || c == '-';
}

/// True if `key` is a valid key: 1..max_key_bytes bytes of [A-Za-z0-9_.:/@-]. For keys (member
/// ids, ...) read back from a store, where a bad one is malformed data, not a usage error.
[[nodiscard]] inline bool is_valid_key(std::string_view key) noexcept {
  if (key.empty() || key.size() > max_key_bytes) return false;
  for (char c : key) {
    if (!is_key_char(c)) return false;
  }
  return true;
}

/// The integer whose canonical decimal form (what std::to_string writes) is `text`, or nothing:
/// digits with a '-' for negative values, no '+', no spaces, no leading zeros ("-0" neither), in
/// range of T. Numbers read back from a store are parsed with this: decode(encode(x)) == x and
/// nothing else decodes, so a value that is not what a ddp process wrote is malformed.
template <std::integral T>
[[nodiscard]] std::optional<T> parse_decimal(std::string_view text) noexcept {
  if (text.empty()) return std::nullopt;
  const std::size_t first_digit = text[0] == '-' ? 1 : 0;
  if (text.size() > first_digit + 1 && text[first_digit] == '0') return std::nullopt;  // leading zero
  if (text == "-0") return std::nullopt;
  T v{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc{} || end != text.data() + text.size()) return std::nullopt;
  return v;
}

/// Throws usage_error unless `key` is a valid key (or a valid prefix: `allow_empty`).
inline void check_key(std::string_view key, std::string_view operation, bool allow_empty = false) {
  if (key.empty() && !allow_empty) throw usage_error(-1, std::string(operation), "empty key");
  if (key.size() > max_key_bytes) {
    throw usage_error(-1, std::string(operation),
                      "key of " + std::to_string(key.size()) + " bytes is longer than " +
                          std::to_string(max_key_bytes) + ": '" + std::string(key.substr(0, 40)) + "...'");
  }
  for (char c : key) {
    if (!is_key_char(c)) {
      throw usage_error(-1, std::string(operation),
                        "key '" + std::string(key) + "' contains a character outside [A-Za-z0-9_.:/@-] (byte " +
                            std::to_string(static_cast<unsigned char>(c)) + ")");
    }
  }
}

/// Throws usage_error if a value to store is over the limit.
inline void check_value_size(std::string_view key, std::size_t bytes, std::size_t limit) {
  if (bytes > limit) {
    throw usage_error(-1, "store set '" + std::string(key) + "'",
                      "value of " + std::to_string(bytes) + " bytes is larger than the store's limit of " +
                          std::to_string(limit) + " bytes");
  }
}

inline void put_u64(std::byte* p, std::uint64_t v) noexcept {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xffu);
}
[[nodiscard]] inline std::uint64_t get_u64(const std::byte* p) noexcept {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return v;
}

/// The framed bytes stored for `payload`.
[[nodiscard]] inline std::vector<std::byte> encode_frame(std::span<const std::byte> payload) {
  std::vector<std::byte> out(frame_header_bytes + payload.size());
  std::memcpy(out.data(), frame_magic.data(), frame_magic.size());
  out[4] = static_cast<std::byte>(frame_version);
  put_u64(out.data() + 8, payload.size());
  put_u64(out.data() + 16, ddp::detail::fnv1a(payload));
  if (!payload.empty()) std::memcpy(out.data() + frame_header_bytes, payload.data(), payload.size());
  return out;
}

/// Largest framed size a value under `limit` can have: anything bigger is rejected unread.
[[nodiscard]] constexpr std::size_t max_frame_bytes(std::size_t limit) noexcept { return limit + frame_header_bytes; }

/// The payload of framed bytes read back for `key` from `where` ("file store /dir", "redis host:port").
/// @throws communication_error naming the key and what is wrong with the bytes
[[nodiscard]] inline store_value decode_frame(std::span<const std::byte> raw, std::string_view key, std::size_t limit,
                                              std::string_view where) {
  const auto fail = [&](const std::string& what) {
    return communication_error(-1, "store get '" + std::string(key) + "'",
                               "malformed value in " + std::string(where) + ": " + what);
  };
  if (raw.size() < frame_header_bytes) {
    throw fail("truncated: " + std::to_string(raw.size()) + " bytes, shorter than the " +
               std::to_string(frame_header_bytes) + "-byte header");
  }
  if (std::memcmp(raw.data(), frame_magic.data(), frame_magic.size()) != 0) {
    throw fail("not written by a ddp store (bad magic)");
  }
  if (static_cast<unsigned char>(raw[4]) != frame_version) {
    throw fail("unknown format version " + std::to_string(static_cast<unsigned>(raw[4])));
  }
  // Reserved: zero in version 1, so that every accepted frame is exactly what encode_frame writes.
  if (raw[5] != std::byte{0} || raw[6] != std::byte{0} || raw[7] != std::byte{0}) {
    throw fail("reserved header bytes 5-7 are not zero");
  }
  const std::uint64_t length = get_u64(raw.data() + 8);
  if (length > limit) {
    throw fail("header announces " + std::to_string(length) + " bytes, more than the limit of " +
               std::to_string(limit));
  }
  const std::size_t have = raw.size() - frame_header_bytes;
  if (length != have) {
    throw fail((have < length ? "truncated: header announces " : "trailing bytes: header announces ") +
               std::to_string(length) + " bytes, found " + std::to_string(have));
  }
  const auto payload = raw.subspan(frame_header_bytes);
  if (get_u64(raw.data() + 16) != ddp::detail::fnv1a(payload)) throw fail("checksum mismatch (corrupt or torn write)");
  return {payload.begin(), payload.end()};
}

/// Counter values are stored framed too: 8 bytes, little endian.
[[nodiscard]] inline std::vector<std::byte> encode_counter(std::int64_t v) {
  std::array<std::byte, 8> b{};
  put_u64(b.data(), static_cast<std::uint64_t>(v));
  return encode_frame(b);
}
[[nodiscard]] inline std::int64_t decode_counter(std::span<const std::byte> raw, std::string_view key,
                                                 std::string_view where) {
  const store_value v = decode_frame(raw, key, 8, where);
  if (v.size() != 8) {
    throw communication_error(
        -1, "store add '" + std::string(key) + "'",
        "malformed counter in " + std::string(where) + ": " + std::to_string(v.size()) + " bytes instead of 8");
  }
  return static_cast<std::int64_t>(get_u64(v.data()));
}

/// "a, b, c" of at most `max` keys, for error messages.
[[nodiscard]] inline std::string list_keys(std::span<const std::string> keys, std::size_t max = 8) {
  std::string s;
  for (std::size_t i = 0; i < keys.size() && i < max; ++i) s += (i ? ", '" : "'") + keys[i] + "'";
  if (keys.size() > max) s += ", ... (" + std::to_string(keys.size()) + " keys)";
  return s;
}

}  // namespace ddp::stores::detail
