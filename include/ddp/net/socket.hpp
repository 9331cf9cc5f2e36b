#pragma once
/// @file net/socket.hpp
/// @brief TCP plumbing of ddp's own inter-node transport (net/ring.hpp): an owned socket,
/// listeners on given addresses, connecting and accepting with a deadline, a wake-up pipe, and
/// whole-buffer sends and receives that wait in `poll` (never spin) and end in a `ddp::error`
/// naming the rank, the operation and the peer. POSIX (Linux). See docs/backends-sockets.md.

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <ddp/error.hpp>

namespace ddp::net {

/// The clock of every deadline here.
using clock = std::chrono::steady_clock;

/// Who is asking and what for: the rank and operation that errors name.
struct context {
  int rank = -1;          ///< the caller's rank in the job
  std::string operation;  ///< e.g. "allreduce #12 (sum, f32 x 1024)"
};

/// An IPv4 address in network byte order, printable.
struct ipv4 {
  std::uint32_t addr = 0;  ///< network byte order
  /// Dotted quad.
  [[nodiscard]] std::string str() const {
    char buf[INET_ADDRSTRLEN] = {};
    in_addr a{};
    a.s_addr = addr;
    ::inet_ntop(AF_INET, &a, buf, sizeof buf);
    return buf;
  }
};

/// An owned socket descriptor (move-only; closes on destruction).
class socket_fd {
 public:
  socket_fd() = default;
  /// Takes ownership of `fd` (-1: none).
  explicit socket_fd(int fd) noexcept : fd_(fd) {}
  /// Takes over `o`'s descriptor.
  socket_fd(socket_fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  /// Closes this one's descriptor, then takes over `o`'s.
  socket_fd& operator=(socket_fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  socket_fd(const socket_fd&) = delete;
  socket_fd& operator=(const socket_fd&) = delete;
  ~socket_fd() { reset(); }

  /// The descriptor, or -1.
  [[nodiscard]] int get() const noexcept { return fd_; }
  /// True if it holds a descriptor.
  explicit operator bool() const noexcept { return fd_ >= 0; }
  /// Closes it now.
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  /// Ends both directions without closing: a thread blocked in `poll` on it wakes up.
  void shutdown() const noexcept {
    if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
  }

 private:
  int fd_ = -1;
};

namespace detail {

[[noreturn]] inline void fail(const context& ctx, const std::string& what) {
  throw communication_error(ctx.rank, ctx.operation, what);
}

[[noreturn]] inline void fail_errno(const context& ctx, const std::string& what, int err) {
  fail(ctx, what + ": " + std::strerror(err));
}

inline int remaining_ms(clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, 1 << 30));
}

// Waits until `fd` is ready for `events`; throws timeout_error at the deadline. `peer` names the
// other end in errors.
inline void wait_ready(int fd, short events, clock::time_point deadline, const context& ctx, const std::string& peer) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int ms = remaining_ms(deadline);
    const int rc = ::poll(&p, 1, ms);
    if (rc > 0) return;  // ready, or an error/hang-up that the next send/recv reports
    if (rc == 0) {
      throw timeout_error(ctx.rank, ctx.operation, "no progress with " + peer + " before the deadline");
    }
    if (errno != EINTR) fail_errno(ctx, "poll on the connection with " + peer, errno);
  }
}

inline void set_nonblocking(int fd, bool on) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

inline void tune(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // small messages: no Nagle delay
}

}  // namespace detail

/// This host's IPv4 addresses that peers may reach: those of `interface` if it is not empty
/// (e.g. "eth0"), else of every interface that is up (`with_down`: of every interface), loopback
/// last (alone on a machine without another interface, ranks on it still reach each other; the
/// ring dials loopback only when all its members are on one host, net/ring_handshake.hpp).
[[nodiscard]] inline std::vector<ipv4> local_addresses(const std::string& interface = {}, bool with_down = false) {
  std::vector<ipv4> out;
  std::vector<ipv4> loopback;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return out;
  for (ifaddrs* a = list; a; a = a->ifa_next) {
    if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET || (!with_down && !(a->ifa_flags & IFF_UP))) continue;
    if (!interface.empty() && interface != a->ifa_name) continue;
    ipv4 ip{reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr};
    ((a->ifa_flags & IFF_LOOPBACK) ? loopback : out).push_back(ip);
  }
  ::freeifaddrs(list);
  out.insert(out.end(), loopback.begin(), loopback.end());
  return out;
}

