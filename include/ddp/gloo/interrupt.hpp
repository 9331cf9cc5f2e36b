#pragma once
/// @file gloo/interrupt.hpp
/// @brief Seeing and acting on the sockets under a gloo context: is a connection broken, and
/// wake a collective blocked in another thread.
///
/// gloo has no way to cancel a running collective, and neither closing its connections nor a
/// failed pair wakes every wait; shutting the sockets down does. gloo does not expose its
/// descriptors, so they are found by their local addresses (/proc/self/fd). Why, what was
/// measured and the descriptor race: docs/backends-gloo.md ("How the quick detection works").

#include <dirent.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include <gloo/context.h>
#include <gloo/transport/pair.h>
#include <gloo/transport/tcp/address.h>

namespace ddp::gloo::detail {

[[nodiscard]] inline bool same_endpoint(const sockaddr_storage& a, const sockaddr_storage& b) noexcept {
  if (a.ss_family != b.ss_family) return false;
  // Copies, not casts: sockaddr_storage is only layout-compatible with the concrete types.
  if (a.ss_family == AF_INET) {
    sockaddr_in x{}, y{};
    std::memcpy(&x, &a, sizeof(x));
    std::memcpy(&y, &b, sizeof(y));
    return x.sin_port == y.sin_port && x.sin_addr.s_addr == y.sin_addr.s_addr;
  }
  if (a.ss_family == AF_INET6) {
    sockaddr_in6 x{}, y{};
    std::memcpy(&x, &a, sizeof(x));
    std::memcpy(&y, &b, sizeof(y));
    return x.sin6_port == y.sin6_port && std::memcmp(&x.sin6_addr, &y.sin6_addr, sizeof(x.sin6_addr)) == 0;
  }
  return false;
}

/// Local addresses of `ctx`'s connections (a connected context); empty if unknown.
[[nodiscard]] inline std::vector<sockaddr_storage> connection_addresses(::gloo::Context& ctx) noexcept {
  std::vector<sockaddr_storage> mine;
  try {
    for (int peer = 0; peer < ctx.size; ++peer) {
      if (peer == ctx.rank) continue;
      auto& pair = ctx.getPair(peer);
      if (!pair) continue;
      const auto* addr = dynamic_cast<const ::gloo::transport::tcp::Address*>(&pair->address());
      if (addr != nullptr) mine.push_back(addr->getSockaddr());
    }
  } catch (...) {  // getPair throws for a context that never connected
    mine.clear();
  }
  return mine;
}

/// Calls `fn(fd, index)` for every socket of this process whose local address is
/// `addresses[index]`. Returns false if /proc/self/fd cannot be read.
template <class F>
bool for_each_socket_of(const std::vector<sockaddr_storage>& addresses, F&& fn) noexcept {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return false;
  while (const dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] < '0' || entry->d_name[0] > '9') continue;
    const int fd = std::atoi(entry->d_name);
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) != 0) continue;
    for (std::size_t i = 0; i < addresses.size(); ++i) {
      if (same_endpoint(addresses[i], local)) {
        fn(fd, i);
        break;
      }
    }
  }
  ::closedir(dir);
  return true;
}

/// Shuts down the sockets of `ctx`'s connections. Returns how many.
inline int shutdown_connections(::gloo::Context& ctx) noexcept {
  const auto mine = connection_addresses(ctx);
  if (mine.empty()) return 0;
  int n = 0;
  for_each_socket_of(mine, [&](int fd, std::size_t) {
    ::shutdown(fd, SHUT_RDWR);
    ++n;
  });
  return n;
}

/// True if one of `ctx`'s connections is gone or no longer established (the peer closed or
/// reset it, or gloo closed it after an error). False when this cannot be told.
[[nodiscard]] inline bool connections_broken(const std::vector<sockaddr_storage>& addresses) noexcept {
  if (addresses.empty()) return false;
  std::vector<bool> healthy(addresses.size(), false);
  const bool readable = for_each_socket_of(addresses, [&](int fd, std::size_t i) {
    tcp_info info{};
    socklen_t len = sizeof(info);
    if (::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) == 0 && info.tcpi_state == TCP_ESTABLISHED) {
      healthy[i] = true;
    }
  });
  if (!readable) return false;
  for (bool h : healthy) {
    if (!h) return true;
  }
  return false;
}

}  // namespace ddp::gloo::detail
