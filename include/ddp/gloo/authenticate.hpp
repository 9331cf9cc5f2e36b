#pragma once
/// @file gloo/authenticate.hpp
/// @brief Every gloo pair proves the job's secret, both ways, right after connecting and before
/// any data moves, with proofs bound to this one communicator (detail/peer_proof.hpp): a process
/// outside the job that connected first to a rank's port, or that relays proofs between two
/// communicators, becomes a clean error naming the pair, not a peer that reads or writes
/// gradients. Without a secret, a communicator other hosts can reach refuses to start.
///
/// The steps (docs/security.md, "Pair authentication"):
/// 1. Before connecting, each rank publishes a record through the store: a fresh member nonce,
///    its host name, and whether it listens where other hosts can reach. The records decide the
///    secret rule (`check_secret_rule`) identically on every rank, and their nonces make the
///    communicator's binding.
/// 2. After gloo's full mesh connected: each side of each pair sends a fresh connection nonce;
///    the higher rank sends its proof; the lower rank verifies it, and only then sends its own;
///    the higher rank verifies that.

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <gloo/common/error.h>
#include <gloo/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <ddp/detail/peer_proof.hpp>
#include <ddp/error.hpp>
#include <ddp/gloo/options.hpp>
#include <ddp/job_secret.hpp>
#include <ddp/work.hpp>

namespace ddp::gloo::detail {

/// gloo slot prefix of the authentication exchange (gloo's collectives use 0x01 .. 0x08, ddp's
/// reduce-scatter 0x40).
inline constexpr std::uint8_t authenticate_slot_prefix = 0x41;

/// What each rank publishes before connecting (step 1 of the file comment).
struct peer_record {
  ddp::detail::proof_nonce nonce{};  ///< fresh per communicator: the binding's input
  bool reachable = false;            ///< listens on an address other than loopback
  bool has_secret = false;           ///< holds a job secret
  bool insecure = false;             ///< set `insecure_no_secret`
  std::string host;                  ///< gethostname()
};

/// Whether a communicator listening per `opts` can be reached from other hosts: anything but an
/// address that resolves to loopback only (127.0.0.0/8, ::1) or the interface "lo".
[[nodiscard]] inline bool reachable_from_other_hosts(const options& opts) {
  if (!opts.interface.empty()) return opts.interface != "lo";
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(opts.hostname.c_str(), nullptr, &hints, &found) != 0 || found == nullptr) return true;
  bool loopback_only = true;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      const auto* in = reinterpret_cast<const sockaddr_in*>(a->ai_addr);
      const auto* b = reinterpret_cast<const unsigned char*>(&in->sin_addr);
      loopback_only = loopback_only && b[0] == 127;
    } else if (a->ai_family == AF_INET6) {
      static constexpr unsigned char one[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
      const auto* in6 = reinterpret_cast<const sockaddr_in6*>(a->ai_addr);
      loopback_only = loopback_only && std::memcmp(&in6->sin6_addr, one, 16) == 0;
    } else {
      loopback_only = false;
    }
  }
  ::freeaddrinfo(found);
  return !loopback_only;
}

/// Publishes this rank's record under "peer_<rank>" and reads every rank's (waiting, within the
/// store's connect deadline, for ranks that have not published yet).
[[nodiscard]] inline std::vector<peer_record> exchange_records(::gloo::rendezvous::Store& store, int rank, int size,
                                                               const options& opts) {
  const auto key = [](int r) { return "peer_" + std::to_string(r); };
  std::array<char, 256> name{};
  if (::gethostname(name.data(), name.size() - 1) != 0) name[0] = '\0';
  peer_record mine{ddp::detail::fresh_nonce(), reachable_from_other_hosts(opts), !opts.secret.empty(),
                   opts.insecure_no_secret, name.data()};
  const std::size_t flags_at = mine.nonce.size();
  std::vector<char> bytes(flags_at + 1 + mine.host.size());
  std::memcpy(bytes.data(), mine.nonce.data(), mine.nonce.size());
  bytes[flags_at] = static_cast<char>((mine.reachable ? 1 : 0) | (mine.has_secret ? 2 : 0) | (mine.insecure ? 4 : 0));
  std::memcpy(bytes.data() + flags_at + 1, mine.host.data(), mine.host.size());
  store.set(key(rank), bytes);
  std::vector<peer_record> all(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) {
    auto& out = all[static_cast<std::size_t>(r)];
    if (r == rank) {
      out = mine;
      continue;
    }
    const std::vector<char> b = store.get(key(r));
    if (b.size() < flags_at + 1 || (static_cast<unsigned char>(b[flags_at]) & ~7u) != 0) {
      throw communication_error(rank, "gloo connect",
                                "rank " + std::to_string(r) + " published a malformed peer record (" +
                                    std::to_string(b.size()) + " bytes): a ddp of another version, or not ddp");
    }
    std::memcpy(out.nonce.data(), b.data(), out.nonce.size());
    const auto flags = static_cast<unsigned char>(b[flags_at]);
    out.reachable = (flags & 1) != 0;
    out.has_secret = (flags & 2) != 0;
    out.insecure = (flags & 4) != 0;
    out.host.assign(b.begin() + static_cast<std::ptrdiff_t>(flags_at + 1), b.end());
  }
  return all;
}

