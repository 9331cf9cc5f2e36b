#pragma once
/// @file detail/hmac_sha256.hpp
/// @brief SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for proving a job secret over a
/// connection (docs/security.md). Kept here rather than taken from OpenSSL so that a consumer of
/// `ddp::gloo` needs no further library; the test checks FIPS and RFC 4231 vectors and random
/// inputs against Python's hashlib/hmac. No data-dependent branches or table lookups: the time
/// taken depends on lengths only.

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>

namespace ddp::detail {

/// A SHA-256 digest.
using sha256_digest = std::array<std::byte, 32>;

/// Incremental SHA-256.
class sha256 {
 public:
  /// Hashes `data` into the state (call any number of times).
  void update(std::span<const std::byte> data) noexcept {
    for (std::byte b : data) {
      block_[fill_++] = static_cast<std::uint8_t>(b);
      if (fill_ == block_.size()) {
        compress();
        fill_ = 0;
      }
    }
    length_ += data.size();
  }

  /// The digest of everything hashed; the object must not be used afterwards.
  [[nodiscard]] sha256_digest finish() noexcept {
    const std::uint64_t bits = length_ * 8;
    const std::array<std::byte, 1> one{std::byte{0x80}};
    update(one);
    const std::array<std::byte, 1> zero{};
    while (fill_ != 56) update(zero);
    std::array<std::byte, 8> len{};
    for (int i = 0; i < 8; ++i) len[static_cast<std::size_t>(i)] = static_cast<std::byte>(bits >> (56 - 8 * i));
    update(len);
    sha256_digest out{};
    for (std::size_t i = 0; i < 8; ++i) {
      for (std::size_t j = 0; j < 4; ++j) out[4 * i + j] = static_cast<std::byte>(h_[i] >> (24 - 8 * j));
    }
    return out;
  }

 private:
  void compress() noexcept {
    static constexpr std::array<std::uint32_t, 64> k{
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
        0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
        0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
        0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
        0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
        0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
        0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
    std::array<std::uint32_t, 64> w{};
    for (std::size_t i = 0; i < 16; ++i) {
      w[i] = (std::uint32_t{block_[4 * i]} << 24) | (std::uint32_t{block_[4 * i + 1]} << 16) |
             (std::uint32_t{block_[4 * i + 2]} << 8) | std::uint32_t{block_[4 * i + 3]};
    }
    for (std::size_t i = 16; i < 64; ++i) {
      const std::uint32_t s0 = std::rotr(w[i - 15], 7) ^ std::rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      const std::uint32_t s1 = std::rotr(w[i - 2], 17) ^ std::rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    std::uint32_t a = h_[0], b = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6], h = h_[7];
    for (std::size_t i = 0; i < 64; ++i) {
      const std::uint32_t t1 =
          h + (std::rotr(e, 6) ^ std::rotr(e, 11) ^ std::rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
      const std::uint32_t t2 = (std::rotr(a, 2) ^ std::rotr(a, 13) ^ std::rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    h_[0] += a;
    h_[1] += b;
    h_[2] += c;
    h_[3] += d;
    h_[4] += e;
    h_[5] += f;
    h_[6] += g;
    h_[7] += h;
  }

  std::array<std::uint32_t, 8> h_{0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                  0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  std::array<std::uint8_t, 64> block_{};
  std::size_t fill_ = 0;
  std::uint64_t length_ = 0;
};

/// HMAC-SHA256 of the concatenation of `parts` under `key`.
[[nodiscard]] inline sha256_digest hmac_sha256(std::span<const std::byte> key,
                                               std::span<const std::span<const std::byte>> parts) noexcept {
  std::array<std::byte, 64> block{};
  if (key.size() > block.size()) {
    sha256 kh;
    kh.update(key);
    const auto d = kh.finish();
    for (std::size_t i = 0; i < d.size(); ++i) block[i] = d[i];
  } else {
    for (std::size_t i = 0; i < key.size(); ++i) block[i] = key[i];
  }
  std::array<std::byte, 64> pad{};
  for (std::size_t i = 0; i < pad.size(); ++i) pad[i] = block[i] ^ std::byte{0x36};
  sha256 inner;
  inner.update(pad);
  for (auto p : parts) inner.update(p);
  const auto inner_digest = inner.finish();
  for (std::size_t i = 0; i < pad.size(); ++i) pad[i] = block[i] ^ std::byte{0x5c};
  sha256 outer;
  outer.update(pad);
  outer.update(inner_digest);
  return outer.finish();
}

/// True when `a` and `b` are equal, in a time that does not depend on where they differ.
[[nodiscard]] inline bool constant_time_equal(std::span<const std::byte> a, std::span<const std::byte> b) noexcept {
  if (a.size() != b.size()) return false;
  std::byte diff{0};
  for (std::size_t i = 0; i < a.size(); ++i) diff |= a[i] ^ b[i];
  return diff == std::byte{0};
}

}  // namespace ddp::detail
