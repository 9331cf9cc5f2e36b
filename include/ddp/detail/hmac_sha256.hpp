#pragma once
/// @file detail/hmac_sha256.hpp
/// @brief SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for proving a job secret over a
/// connection (docs/security.md): a thin RAII layer over OpenSSL's libcrypto (3.0 or later:
/// `EVP_MD_CTX` with `EVP_sha256()`, the `EVP_MAC` "HMAC", `CRYPTO_memcmp`), so the primitives
/// are a vetted, maintained implementation rather than ddp's own. Every target whose headers
/// include this one links `OpenSSL::Crypto` (ddp::ddp does, so every backend does). The test
/// (tests/unit/hmac_sha256_test.cpp) checks the FIPS 180-4 and RFC 4231 vectors.
///
/// Errors: OpenSSL's calls can fail (no memory, or a provider configuration, e.g. an
/// `OPENSSL_CONF` that loads no provider with SHA-256, or a FIPS provider in its error state),
/// so these functions are not noexcept: a failure throws `ddp::error` (rank -1) naming the call
/// and OpenSSL's error string, and clears this thread's OpenSSL error queue. Nothing here aborts;
/// a caller must not be noexcept either, or such a failure becomes std::terminate.

#include <array>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/params.h>

#include <ddp/error.hpp>

namespace ddp::detail {

/// A SHA-256 digest.
using sha256_digest = std::array<std::byte, 32>;

namespace openssl {

struct md_ctx_free {
  void operator()(EVP_MD_CTX* c) const noexcept { EVP_MD_CTX_free(c); }
};
struct mac_free {
  void operator()(EVP_MAC* m) const noexcept { EVP_MAC_free(m); }
};
struct mac_ctx_free {
  void operator()(EVP_MAC_CTX* c) const noexcept { EVP_MAC_CTX_free(c); }
};

/// Throws ddp::error for the failed libcrypto call `call` of `operation`, with the oldest error on
/// this thread's OpenSSL error queue (then clears the queue, so it cannot be blamed on a later
/// call of another OpenSSL user).
[[noreturn]] inline void fail(const char* operation, const char* call) {
  std::string message = std::string("OpenSSL libcrypto: ") + call + " failed";
  if (const unsigned long code = ERR_get_error(); code != 0) {
    std::array<char, 256> text{};
    ERR_error_string_n(code, text.data(), text.size());
    message += ": ";
    message += text.data();
  }
  ERR_clear_error();
  throw ddp::error(-1, operation, message);
}

[[nodiscard]] inline const unsigned char* bytes(std::span<const std::byte> s) noexcept {
  return reinterpret_cast<const unsigned char*>(s.data());
}

}  // namespace openssl

/// Incremental SHA-256 (an `EVP_MD_CTX` over `EVP_sha256()`). Copyable (the copy continues from
/// the same state) and movable; a moved-from object may only be assigned to or destroyed.
class sha256 {
 public:
  /// @throws ddp::error if OpenSSL cannot allocate or initialise the context
  sha256() : ctx_(EVP_MD_CTX_new()) {
    if (!ctx_) openssl::fail(operation, "EVP_MD_CTX_new");
    if (EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr) != 1) openssl::fail(operation, "EVP_DigestInit_ex");
  }
  sha256(const sha256& other) : ctx_(EVP_MD_CTX_new()) {
    if (!ctx_) openssl::fail(operation, "EVP_MD_CTX_new");
    if (EVP_MD_CTX_copy_ex(ctx_.get(), other.ctx_.get()) != 1) openssl::fail(operation, "EVP_MD_CTX_copy_ex");
  }
  sha256& operator=(const sha256& other) {
    if (this != &other) {
      sha256 copy(other);
      ctx_ = std::move(copy.ctx_);
    }
    return *this;
  }
  sha256(sha256&&) noexcept = default;
  sha256& operator=(sha256&&) noexcept = default;
  ~sha256() = default;