/// The secret rule, decided alike on every rank from the records (so that no rank goes on to
/// connect while another refused): some ranks with a secret and others without is an error;
/// with a secret on every rank, nothing else to check; with none, a communicator that spans
/// hosts or listens where other hosts can reach refuses to start unless every rank set
/// `insecure_no_secret`; on one host over loopback, rank 0 prints one line saying the pairs are
/// not authenticated.
/// @throws usage_error saying why, and how to set a secret
inline void check_secret_rule(const std::vector<peer_record>& records, int rank) {
  if (records.size() < 2) return;
  const auto ranks_where = [&](auto pick) {
    std::string out;
    for (std::size_t r = 0; r < records.size(); ++r) {
      if (pick(records[r])) out += (out.empty() ? "" : ", ") + std::to_string(r);
    }
    return out;
  };
  const std::string with = ranks_where([](const peer_record& p) { return p.has_secret; });
  const std::string without = ranks_where([](const peer_record& p) { return !p.has_secret; });
  if (!with.empty() && !without.empty()) {
    throw usage_error(rank, "gloo connect",
                      "rank(s) " + with + " hold a job secret and rank(s) " + without +
                          " do not: give every process the same " + std::string(job_secret::default_variable) +
                          " (docs/security.md)");
  }
  if (!with.empty()) return;
  std::set<std::string> hosts;
  const std::string reachable = ranks_where([](const peer_record& p) { return p.reachable; });
  for (const auto& p : records) hosts.insert(p.host);
  if (hosts.size() < 2 && reachable.empty()) {
    if (rank == 0) {
      std::fprintf(stderr,
                   "ddp: gloo communicator of %zu ranks on one host without a job secret: its pairs are not "
                   "authenticated; set %s (docs/security.md)\n",
                   records.size(), job_secret::default_variable);
    }
    return;
  }
  const std::string not_opted_out = ranks_where([](const peer_record& p) { return !p.insecure; });
  if (not_opted_out.empty()) return;
  const std::string where = hosts.size() >= 2
                                ? "spans " + std::to_string(hosts.size()) + " hosts ('" + *hosts.begin() + "', '" +
                                      *std::next(hosts.begin()) + "'" + (hosts.size() > 2 ? ", ..." : "") + ")"
                                : "listens where other hosts can reach it (rank(s) " + reachable + ")";
  throw usage_error(rank, "gloo connect",
                    "this communicator " + where +
                        " and has no job secret: any process that reaches its ports could join it and read or "
                        "inject data. Set " +
                        std::string(job_secret::default_variable) + " to the same secret on every process (" +
                        job_secret::how_to_make +
                        "), or set gloo::options::insecure_no_secret = true on every rank to run unauthenticated "
                        "anyway (not set on rank(s) " +
                        not_opted_out + "; docs/security.md)");
}

/// The communicator's binding (detail/peer_proof.hpp): every rank's record nonce, and every
/// rank's published gloo addresses (`addresses[r]`; this rank's own as it wrote them, not as the
/// store returns them), so that ranks that were shown different addresses (a store rewritten to
/// put someone between them) hold different bindings and refuse each other.
[[nodiscard]] inline ddp::detail::sha256_digest binding_of(const std::vector<peer_record>& records,
                                                           const std::vector<std::vector<char>>& addresses,
                                                           std::string_view key_prefix) {
  std::vector<ddp::detail::proof_nonce> nonces;
  nonces.reserve(records.size());
  for (const auto& r : records) nonces.push_back(r.nonce);
  const auto members =
      ddp::detail::communicator_binding("ddp gloo communicator", key_prefix, static_cast<int>(records.size()), nonces);
  ddp::detail::sha256 h;
  h.update(members);
  for (const auto& a : addresses) {
    const std::uint64_t n = a.size();
    h.update(std::as_bytes(std::span(&n, 1)));
    h.update(std::as_bytes(std::span(a)));
  }
  return h.finish();
}

