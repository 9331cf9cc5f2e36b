#pragma once
/// @file detail/peer_proof.hpp
/// @brief The proof two peers of one communicator exchange to show they hold the job's secret,
/// bound to that communicator instance, shared by gloo pairs (gloo/authenticate.hpp) and
/// `net::ring` (net/ring.hpp). The protocol and why each input is there: docs/security.md,
/// "Pair authentication".
///
/// - The **binding** names one communicator instance: a hash of the protocol, the
///   communicator's name (gloo's key prefix), its size and every member's fresh 32-byte nonce,
///   which each member publishes before it connects. Two communicators never share one, even of
///   the same size under one secret, so a proof relayed from one to the other is refused.
/// - The **proof** is HMAC-SHA256 under the secret of (label, binding, sender, receiver, the
///   sender's connection nonce, the receiver's connection nonce): naming both ranks stops a
///   reflection, fresh connection nonces stop a replay.
/// - The **order**: one side of each connection proves first and the other verifies that proof
///   before it sends anything derived from the secret, so a stranger cannot use a member as an
///   oracle for proofs it could relay.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include <ddp/detail/hmac_sha256.hpp>
#include <ddp/job_secret.hpp>

namespace ddp::detail {

/// A member's or a connection's fresh random nonce.
using proof_nonce = std::array<std::byte, 32>;

/// A fresh nonce from the kernel.
[[nodiscard]] inline proof_nonce fresh_nonce() {
  proof_nonce n{};
  job_secret::fill_random(n);
  return n;
}

/// The communicator instance every proof of it is bound to (see the file comment). `nonces`:
/// every member's published nonce, in rank order. @throws ddp::error if libcrypto fails
[[nodiscard]] inline sha256_digest communicator_binding(std::string_view protocol, std::string_view name, int size,
                                                        std::span<const proof_nonce> nonces) {
  sha256 h;
  const auto field = [&h](std::span<const std::byte> bytes) {
    const std::uint64_t n = bytes.size();  // length-prefixed: no two field lists hash alike
    h.update(std::as_bytes(std::span(&n, 1)));
    h.update(bytes);
  };
  field(std::as_bytes(std::span(protocol)));
  field(std::as_bytes(std::span(name)));
  const std::int64_t members = size;
  field(std::as_bytes(std::span(&members, 1)));
  for (const auto& n : nonces) field(n);
  return h.finish();
}

/// The proof `sender` sends `receiver` on one connection of the communicator `binding` names.
/// @throws ddp::error if libcrypto fails
[[nodiscard]] inline sha256_digest peer_proof(const job_secret& secret, const sha256_digest& binding, int sender,
                                              int receiver, const proof_nonce& sender_nonce,
                                              const proof_nonce& receiver_nonce) {
  static constexpr std::string_view label = "ddp peer proof v2";
  const std::array<std::int32_t, 2> ranks{sender, receiver};
  const std::array<std::span<const std::byte>, 5> parts{std::as_bytes(std::span(label)), binding,
                                                        std::as_bytes(std::span(ranks)), sender_nonce, receiver_nonce};
  return hmac_sha256(secret.bytes(), parts);
}

/// Whether `self` proves first on its connection with `peer` (the higher rank does; the lower
/// verifies that proof before it sends its own).
[[nodiscard]] constexpr bool proves_first(int self, int peer) noexcept { return self > peer; }

}  // namespace ddp::detail
