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
/// Both proofs are bound to the ring instance and to the acceptor's end point as the dialer
/// dialled it (`connection_binding`), so a relay reached at another address is refused by both.
/// The acceptor runs several such handshakes at once, each with a deadline of its own, so a
/// stranger that connects first and stays silent or sends garbage neither stalls nor breaks it.
/// Unless every member is on one host, nobody dials a loopback address or one of its own host's
/// addresses, nor listens on loopback (`dial_candidates`, `drop_loopback_listeners`).

#include <arpa/inet.h>
#include <netinet/in.h>
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
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
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
/// silent is dropped after this, while other connections go on meanwhile. The dialer gives each
/// address as long for the hello and the proofs.
inline constexpr std::chrono::milliseconds greeting_timeout{2000};

/// The longest a dialer tries to connect to one address when more are left to try (each gets at
/// most its share of the time left, the last one all of it).
inline constexpr std::chrono::milliseconds connect_share{2000};

/// Refusals after which a dialer gives up an address: every member listens before it publishes
/// its record, so a refusal means that nothing listens there (3 tries, 20 ms apart, forgive a
/// listen backlog that overflowed for a moment).
inline constexpr int connect_refusals = 3;

/// What every member decides from the allgathered records alone (so all decide alike).
struct ring_plan {
  std::uint64_t token = 0;               ///< XOR of the members' tokens
  bool authenticated = false;            ///< every connection proves the job secret
  ddp::detail::sha256_digest binding{};  ///< the ring instance (`connection_binding` adds the end point)
  bool one_host = true;                  ///< every record names one host and the same addresses
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
  p.one_host = other_host < 0;
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

/// Whether `a` is a loopback address (127/8: every host has them, and any process of the host may
/// listen on one at any port that is free there).
[[nodiscard]] inline bool is_loopback(ipv4 a) noexcept { return (ntohl(a.addr) >> 24) == 127; }

/// The binding of one connection's proofs: the ring's (`plan.binding`) and the acceptor's end
/// point as the dialer dialled it (IPv4 address and port). The dialer passes the address and port
/// it connected to; the acceptor, `getsockname` of the accepted socket. A relay that the dialer
/// reaches instead of the neighbour (a process of the dialer's host listening on 127.0.0.1 or a
/// bridge address at the neighbour's port, forwarding to the neighbour's real address) makes the
/// two sides hash different end points, so each refuses the other's proof. It is folded into the
/// binding, not added to detail::peer_proof, whose inputs gloo shares; the "end point" field
/// keeps it apart from any communicator binding. @throws ddp::error if libcrypto fails
[[nodiscard]] inline ddp::detail::sha256_digest connection_binding(const ddp::detail::sha256_digest& ring, ipv4 address,
                                                                   std::uint16_t port) {
  static constexpr std::string_view label = "ddp net ring end point";
  const std::uint16_t port_n = htons(port);
  ddp::detail::sha256 h;
  for (const std::span<const std::byte> field :
       {std::as_bytes(std::span(label)), std::span<const std::byte>(ring), std::as_bytes(std::span(&address.addr, 1)),
        std::as_bytes(std::span(&port_n, 1))}) {
    const std::uint64_t n = field.size();  // length-prefixed, as in communicator_binding
    h.update(std::as_bytes(std::span(&n, 1)));
    h.update(field);
  }
  return h.finish();
}

/// The addresses of `peer` to dial, in order: those on the subnets of `own` (every address of the
/// dialer's host) first. Unless every member is on one host (`plan.one_host`), it leaves out
/// loopback addresses and the dialer's own: there a process of the dialer's host answers, not
/// the neighbour (every host has 127.0.0.1, and bridges such as docker0's 172.17.0.1 exist on
/// many). `skipped` receives those left out, and why, for an error message.
[[nodiscard]] inline std::vector<ipv4> dial_candidates(const ring_record& peer, const ring_plan& plan,
                                                       const std::vector<ipv4>& own, std::string& skipped) {
  std::vector<ipv4> out;
  for (std::size_t i = 0; i < std::min<std::size_t>(peer.addresses, ring_record::max_addresses); ++i) {
    const ipv4 a{peer.address[i]};
    const bool mine = std::any_of(own.begin(), own.end(), [&](ipv4 b) { return b.addr == a.addr; });
    if (!plan.one_host && (is_loopback(a) || mine)) {
      skipped += (skipped.empty() ? "" : ", ") + a.str() + (is_loopback(a) ? " (loopback)" : " (this host's)");
    } else {
      out.push_back(a);
    }
  }
  const auto same_subnet = [&](ipv4 a) {
    return !is_loopback(a) &&
           std::any_of(own.begin(), own.end(), [&](ipv4 b) { return (ntohl(a.addr) >> 8) == (ntohl(b.addr) >> 8); });
  };
  std::stable_partition(out.begin(), out.end(), same_subnet);
  return out;
}

/// Closes the listeners on loopback addresses unless every member is on one host (no neighbour
/// dials them then; see dial_candidates). They were open until the records were read, so that
/// nobody else could take this port on them meanwhile.
inline void drop_loopback_listeners(std::vector<socket_fd>& listeners, const ring_plan& plan) {
  if (plan.one_host) return;
  std::erase_if(listeners, [](const socket_fd& l) {
    sockaddr_in a{};
    socklen_t len = sizeof a;
    return ::getsockname(l.get(), reinterpret_cast<sockaddr*>(&a), &len) == 0 && is_loopback(ipv4{a.sin_addr.s_addr});
  });
}

/// Dials `peer` (the right neighbour) at the addresses dial_candidates picks, each for a share of
/// the time left (`connect_share`; an address that refuses is given up at once,
/// `connect_refusals`), and runs the dialer's side of the handshake. An address where something
/// else answers (a wrong hello, a closed connection, silence) is skipped, and why is kept for the
/// error. Once an address has answered with the neighbour's hello, whatever happens on that
/// connection is the outcome: a refused or wrong proof, or a connection that ends, fails at once
/// (falling through to another address would let a relay that echoes the hello hide the cause).
/// @throws communication_error (or timeout_error) naming the neighbour, the address and the cause;
///         an error that is not the network's (libcrypto, the kernel's random numbers) propagates
inline socket_fd dial(const ring_record& peer, const ring_plan& plan, const std::vector<ipv4>& own,
                      clock::time_point deadline, const context& ctx) {
  const int right = static_cast<int>(peer.index);
  const std::string who = leader_name(right, "right");
  std::string skipped;
  const std::vector<ipv4> candidates = dial_candidates(peer, plan, own, skipped);
  std::string tried;  // "address: why" for each address given up
  const auto give_up = [&](const std::string& at, const std::string& why) {
    tried += (tried.empty() ? "" : "; ") + at + ": " + why;
  };
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const ipv4 a = candidates[i];
    const std::string at = a.str() + ":" + std::to_string(peer.port);
    const auto now = clock::now();
    const auto left = static_cast<clock::rep>(candidates.size() - i);
    const auto until =
        left == 1 ? deadline
                  : std::min(deadline, now + std::min<clock::duration>(connect_share, (deadline - now) / left));
    int err = 0;
    socket_fd s = connect_to(a, peer.port, until, &err, connect_refusals);
    if (!s) {
      if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) fail_errno(ctx, "socket()", err);
      give_up(at, err == ETIMEDOUT ? "no answer within its share of the deadline" : std::strerror(err));
      continue;
    }
    const auto greet_until = std::min(deadline, clock::now() + greeting_timeout);
    const ring_hello h{ring_record::magic_value, static_cast<std::uint32_t>(plan.index), plan.token,
                       ddp::detail::fresh_nonce()};
    ring_hello back{};
    try {  // only the network's errors here: "it" is whatever answers at this address
      send_all(s, &h, sizeof h, greet_until, ctx, "it");
      recv_all(s, &back, sizeof back, greet_until, ctx, "it");
    } catch (const timeout_error&) {
      give_up(at, "no hello in answer (something else listens there?)");
      continue;
    } catch (const communication_error& e) {
      give_up(at, e.message());
      continue;
    }
    if (back.magic != ring_record::magic_value || back.token != plan.token ||
        back.index != static_cast<std::uint32_t>(right)) {
      give_up(at, "something else answers there (not this ring's hello from " + who + ")");
      continue;
    }
    // The neighbour's hello (or a relay's echo of it): from here on, no other address.
    if (!plan.authenticated) return s;
    const std::string there = std::string(who).append(" at ").append(at);
    const auto binding = connection_binding(plan.binding, a, peer.port);
    const auto proof = ddp::detail::peer_proof(*plan.secret, binding, plan.index, right, h.nonce, back.nonce);
    ring_verdict verdict{};
    send_all(s, proof.data(), proof.size(), greet_until, ctx, there);
    recv_all(s, &verdict, sizeof verdict, greet_until, ctx, there);
    if (verdict.magic != ring_record::magic_value || verdict.outcome == ring_verdict::refused) {
      fail(ctx, there + " refused this leader's proof of the job secret: do all node leaders have the same secret (" +
                    job_secret::default_variable +
                    ")? Or something else listens at that address and relays to the neighbour (a proof is bound "
                    "to the address dialled)");
    }
    const auto expected = ddp::detail::peer_proof(*plan.secret, binding, right, plan.index, back.nonce, h.nonce);
    if (!ddp::detail::constant_time_equal(expected, verdict.proof)) {
      fail(ctx, there + " did not prove the job secret: another secret, or not a member of this job");
    }
    return s;
  }
  std::string why = candidates.empty() ? "it publishes no address this leader may dial" : "tried " + tried;
  if (!skipped.empty()) {
    why += "; not dialled, as the records say the ring spans hosts (another host name or address list): " + skipped;
  }
  fail(ctx, "could not connect to " + who + " at any of its addresses (" + why +
                "); set shm::options::socket_interface to the interface the hosts share" +
                (candidates.empty() ? " (leaders in one network namespace need one host name)" : ""));
}

