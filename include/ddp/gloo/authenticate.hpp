#pragma once
/// @file gloo/authenticate.hpp
/// @brief Every gloo pair proves the job's secret, both ways, right after connecting and before
/// any data moves: a process outside the job that connected first to a rank's port becomes a
/// clean error naming the pair, not a peer that reads or writes gradients.
///
/// The exchange (challenge-response, HMAC-SHA256; docs/security.md "gloo pairs"): each side
/// sends a fresh 32-byte nonce, then the HMAC under the secret of (label, key prefix, size,
/// sender, receiver, sender's nonce, receiver's nonce). Naming sender and receiver stops a
/// stranger from reflecting a rank's own answer back to it; fresh nonces stop replays.

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include <gloo/common/error.h>
#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <ddp/detail/hmac_sha256.hpp>
#include <ddp/error.hpp>
#include <ddp/job_secret.hpp>
#include <ddp/work.hpp>

namespace ddp::gloo::detail {

/// gloo slot prefix of the authentication exchange (gloo's collectives use 0x01 .. 0x08, ddp's
/// reduce-scatter 0x40).
inline constexpr std::uint8_t authenticate_slot_prefix = 0x41;

/// What the HMAC covers besides the nonces: the protocol, the communicator and the direction.
[[nodiscard]] inline ddp::detail::sha256_digest pair_proof(const job_secret& secret, std::string_view key_prefix,
                                                           int size, int sender, int receiver,
                                                           std::span<const std::byte> sender_nonce,
                                                           std::span<const std::byte> receiver_nonce) {
  static constexpr std::string_view label = "ddp gloo pair authentication v1";
  const std::array<std::int32_t, 3> ints{size, sender, receiver};
  const std::array<std::span<const std::byte>, 5> parts{std::as_bytes(std::span(label)),
                                                        std::as_bytes(std::span(key_prefix)),
                                                        std::as_bytes(std::span(ints)), sender_nonce, receiver_nonce};
  return ddp::detail::hmac_sha256(secret.bytes(), parts);
}

/// Runs the exchange with every peer of `ctx` (a no-op for an empty secret or one rank).
/// @throws communication_error naming the pair whose peer answered wrong or closed;
///         timeout_error naming the pair whose peer did not answer by `deadline`
inline void authenticate_pairs(::gloo::Context& ctx, const job_secret& secret, std::string_view key_prefix,
                               clock::time_point deadline) {
  const int rank = ctx.rank;
  const int size = ctx.size;
  if (secret.empty() || size < 2) return;
  using block = std::array<std::byte, 32>;
  const auto n = static_cast<std::size_t>(size);
  std::vector<block> mine(n), theirs(n), sent(n), received(n);
  for (auto& b : mine) job_secret::fill_random(b);
  static constexpr const char* op = "gloo connect: authentication";
  const auto pair = [](int peer) { return "the gloo connection to rank " + std::to_string(peer); };
  // One round: send out[p] to and receive in[p] from every peer, all posted before any wait.
  const auto round = [&](std::vector<block>& out, std::vector<block>& in, std::uint32_t tag) {
    const auto slot = ::gloo::Slot::build(authenticate_slot_prefix, tag);
    std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> sends(n), recvs(n);
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      const auto i = static_cast<std::size_t>(p);
      recvs[i] = ctx.createUnboundBuffer(in[i].data(), in[i].size());
      recvs[i]->recv(p, slot);
      sends[i] = ctx.createUnboundBuffer(out[i].data(), out[i].size());
      sends[i]->send(p, slot);
    }
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      const auto i = static_cast<std::size_t>(p);
      const auto left = std::max(std::chrono::milliseconds(1),
                                 std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now()));
      try {
        recvs[i]->waitRecv(left);
        sends[i]->waitSend(left);
      } catch (const ::gloo::IoException& e) {
        const std::string what = e.what();
        const std::string hint = " (a process outside the job may hold this rank's port: it connected first; or rank " +
                                 std::to_string(p) + " has no job secret: is " + job_secret::default_variable +
                                 " set there?)";
        if (what.find("Timed out") != std::string::npos) {
          throw timeout_error(rank, op, pair(p) + " did not authenticate: no answer: gloo: " + what + hint);
        }
        throw communication_error(rank, op, pair(p) + " did not authenticate: gloo: " + what + hint);
      }
    }
  };
  round(mine, theirs, 0);
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    const auto i = static_cast<std::size_t>(p);
    sent[i] = pair_proof(secret, key_prefix, size, rank, p, mine[i], theirs[i]);
  }
  round(sent, received, 1);
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    const auto i = static_cast<std::size_t>(p);
    const auto expected = pair_proof(secret, key_prefix, size, p, rank, theirs[i], mine[i]);
    if (!ddp::detail::constant_time_equal(expected, received[i])) {
      throw communication_error(rank, op,
                                "the peer on " + pair(p) +
                                    " does not hold this job's secret; nothing was sent to it (a process "
                                    "outside the job connected first to this rank's port, or the ranks were given "
                                    "different secrets)");
    }
  }
}

}  // namespace ddp::gloo::detail
