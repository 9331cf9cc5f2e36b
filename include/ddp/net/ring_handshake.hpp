#pragma once
/// @file net/ring_handshake.hpp
/// @brief How `net::ring` (net/ring.hpp) members find and authenticate their neighbours: the
/// record each member publishes, the decision every member takes alike from all records (prove
/// the job secret, or run unauthenticated on one host, or refuse), and both sides of a
/// connection's handshake. See docs/backends-sockets.md and docs/security.md.
///
/// The handshake (fixed-size messages; the proofs are detail/peer_proof.hpp's):
/// 1. the dialer sends its hello (magic, its index, the ring's token, a fresh connection nonce);
/// 2. the acceptor checks it and answers with its own hello (its index, its fresh nonce);
/// 3. with a secret: the dialer sends its proof; the acceptor verifies it (in constant time)
///    before it sends anything derived from the secret, and answers with a verdict: refused
///    (then it closes), or accepted with its own proof, which the dialer verifies.
/// The acceptor runs several such handshakes at once, each with a deadline of its own, so a
/// stranger that connects first and stays silent or sends garbage neither stalls nor breaks it.

#include <arpa/inet.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <ddp/detail/hmac_sha256.hpp>
#include <ddp/detail/peer_proof.hpp>
#include <ddp/error.hpp>
#include <ddp/job_secret.hpp>
#include <ddp/net/socket.hpp>