  /// Hashes `data` into the state (call any number of times).
  /// @throws ddp::error if OpenSSL fails
  void update(std::span<const std::byte> data) {
    if (data.empty()) return;
    if (EVP_DigestUpdate(ctx_.get(), data.data(), data.size()) != 1) openssl::fail(operation, "EVP_DigestUpdate");
  }

  /// The digest of everything hashed; the object must not be used afterwards.
  /// @throws ddp::error if OpenSSL fails
  [[nodiscard]] sha256_digest finish() {
    sha256_digest out{};
    unsigned int length = 0;
    if (EVP_DigestFinal_ex(ctx_.get(), reinterpret_cast<unsigned char*>(out.data()), &length) != 1) {
      openssl::fail(operation, "EVP_DigestFinal_ex");
    }
    if (length != out.size()) {
      throw ddp::error(-1, operation,
                       "OpenSSL libcrypto: EVP_DigestFinal_ex gave " + std::to_string(length) + " bytes, not 32");
    }
    return out;
  }

 private:
  static constexpr const char* operation = "SHA-256";
  std::unique_ptr<EVP_MD_CTX, openssl::md_ctx_free> ctx_;
};

/// HMAC-SHA256 of the concatenation of `parts` under `key` (OpenSSL's `EVP_MAC` "HMAC"; any key
/// length, an empty one included; a key longer than the 64-byte block is hashed first, as
/// RFC 2104 says).
/// @throws ddp::error if OpenSSL fails
[[nodiscard]] inline sha256_digest hmac_sha256(std::span<const std::byte> key,
                                               std::span<const std::span<const std::byte>> parts) {
  static constexpr const char* operation = "HMAC-SHA256";
  const std::unique_ptr<EVP_MAC, openssl::mac_free> mac(EVP_MAC_fetch(nullptr, OSSL_MAC_NAME_HMAC, nullptr));
  if (!mac) openssl::fail(operation, "EVP_MAC_fetch(HMAC)");
  const std::unique_ptr<EVP_MAC_CTX, openssl::mac_ctx_free> ctx(EVP_MAC_CTX_new(mac.get()));
  if (!ctx) openssl::fail(operation, "EVP_MAC_CTX_new");
  char digest[] = "SHA256";
  const std::array<OSSL_PARAM, 2> params{OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                                         OSSL_PARAM_construct_end()};
  // A null key pointer means "keep the key already set" to EVP_MAC_init, and there is none yet:
  // an empty key is passed as a non-null pointer with length 0.
  static constexpr unsigned char no_key = 0;
  const unsigned char* key_bytes = key.empty() ? &no_key : openssl::bytes(key);
  if (EVP_MAC_init(ctx.get(), key_bytes, key.size(), params.data()) != 1) openssl::fail(operation, "EVP_MAC_init");
  for (const auto part : parts) {
    if (part.empty()) continue;
    if (EVP_MAC_update(ctx.get(), openssl::bytes(part), part.size()) != 1) openssl::fail(operation, "EVP_MAC_update");
  }
  sha256_digest out{};
  std::size_t length = 0;
  if (EVP_MAC_final(ctx.get(), reinterpret_cast<unsigned char*>(out.data()), &length, out.size()) != 1) {
    openssl::fail(operation, "EVP_MAC_final");
  }
  if (length != out.size()) {
    throw ddp::error(-1, operation,
                     "OpenSSL libcrypto: EVP_MAC_final gave " + std::to_string(length) + " bytes, not 32");
  }
  return out;
}

/// True when `a` and `b` are equal, in a time that does not depend on where they differ
/// (`CRYPTO_memcmp`; the sizes are compared first, and are not secret).
[[nodiscard]] inline bool constant_time_equal(std::span<const std::byte> a, std::span<const std::byte> b) noexcept {
  if (a.size() != b.size()) return false;
  if (a.empty()) return true;
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace ddp::detail