/// Listening sockets, one on each of `addrs` (duplicates once), all on one port the kernel picks
/// (`port` returns it), non-blocking. Only those addresses accept connections, not every
/// interface of the host.
[[nodiscard]] inline std::vector<socket_fd> listen_on(const std::vector<ipv4>& addrs, std::uint16_t& port,
                                                      const context& ctx) {
  std::vector<ipv4> unique;
  for (ipv4 a : addrs) {
    if (std::none_of(unique.begin(), unique.end(), [&](ipv4 b) { return b.addr == a.addr; })) unique.push_back(a);
  }
  // The first bind picks the port; another program may hold it on one of the other addresses,
  // so start over (with a new port) a few times.
  for (int attempt = 0;; ++attempt) {
    std::vector<socket_fd> out;
    std::uint16_t picked = 0;
    for (ipv4 at : unique) {
      socket_fd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
      if (!s) detail::fail_errno(ctx, "socket()", errno);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = at.addr;
      a.sin_port = htons(picked);
      if (::bind(s.get(), reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) {
        const int err = errno;
        if (err == EADDRINUSE && picked != 0 && attempt < 16) break;
        detail::fail_errno(ctx, "bind " + at.str() + ":" + std::to_string(picked), err);
      }
      if (::listen(s.get(), 16) != 0) detail::fail_errno(ctx, "listen on " + at.str(), errno);
      if (picked == 0) {
        socklen_t len = sizeof a;
        ::getsockname(s.get(), reinterpret_cast<sockaddr*>(&a), &len);
        picked = ntohs(a.sin_port);
      }
      out.push_back(std::move(s));
    }
    if (out.size() == unique.size()) {
      port = picked;
      return out;
    }
  }
}

/// A pipe that wakes a thread waiting in `poll` on `fd()` (readable once `notify` was called).
class wakeup_pipe {
 public:
  /// @throws communication_error if the pipe cannot be made
  explicit wakeup_pipe(const context& ctx) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) detail::fail_errno(ctx, "pipe2", errno);
    read_ = socket_fd(fds[0]);
    write_ = socket_fd(fds[1]);
  }
  /// Makes `fd()` readable.
  void notify() const noexcept {
    const char one = 1;
    (void)!::write(write_.get(), &one, 1);
  }
  /// The end to poll for POLLIN.
  [[nodiscard]] int fd() const noexcept { return read_.get(); }

 private:
  socket_fd read_, write_;
};

/// Connects to `to:port` before the deadline, retrying a failed attempt every 20 ms (each
/// attempt waits at most 1 s for an answer, so a lost SYN is sent again); an empty socket if `to`
/// cannot be reached by then. `last_error` (if not null) receives why the last attempt failed
/// (ETIMEDOUT: no answer before the deadline; the errno of `socket()` if it failed, which ends the
/// tries). `max_refused` > 0: give up after that many refusals (ECONNREFUSED, ENETUNREACH,
/// EHOSTUNREACH) instead of retrying until the deadline: right for a peer that listened before it
/// published its address, where a refusal means nothing listens there; 0: retry refusals (the
/// peer may not listen yet).
[[nodiscard]] inline socket_fd connect_to(ipv4 to, std::uint16_t port, clock::time_point deadline,
                                          int* last_error = nullptr, int max_refused = 0) {
  int err = ETIMEDOUT;
  int refused = 0;
  while (clock::now() < deadline) {
    socket_fd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!s) {
      err = errno;
      break;
    }
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = to.addr;
    a.sin_port = htons(port);
    detail::set_nonblocking(s.get(), true);
    int e = ::connect(s.get(), reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0 ? 0 : errno;
    if (e == EINPROGRESS) {
      pollfd p{s.get(), POLLOUT, 0};
      const int ms = std::min(detail::remaining_ms(deadline), 1000);
      e = ETIMEDOUT;
      if (::poll(&p, 1, ms) == 1) {
        socklen_t len = sizeof e;
        if (::getsockopt(s.get(), SOL_SOCKET, SO_ERROR, &e, &len) != 0) e = errno;
      }
    }
    if (e == 0) {
      detail::set_nonblocking(s.get(), false);
      detail::tune(s.get());
      return s;
    }
    err = e;
    if ((e == ECONNREFUSED || e == ENETUNREACH || e == EHOSTUNREACH) && max_refused > 0 && ++refused >= max_refused) {
      break;
    }
    ::usleep(static_cast<useconds_t>(std::min(detail::remaining_ms(deadline), 20)) * 1000);
  }
  if (last_error) *last_error = err;
  return {};
}

/// Accepts one connection on `listener` before the deadline; throws timeout_error after it.
[[nodiscard]] inline socket_fd accept_one(const socket_fd& listener, clock::time_point deadline, const context& ctx,
                                          const std::string& expected) {
  for (;;) {
    detail::wait_ready(listener.get(), POLLIN, deadline, ctx, expected);
    socket_fd s(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (s) {
      detail::tune(s.get());
      return s;
    }
    if (errno != EINTR && errno != ECONNABORTED && errno != EAGAIN) detail::fail_errno(ctx, "accept", errno);
  }
}

/// Sends all `bytes` before the deadline. `peer` names the other end in errors.
inline void send_all(const socket_fd& s, const void* data, std::size_t bytes, clock::time_point deadline,
                     const context& ctx, const std::string& peer) {
  const auto* p = static_cast<const std::byte*>(data);
  while (bytes > 0) {
    const ssize_t n = ::send(s.get(), p, bytes, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      bytes -= static_cast<std::size_t>(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      detail::wait_ready(s.get(), POLLOUT, deadline, ctx, peer);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      detail::fail_errno(ctx, "sending to " + peer, n < 0 ? errno : EPIPE);
    }
  }
}

/// Receives exactly `bytes` before the deadline. A connection closed early is a
/// communication_error naming `peer`.
inline void recv_all(const socket_fd& s, void* data, std::size_t bytes, clock::time_point deadline, const context& ctx,
                     const std::string& peer) {
  auto* p = static_cast<std::byte*>(data);
  while (bytes > 0) {
    const ssize_t n = ::recv(s.get(), p, bytes, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      bytes -= static_cast<std::size_t>(n);
    } else if (n == 0) {
      detail::fail(ctx, peer + " closed the connection (its process ended or aborted)");
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      detail::wait_ready(s.get(), POLLIN, deadline, ctx, peer);
    } else if (errno != EINTR) {
      detail::fail_errno(ctx, "receiving from " + peer, errno);
    }
  }
}

}  // namespace ddp::net