namespace ddp::net {

/// What each member publishes before the ring connects (a fixed-size record, allgathered).
struct ring_record {
  static constexpr std::uint32_t magic_value = 0x32726464;  ///< "ddr2": a ring's record or greeting, version 2
  static constexpr std::size_t max_addresses = 8;           ///< addresses a record carries at most
  static constexpr std::uint32_t has_secret = 1;            ///< `flags`: the member holds a job secret
  static constexpr std::uint32_t allows_insecure = 2;       ///< `flags`: the member allows no secret across hosts
  std::uint32_t magic = magic_value;                        ///< `magic_value`
  std::uint32_t index = 0;                                  ///< the member's index in the ring
  std::uint64_t token = 0;                             ///< random; the ring's token is the XOR of all members' tokens
  std::uint16_t port = 0;                              ///< the member's listening port
  std::uint16_t addresses = 0;                         ///< entries of `address` in use
  std::uint32_t flags = 0;                             ///< `has_secret`, `allows_insecure`
  std::array<std::uint32_t, max_addresses> address{};  ///< IPv4, network byte order
  ddp::detail::proof_nonce nonce{};                    ///< fresh per ring: input of the proofs' binding
  std::array<char, 64> host{};                         ///< gethostname(), NUL-padded (truncated)
};
static_assert(sizeof(ring_record) == 152 && std::has_unique_object_representations_v<ring_record>,
              "ring_record travels as bytes: no padding");

namespace detail {

/// A handshake's hello, both ways.
struct ring_hello {
  std::uint32_t magic = ring_record::magic_value;
  std::uint32_t index = 0;
  std::uint64_t token = 0;
  ddp::detail::proof_nonce nonce{};
};

/// The acceptor's answer to the dialer's proof.
struct ring_verdict {
  static constexpr std::uint32_t refused = 0, accepted = 1;
  std::uint32_t magic = ring_record::magic_value;
  std::uint32_t outcome = refused;
  ddp::detail::sha256_digest proof{};  ///< the acceptor's proof when accepted, zeros when refused
};

/// How long an accepted connection may take to complete its handshake: a stranger that stays
/// silent is dropped after this, while other connections go on meanwhile.
inline constexpr std::chrono::milliseconds greeting_timeout{2000};

/// What every member decides from the allgathered records alone (so all decide alike).
struct ring_plan {
  std::uint64_t token = 0;               ///< XOR of the members' tokens
  bool authenticated = false;            ///< every connection proves the job secret
  ddp::detail::sha256_digest binding{};  ///< the ring instance the proofs are bound to
  const job_secret* secret = nullptr;    ///< this member's secret (when authenticated)
  int index = 0;                         ///< this member
  int count = 1;                         ///< members
};

inline std::string leader_name(int i, const char* side) {
  return "node leader " + std::to_string(i) + " (" + side + " in the ring)";
}

inline std::string host_of(const ring_record& r) {
  return std::string(r.host.data(), ::strnlen(r.host.data(), r.host.size()));
}

inline std::string addresses_of(const ring_record& r) {
  std::string out;
  for (std::size_t i = 0; i < r.addresses; ++i) out += (i ? ", " : "") + ipv4{r.address[i]}.str();
  return out.empty() ? "none" : out;
}

inline std::string leaders_list(const std::vector<int>& v) {
  std::string out = v.size() == 1 ? "node leader " : "node leaders ";
  for (std::size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out;
}

/// This member's record: `index`, a random token, `port`, up to 8 of `addrs`, a fresh nonce, the
/// host name and the flags.
inline ring_record make_record(int index, std::uint16_t port, const std::vector<ipv4>& addrs, const job_secret& secret,
                               bool insecure_no_secret) {
  ring_record r;
  r.index = static_cast<std::uint32_t>(index);
  job_secret::fill_random(std::as_writable_bytes(std::span(&r.token, 1)));
  r.port = port;
  for (const ipv4& a : addrs) {
    if (r.addresses == ring_record::max_addresses) break;
    r.address[r.addresses++] = a.addr;
  }
  r.nonce = ddp::detail::fresh_nonce();
  if (::gethostname(r.host.data(), r.host.size() - 1) != 0) r.host[0] = '\0';
  r.flags = (secret.empty() ? 0 : ring_record::has_secret) | (insecure_no_secret ? ring_record::allows_insecure : 0);
  return r;
}

/// The decision (see the file comment of net/ring.hpp, "Who may join"), from the records alone.
/// The ring spans hosts unless every record names the same host AND publishes the same addresses:
/// two processes of one network namespace see the same interfaces; a differing host name or
/// address list (another machine, another container) counts as another host. Either test alone
/// could take two machines for one (cloned host names, or identical private addresses), so a
/// difference in either fails closed.
/// @throws usage_error on every member alike: some members have a secret and others not; or no
///         secret, the ring spans hosts and not every member set `insecure_no_secret`
/// @throws communication_error if a record is malformed (another ddp version)
inline ring_plan plan_ring(const std::vector<ring_record>& all, int index, int count, const job_secret& secret,
                           const context& ctx) {
  if (all.size() != static_cast<std::size_t>(count)) {
    fail(ctx, "the ring's allgather returned " + std::to_string(all.size()) + " records for " + std::to_string(count) +
                  " members");
  }
  ring_plan p;
  p.index = index;
  p.count = count;
  std::vector<ddp::detail::proof_nonce> nonces;
  std::vector<int> without_secret, without_insecure;
  int other_host = -1;  // the first member that is not on member 0's host
  for (int i = 0; i < count; ++i) {
    const ring_record& r = all[static_cast<std::size_t>(i)];
    if (r.magic != ring_record::magic_value || r.index != static_cast<std::uint32_t>(i) ||
        r.addresses > ring_record::max_addresses) {
      fail(ctx, "node leader " + std::to_string(i) + " published a malformed ring record: a ddp of another version?");
    }
    p.token ^= r.token;
    nonces.push_back(r.nonce);
    if ((r.flags & ring_record::has_secret) == 0) without_secret.push_back(i);
    if ((r.flags & ring_record::allows_insecure) == 0) without_insecure.push_back(i);
    const ring_record& first = all.front();
    const bool same = r.host == first.host && r.addresses == first.addresses &&
                      std::equal(r.address.begin(), r.address.begin() + r.addresses, first.address.begin());
    if (!same && other_host < 0) other_host = i;
  }
  p.binding = ddp::detail::communicator_binding("ddp net ring", "ring", count, nonces);
  if (without_secret.empty()) {
    p.authenticated = true;
    p.secret = &secret;
    return p;
  }
  if (without_secret.size() != all.size()) {
    throw usage_error(ctx.rank, ctx.operation,
                      "the sockets ring's members disagree on the job secret: " + leaders_list(without_secret) +
                          (without_secret.size() == 1 ? " has" : " have") +
                          " none and the others have one; every node leader needs the same secret (environment "
                          "variable " +
                          job_secret::default_variable + ", or shm::options::secret)");
  }
  if (other_host >= 0 && !without_insecure.empty()) {
    const ring_record& a = all.front();
    const ring_record& b = all[static_cast<std::size_t>(other_host)];
    const std::string where = host_of(a) != host_of(b)
                                  ? "node leader 0 is on '" + host_of(a) + "', node leader " +
                                        std::to_string(other_host) + " on '" + host_of(b) + "'"
                                  : "node leader 0 publishes " + addresses_of(a) + ", node leader " +
                                        std::to_string(other_host) + " " + addresses_of(b);
    const std::string partly = without_insecure.size() < all.size()
                                   ? " (" + leaders_list(without_insecure) + " did not set it)"
                                   : std::string();
    throw usage_error(ctx.rank, ctx.operation,
                      "the node leaders' sockets ring spans hosts (" + where +
                          ") and has no job secret: any host that reaches its ports could join it and read or inject "
                          "data. Set the same job secret on every process (environment variable " +
                          job_secret::default_variable + ", or shm::options::secret): " + job_secret::how_to_make +
                          "; or, on a network that nobody else can reach, set shm::options::insecure_no_secret on "
                          "every rank" +
                          partly);
  }
  if (index == 0) {
    if (other_host < 0) {
      std::fprintf(stderr,
                   "ddp: the node leaders' sockets ring (%d members, one host) is not authenticated: no job secret; "
                   "set %s (docs/security.md)\n",
                   count, job_secret::default_variable);
    } else {
      std::fprintf(stderr,
                   "ddp: the node leaders' sockets ring (%d members) spans hosts WITHOUT authentication "
                   "(insecure_no_secret): any host that reaches its ports can join it and read or inject data\n",
                   count);
    }
  }
  return p;
}

/// Dials `peer` (the right neighbour) at one of its addresses, those on `mine`'s subnets first,
/// and runs the dialer's side of the handshake. An address where something else answers (a wrong
/// hello, a closed connection, silence) is skipped; a refused or wrong proof fails at once.
/// @throws communication_error naming the neighbour
inline socket_fd dial(const ring_record& peer, const ring_plan& plan, const std::vector<ipv4>& mine,
                      clock::time_point deadline, const context& ctx) {
  std::vector<ipv4> candidates;
  for (std::uint16_t i = 0; i < std::min<std::size_t>(peer.addresses, ring_record::max_addresses); ++i) {
    candidates.push_back({peer.address[i]});
  }
  const auto same_subnet = [&](ipv4 a) {
    return std::any_of(mine.begin(), mine.end(), [&](ipv4 b) {
      return (ntohl(a.addr) >> 8) == (ntohl(b.addr) >> 8) && (ntohl(a.addr) >> 24) != 127;
    });
  };
  std::stable_partition(candidates.begin(), candidates.end(), same_subnet);
  const int right = static_cast<int>(peer.index);
  const std::string who = leader_name(right, "right");
  std::string tried;
  for (ipv4 a : candidates) {
    const auto try_until = std::min(deadline, clock::now() + std::chrono::seconds(5));
    socket_fd s = connect_to(a, peer.port, try_until);
    const std::string at = a.str() + ":" + std::to_string(peer.port);
    tried += (tried.empty() ? "" : ", ") + at;
    if (!s) continue;
    const ring_hello h{ring_record::magic_value, static_cast<std::uint32_t>(plan.index), plan.token,
                       ddp::detail::fresh_nonce()};
    ring_hello back{};
    ring_verdict verdict{};
    try {
      send_all(s, &h, sizeof h, try_until, ctx, who);
      recv_all(s, &back, sizeof back, try_until, ctx, who);
      if (back.magic != ring_record::magic_value || back.token != plan.token ||
          back.index != static_cast<std::uint32_t>(right)) {
        continue;  // not this ring's member: a stranger at that address
      }
      if (!plan.authenticated) return s;
      const auto proof = ddp::detail::peer_proof(*plan.secret, plan.binding, plan.index, right, h.nonce, back.nonce);
      send_all(s, proof.data(), proof.size(), try_until, ctx, who);
      recv_all(s, &verdict, sizeof verdict, try_until, ctx, who);
    } catch (const error&) {
      continue;  // closed or silent: try the next address
    }
    if (verdict.magic != ring_record::magic_value || verdict.outcome == ring_verdict::refused) {
      fail(ctx, who + " at " + at +
                    " refused this leader's proof of the job secret: do all node leaders have the same "
                    "secret (" +
                    job_secret::default_variable + ")?");
    }
    const auto expected = ddp::detail::peer_proof(*plan.secret, plan.binding, right, plan.index, back.nonce, h.nonce);
    if (!ddp::detail::constant_time_equal(expected, verdict.proof)) {
      fail(ctx, who + " at " + at + " did not prove the job secret: another secret, or not a member of this job");
    }
    return s;
  }
  fail(ctx, "could not connect to " + who + " at any of its addresses (" + tried +
                "); set shm::options::socket_interface to the interface the hosts share");
}

/// The acceptor's side: accepts on `listeners` until the left neighbour completes the handshake
/// (see the file comment), several connections at once, each within `greeting_timeout` (or the
/// deadline, if sooner); the others are dropped. Once `cancel` is readable (this member failed
/// already) it goes on for at most `cancel_grace`, so that a neighbour whose handshake is under
/// way learns how it ended (e.g. that its proof was refused) instead of seeing the port vanish.
/// @throws communication_error naming the left neighbour if a connection that greeted as it
///         proved a wrong secret and none proved the right one before the deadline
/// @throws timeout_error naming the left neighbour if it did not connect before the deadline
inline socket_fd answer(const std::vector<socket_fd>& listeners, const wakeup_pipe& cancel, const ring_plan& plan,
                        clock::time_point deadline, const context& ctx) {
  static constexpr std::chrono::milliseconds cancel_grace{1000};
  bool cancelled = false;
  const int left = (plan.index + plan.count - 1) % plan.count;
  const std::string who = leader_name(left, "left");
  static constexpr std::size_t max_pending = 64;  // beyond: the oldest is dropped
  struct pending {
    socket_fd s;
    clock::time_point until;
    int stage = 0;  // 0 read hello, 1 write hello, 2 read proof, 3 write verdict
    std::array<std::byte, std::max(sizeof(ring_hello), sizeof(ring_verdict))> buf{};
    std::size_t done = 0, want = sizeof(ring_hello);
    ring_hello theirs{};
    ring_hello ours{};
  };
  std::vector<pending> conns;
  bool wrong_proof = false;
  enum class step { wait, drop, won };
  // Moves connection `c` as far as its socket allows.
  const auto advance = [&](pending& c) {
    for (;;) {
      const bool writing = c.stage == 1 || c.stage == 3;
      const ssize_t n = writing ? ::send(c.s.get(), c.buf.data() + c.done, c.want - c.done, MSG_NOSIGNAL | MSG_DONTWAIT)
                                : ::recv(c.s.get(), c.buf.data() + c.done, c.want - c.done, MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return step::wait;
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return step::drop;
      c.done += static_cast<std::size_t>(n);
      if (c.done < c.want) continue;
      c.done = 0;
      if (c.stage == 0) {
        std::memcpy(&c.theirs, c.buf.data(), sizeof c.theirs);
        if (c.theirs.magic != ring_record::magic_value || c.theirs.token != plan.token ||
            c.theirs.index != static_cast<std::uint32_t>(left)) {
          return step::drop;  // not the left neighbour of this ring
        }
        c.ours = {ring_record::magic_value, static_cast<std::uint32_t>(plan.index), plan.token,
                  ddp::detail::fresh_nonce()};
        std::memcpy(c.buf.data(), &c.ours, sizeof c.ours);
        c.stage = 1;
        c.want = sizeof c.ours;
      } else if (c.stage == 1) {
        if (!plan.authenticated) return step::won;
        c.stage = 2;
        c.want = sizeof(ddp::detail::sha256_digest);
      } else if (c.stage == 2) {
        // Verify the dialer's proof before sending anything derived from the secret.
        ddp::detail::sha256_digest got{};
        std::memcpy(got.data(), c.buf.data(), got.size());
        const auto expected =
            ddp::detail::peer_proof(*plan.secret, plan.binding, left, plan.index, c.theirs.nonce, c.ours.nonce);
        ring_verdict v{};
        if (ddp::detail::constant_time_equal(expected, got)) {
          v.outcome = ring_verdict::accepted;
          v.proof = ddp::detail::peer_proof(*plan.secret, plan.binding, plan.index, left, c.ours.nonce, c.theirs.nonce);
        }
        std::memcpy(c.buf.data(), &v, sizeof v);
        c.stage = 3;
        c.want = sizeof v;
        if (v.outcome == ring_verdict::refused) {
          wrong_proof = true;
          (void)!::send(c.s.get(), c.buf.data(), c.want, MSG_NOSIGNAL | MSG_DONTWAIT);  // best effort
          return step::drop;
        }
      } else {
        return step::won;
      }
    }
  };
  for (;;) {
    const auto now = clock::now();
    if (now >= deadline) {
      if (wrong_proof) {
        fail(ctx, who +
                      " did not prove the job secret: a connection that greeted as it sent a wrong proof, and "
                      "none sent the right one before the deadline (do all node leaders have the same secret, " +
                      job_secret::default_variable + "?)");
      }
      throw timeout_error(ctx.rank, ctx.operation, "no progress with " + who + " to connect before the deadline");
    }
    std::erase_if(conns, [&](const pending& c) { return c.until <= now; });
    if (cancelled && wrong_proof && conns.empty()) fail(ctx, "stopped waiting for " + who);  // it was told
    auto wake = deadline;
    std::vector<pollfd> fds;
    fds.push_back({cancelled ? -1 : cancel.fd(), POLLIN, 0});  // -1: poll skips it
    for (const socket_fd& l : listeners) fds.push_back({l.get(), POLLIN, 0});
    for (const pending& c : conns) {
      fds.push_back({c.s.get(), static_cast<short>(c.stage == 1 || c.stage == 3 ? POLLOUT : POLLIN), 0});
      wake = std::min(wake, c.until);
    }
    const int rc = ::poll(fds.data(), fds.size(), detail::remaining_ms(wake) + 1);
    if (rc < 0 && errno != EINTR) fail_errno(ctx, "poll while waiting for " + who, errno);
    if (rc <= 0) continue;
    if (fds[0].revents != 0) {
      cancelled = true;
      deadline = std::min(deadline, clock::now() + cancel_grace);
    }
    const std::size_t first_conn = 1 + listeners.size();
    std::vector<bool> dropped(conns.size(), false);
    for (std::size_t i = 0; i < conns.size(); ++i) {
      if (fds[first_conn + i].revents == 0) continue;
      const step s = advance(conns[i]);
      if (s == step::won) {
        socket_fd out = std::move(conns[i].s);
        detail::set_nonblocking(out.get(), false);
        return out;  // the other connections close here
      }
      dropped[i] = s == step::drop;
    }
    for (std::size_t i = conns.size(); i-- > 0;) {
      if (dropped[i]) conns.erase(conns.begin() + static_cast<std::ptrdiff_t>(i));
    }
    for (std::size_t l = 0; l < listeners.size(); ++l) {
      if (fds[1 + l].revents == 0) continue;
      for (;;) {  // every connection waiting in the backlog
        socket_fd s(::accept4(listeners[l].get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
        if (!s) {
          const int err = errno;
          if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
            if (conns.empty()) fail_errno(ctx, "accept while waiting for " + who, err);
            conns.erase(conns.begin());  // frees a descriptor for the next try
          } else if (err == EBADF || err == EINVAL || err == ENOTSOCK) {
            fail_errno(ctx, "accept while waiting for " + who, err);
          }
          break;  // EAGAIN, or a network error of one connection (accept(2)): the next poll retries
        }
        detail::tune(s.get());
        if (conns.size() == max_pending) conns.erase(conns.begin());
        pending c;
        c.s = std::move(s);
        c.until = std::min(deadline, clock::now() + greeting_timeout);
        conns.push_back(std::move(c));
      }
    }
  }
}

}  // namespace detail
}  // namespace ddp::net
