// Across test hosts (one rank per host): ddp::launch_env reads the rank and size Open MPI gave, and
// ddp::net::local_address_toward(another host's address) is this host's own address on the test
// network, never loopback: the address a gloo communicator across hosts should listen on.
// Prints "route: ok" on every rank when every check held.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <mpi.h>
#include <net/if.h>
#include <netinet/in.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <ddp/launch_env.hpp>
#include <ddp/net/route.hpp>

namespace {

// This host's address on its test-host link (eth0 in the host's namespace); "" if none.
std::string own_address() {
  ifaddrs* all = nullptr;
  if (::getifaddrs(&all) != 0) return {};
  std::string out;
  for (const ifaddrs* i = all; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET || (i->ifa_flags & IFF_LOOPBACK) != 0) continue;
    char text[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr, text, sizeof(text));
    out = text;
    break;
  }
  ::freeifaddrs(all);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int failures = 0;
  const auto fail = [&](const std::string& what) {
    std::printf("rank %d: FAIL: %s\n", rank, what.c_str());
    ++failures;
  };
  try {
    const auto env = ddp::launch_env::detect();
    if (!env || env->launcher != "openmpi" || env->rank != rank || env->size != size) {
      fail("launch_env does not match MPI's rank and size");
    }
    const std::string own = own_address();
    if (own.empty()) fail("no non-loopback address on this host");
    std::vector<char> all(static_cast<std::size_t>(size) * INET_ADDRSTRLEN, '\0');
    std::vector<char> mine(INET_ADDRSTRLEN, '\0');
    std::strncpy(mine.data(), own.c_str(), INET_ADDRSTRLEN - 1);
    MPI_Allgather(mine.data(), INET_ADDRSTRLEN, MPI_CHAR, all.data(), INET_ADDRSTRLEN, MPI_CHAR, MPI_COMM_WORLD);
    for (int r = 0; r < size; ++r) {
      const std::string peer(all.data() + static_cast<std::size_t>(r) * INET_ADDRSTRLEN);
      if (r == rank || peer.empty()) continue;
      if (peer == own) fail("rank " + std::to_string(r) + " has the same address " + own + ": not another host");
      const std::string toward = ddp::net::local_address_toward(peer);
      if (toward != own) fail("toward rank " + std::to_string(r) + " (" + peer + "): " + toward + ", expected " + own);
    }
  } catch (const std::exception& e) {
    fail(e.what());
  }
  int total = 0;
  MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (total == 0) std::printf("rank %d: route: ok\n", rank);
  MPI_Finalize();
  return total == 0 ? 0 : 1;
}
