#pragma once
/// @file gloo/interrupt.hpp
/// @brief Wakes a gloo collective blocked in another thread, for `abort()`.
///
/// gloo has no way to cancel a running collective: closing the context's connections
/// (`closeConnections`) does not wake a thread waiting for data; it waits for its full timeout
/// (measured here: 2 s timeout, abort after 0.3 s, woken at 2.0 s). What does wake it is its
/// connection failing: gloo's I/O thread sees end-of-file and fails every operation on the
/// pair, exactly as when a peer dies. So abort shuts the connections' sockets down (shutdown(2),
/// not close(2): the descriptors stay gloo's to close, nothing can be reused under it) and gloo
/// reports the failure on its own thread (measured: woken in < 1 ms). Peers see the connection
/// end at the same moment and fail their pending operations instead of waiting for a timeout.
///
/// gloo does not expose its descriptors. A connected pair's address() is its socket's local
/// address, and each connection has its own local port, so the sockets are found by matching
/// the local addresses of this process's descriptors (/proc/self/fd). Without /proc, nothing
/// happens and the running collective ends at its timeout instead.

#include <dirent.h>
#include <netinet/in.h>
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

/// Shuts down the sockets of `ctx`'s connections (a connected context). Returns how many.
inline int shutdown_connections(::gloo::Context& ctx) noexcept {
  try {
    std::vector<sockaddr_storage> mine;
    for (int peer = 0; peer < ctx.size; ++peer) {
      if (peer == ctx.rank) continue;
      auto& pair = ctx.getPair(peer);
      if (!pair) continue;
      const auto* addr = dynamic_cast<const ::gloo::transport::tcp::Address*>(&pair->address());
      if (addr != nullptr) mine.push_back(addr->getSockaddr());
    }
    if (mine.empty()) return 0;
    DIR* dir = ::opendir("/proc/self/fd");
    if (dir == nullptr) return 0;
    int n = 0;
    while (const dirent* entry = ::readdir(dir)) {
      if (entry->d_name[0] < '0' || entry->d_name[0] > '9') continue;
      const int fd = std::atoi(entry->d_name);
      struct stat st {};
      if (::fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
      sockaddr_storage local{};
      socklen_t len = sizeof(local);
      if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) != 0) continue;
      for (const auto& m : mine) {
        if (same_endpoint(m, local)) {
          ::shutdown(fd, SHUT_RDWR);
          ++n;
          break;
        }
      }
    }
    ::closedir(dir);
    return n;
  } catch (...) {  // getPair throws for a context that never connected: nothing to interrupt
    return 0;
  }
}

}  // namespace ddp::gloo::detail