/// Runs step 2 of the file comment with every peer of `ctx` (a no-op for an empty secret or one
/// rank).
/// @throws communication_error naming the pair whose peer answered wrong or closed;
///         timeout_error naming the pair whose peer did not answer by `deadline`
inline void authenticate_pairs(::gloo::Context& ctx, const job_secret& secret,
                               const ddp::detail::sha256_digest& binding, clock::time_point deadline) {
  const int rank = ctx.rank;
  const int size = ctx.size;
  if (secret.empty() || size < 2) return;
  using block = std::array<std::byte, 32>;
  const auto n = static_cast<std::size_t>(size);
  std::vector<block> mine(n), theirs(n), proofs(n), received(n);
  for (auto& b : mine) b = ddp::detail::fresh_nonce();
  static constexpr const char* op = "gloo connect: authentication";
  const auto pair = [](int peer) { return "the gloo connection to rank " + std::to_string(peer); };
  // One round: send out[p] to the peers `send_to` picks and receive in[q] from those `receive_from`
  // picks, all posted before any wait.
  const auto round = [&](std::vector<block>& out, std::vector<block>& in, std::uint32_t tag,
                         const std::function<bool(int)>& send_to, const std::function<bool(int)>& receive_from) {
    const auto slot = ::gloo::Slot::build(authenticate_slot_prefix, tag);
    std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> sends(n), recvs(n);
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      const auto i = static_cast<std::size_t>(p);
      if (receive_from(p)) {
        recvs[i] = ctx.createUnboundBuffer(in[i].data(), in[i].size());
        recvs[i]->recv(p, slot);
      }
      if (send_to(p)) {
        sends[i] = ctx.createUnboundBuffer(out[i].data(), out[i].size());
        sends[i]->send(p, slot);
      }
    }
    for (int p = 0; p < size; ++p) {
      const auto i = static_cast<std::size_t>(p);
      if (p == rank || (!recvs[i] && !sends[i])) continue;
      const auto left = std::max(std::chrono::milliseconds(1),
                                 std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now()));
      try {
        if (recvs[i]) recvs[i]->waitRecv(left);
        if (sends[i]) sends[i]->waitSend(left);
      } catch (const ::gloo::IoException& e) {
        const std::string what = e.what();
        const std::string hint = " (a process outside the job may hold this rank's port: it connected first; or rank " +
                                 std::to_string(p) + " refused this rank's proof, or has no job secret: is " +
                                 job_secret::default_variable + " set there?)";
        if (what.find("Timed out") != std::string::npos) {
          throw timeout_error(rank, op, pair(p) + " did not authenticate: no answer: gloo: " + what + hint);
        }
        throw communication_error(rank, op, pair(p) + " did not authenticate: gloo: " + what + hint);
      }
    }
  };
  const auto proof_for = [&](int p) {
    const auto i = static_cast<std::size_t>(p);
    return ddp::detail::peer_proof(secret, binding, rank, p, mine[i], theirs[i]);
  };
  const auto check = [&](int p, bool sent_own) {
    const auto i = static_cast<std::size_t>(p);
    const auto expected = ddp::detail::peer_proof(secret, binding, p, rank, theirs[i], mine[i]);
    if (ddp::detail::constant_time_equal(expected, received[i])) return;
    throw communication_error(
        rank, op,
        "the peer on " + pair(p) + " did not prove this communicator's job secret (" +
            (sent_own ? "this rank had sent its own proof, bound to this communicator and this connection"
                      : "this rank sent it a nonce and nothing derived from the secret") +
            "): a process outside the job connected first to a port of this communicator or relays another "
            "communicator's proofs, or the ranks were given different secrets");
  };
  const auto higher = [rank](int p) { return ddp::detail::proves_first(p, rank); };
  const auto lower = [rank](int p) { return ddp::detail::proves_first(rank, p); };
  const auto everyone = [](int) { return true; };
  round(mine, theirs, 0, everyone, everyone);
  // Higher ranks prove first; this rank checks their proofs before sending its own to them.
  for (int p = 0; p < size; ++p) {
    if (lower(p)) proofs[static_cast<std::size_t>(p)] = proof_for(p);
  }
  round(proofs, received, 1, lower, higher);
  for (int p = 0; p < size; ++p) {
    if (higher(p)) check(p, false);
  }
  for (int p = 0; p < size; ++p) {
    if (higher(p)) proofs[static_cast<std::size_t>(p)] = proof_for(p);
  }
  round(proofs, received, 2, higher, lower);
  for (int p = 0; p < size; ++p) {
    if (lower(p)) check(p, true);
  }
}

}  // namespace ddp::gloo::detail