/// The acceptor's side: accepts on `listeners` until the left neighbour completes the handshake
/// (see the file comment), several connections at once, each within `greeting_timeout` (or the
/// deadline, if sooner); the others are dropped. Beyond `max_pending` connections it drops one
/// that has not sent this ring's hello yet (the oldest), else the oldest. A refused proof does not
/// end the wait: a stranger's connection and a neighbour with another secret look alike here.
/// Once `cancel` is readable (this member failed already) it goes on for at most `cancel_grace`,
/// so that a neighbour whose handshake is under way learns how it ended (e.g. that its proof was
/// refused) instead of seeing the port vanish.
/// @throws communication_error naming the left neighbour if a connection that greeted as it
///         proved a wrong secret and none proved the right one before the deadline
/// @throws timeout_error naming the left neighbour if it did not connect before the deadline
inline socket_fd answer(const std::vector<socket_fd>& listeners, const wakeup_pipe& cancel, const ring_plan& plan,
                        clock::time_point deadline, const context& ctx) {
  static constexpr std::chrono::milliseconds cancel_grace{1000};
  bool cancelled = false;
  const int left = (plan.index + plan.count - 1) % plan.count;
  const std::string who = leader_name(left, "left");
  static constexpr std::size_t max_pending = 64;  // beyond: one is dropped (see above)
  struct pending {
    socket_fd s;
    clock::time_point until;
    ipv4 local;              // the end point the dialer dialled (getsockname)
    std::uint16_t port = 0;  // (host byte order)
    int stage = 0;           // 0 read hello, 1 write hello, 2 read proof, 3 write verdict
    std::array<std::byte, std::max(sizeof(ring_hello), sizeof(ring_verdict))> buf{};
    std::size_t done = 0, want = sizeof(ring_hello);
    ring_hello theirs{};
    ring_hello ours{};
  };
  std::vector<pending> conns;
  bool wrong_proof = false;
  const auto evict = [&conns] {  // the oldest that has not greeted as the left neighbour, else the oldest
    const auto it = std::find_if(conns.begin(), conns.end(), [](const pending& c) { return c.stage == 0; });
    conns.erase(it != conns.end() ? it : conns.begin());
  };
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
        const auto binding = connection_binding(plan.binding, c.local, c.port);
        const auto expected =
            ddp::detail::peer_proof(*plan.secret, binding, left, plan.index, c.theirs.nonce, c.ours.nonce);
        ring_verdict v{};
        if (ddp::detail::constant_time_equal(expected, got)) {
          v.outcome = ring_verdict::accepted;
          v.proof = ddp::detail::peer_proof(*plan.secret, binding, plan.index, left, c.ours.nonce, c.theirs.nonce);
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
            evict();  // frees a descriptor for the next try
          } else if (err == EBADF || err == EINVAL || err == ENOTSOCK) {
            fail_errno(ctx, "accept while waiting for " + who, err);
          }
          break;  // EAGAIN, or a network error of one connection (accept(2)): the next poll retries
        }
        sockaddr_in local{};
        socklen_t len = sizeof local;
        if (::getsockname(s.get(), reinterpret_cast<sockaddr*>(&local), &len) != 0) continue;  // drops it
        detail::tune(s.get());
        if (conns.size() == max_pending) evict();
        pending c;
        c.s = std::move(s);
        c.local = ipv4{local.sin_addr.s_addr};
        c.port = ntohs(local.sin_port);
        c.until = std::min(deadline, clock::now() + greeting_timeout);
        conns.push_back(std::move(c));
      }
    }
  }
}

}  // namespace detail
}  // namespace ddp::net
