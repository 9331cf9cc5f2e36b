#pragma once
/// @file net/route.hpp
/// @brief `ddp::net::local_address_toward`: the address of this host that its routing table uses
/// to reach another host, the one to listen on and advertise when a communicator spans hosts
/// (gloo's `options::hostname` defaults to loopback: docs/launching.md, "Rank and size without MPI").

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include <ddp/error.hpp>

namespace ddp::net {

/// The IPv4 address of this host on the route to `host` (a name or dotted address; `port` only
/// picks among equal routes): a UDP socket is connected to it and its local name read, so no
/// packet is sent. Loopback exactly when `host` is this host.
/// @throws usage_error naming `host` when it does not resolve or no route reaches it
[[nodiscard]] inline std::string local_address_toward(const std::string& host, int port = 9, int rank = -1) {
  const char* const op = "net::local_address_toward";
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found); rc != 0) {
    throw usage_error(rank, op, "cannot resolve '" + host + "': " + ::gai_strerror(rc));
  }
  std::string why = "no IPv4 address";
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      why = std::string("socket: ") + std::strerror(errno);
      continue;
    }
    sockaddr_in local{};
    socklen_t len = sizeof(local);
    const bool ok = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
                    ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
    if (!ok) why = std::string("no route: ") + std::strerror(errno);
    ::close(fd);
    if (ok) {
      ::freeaddrinfo(found);
      char text[INET_ADDRSTRLEN] = {};
      ::inet_ntop(AF_INET, &local.sin_addr, text, sizeof(text));
      return text;
    }
  }
  ::freeaddrinfo(found);
  throw usage_error(rank, op, "no local address reaches '" + host + "' (" + why + ")");
}

}  // namespace ddp::net
