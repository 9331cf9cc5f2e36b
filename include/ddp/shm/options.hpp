#pragma once
/// @file shm/options.hpp
/// @brief `options` of a shared-memory communicator (designated initialisers, printable, comparable).

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <ostream>
#include <string>
#include <vector>

#include <ddp/job_secret.hpp>
#include <ddp/work.hpp>

namespace ddp::shm {

/// How node leaders allreduce across nodes, chosen once when the communicator is built.
enum class across_nodes : unsigned char {
  sockets,               ///< ddp's own TCP ring among the leaders (net/ring.hpp): both link directions at once
  leaders_communicator,  ///< the leaders' communicator's allreduce (e.g. ddp::mpi over Open MPI)
};

/// "sockets" or "leaders' communicator".
[[nodiscard]] constexpr const char* name_of(across_nodes a) noexcept {
  return a == across_nodes::sockets ? "sockets" : "leaders' communicator";
}

/// Knobs of `ddp::shm::communicator`. Every rank must pass the same values (checked at set-up).
/// @code
/// ddp::shm::communicator comm(std::move(inner), {.chunk_bytes = 512 << 10, .arena_bytes = 256 << 20});
/// @endcode
struct options {
  /// Pipeline granularity: each rank stages and reduces its data in chunks of this many bytes,
  /// two chunks in flight (double-buffered), so a large allreduce streams through cache instead
  /// of through memory. Rounded up to a multiple of 4 KiB; at least 4 KiB.
  std::size_t chunk_bytes = std::size_t{256} << 10;

  /// Allreduces of at most this many bytes per dtype take one round trip instead of two: every
  /// rank reduces the whole message (same order, same bits) instead of its slice. Capped at
  /// `chunk_bytes`; 0 disables it.
  std::size_t single_phase_bytes = std::size_t{16} << 10;

  /// Bytes of the segment each rank may hand out with `communicator::allocate()` (zero-copy
  /// buffers, e.g. bucket storage). 0: no arena.
  std::size_t arena_bytes = 0;

  /// Deadline of every wait for a peer in shared memory (a dead or stuck peer becomes a
  /// `timeout_error` naming the operation instead of a hang).
  std::chrono::milliseconds timeout = default_timeout;

  /// Busy-wait iterations (with a CPU pause) before a waiting rank starts yielding its core.
  /// Spinning keeps small-message latency low; yielding keeps oversubscribed runs (more ranks
  /// than cores) moving. When a node has more ranks than the machine has online CPUs, waiting
  /// ranks yield at once whatever this says (measured: 3 ranks on 2 cores, 4-byte allreduce
  /// 8 us with spinning, see docs/shm-allreduce.md).
  unsigned spins_before_yield = 256;

  /// Node index of every rank of the wrapped communicator. Empty: detect (ranks on the same
  /// host share a node). Set it to simulate several nodes on one machine, e.g. `{0, 0, 1, 1}`.
  std::vector<int> node_of_rank{};

  /// The inter-node step (with several nodes). `sockets` reaches about the link rate in both
  /// directions where Open MPI's TCP transport moved one direction at a time
  /// (docs/backends-sockets.md); the leaders' communicator still carries every other collective.
  across_nodes inter_node = across_nodes::sockets;

  /// With `sockets`: the interface whose IPv4 addresses the leaders publish (e.g. "eth0"). Empty:
  /// every interface that is up; a peer tries the addresses on its own subnets first.
  std::string socket_interface{};

  /// With `sockets`: the job's secret, which the leaders prove to each other on every ring
  /// connection before any data moves (net/ring_handshake.hpp, docs/security.md). Default:
  /// environment variable DDP_JOB_SECRET, which `scripts/ddp-run` sets; empty (unset) = none.
  /// Every leader needs the same one. Without one, a ring that spans hosts refuses to start
  /// (see `insecure_no_secret`); on one host it greets with a token only.
  job_secret secret = job_secret::from_environment();

  /// With `sockets` and no `secret`: let a ring that spans hosts start unauthenticated. This
  /// allows any host that can reach a leader's ring port to join the ring and read or inject
  /// gradient data. Only for networks that nobody else can reach. False: such a ring refuses to
  /// start with a usage_error on every rank. Every rank must set it for it to apply.
  bool insecure_no_secret = false;

  /// Memberwise (secrets by their bytes). Spelled out because job_secret has no `==`; a new
  /// field must be added here.
  friend bool operator==(const options& a, const options& b) {
    return a.chunk_bytes == b.chunk_bytes && a.single_phase_bytes == b.single_phase_bytes &&
           a.arena_bytes == b.arena_bytes && a.timeout == b.timeout && a.spins_before_yield == b.spins_before_yield &&
           a.node_of_rank == b.node_of_rank && a.inter_node == b.inter_node &&
           a.socket_interface == b.socket_interface && std::ranges::equal(a.secret.bytes(), b.secret.bytes()) &&
           a.insecure_no_secret == b.insecure_no_secret;
  }

  /// Prints every field.
  friend std::ostream& operator<<(std::ostream& os, const options& o) {
    os << "{chunk_bytes: " << o.chunk_bytes << ", single_phase_bytes: " << o.single_phase_bytes
       << ", arena_bytes: " << o.arena_bytes << ", timeout: " << o.timeout.count()
       << " ms, spins_before_yield: " << o.spins_before_yield << ", node_of_rank: ";
    if (o.node_of_rank.empty()) {
      os << "detect";
    } else {
      os << "[";
      for (std::size_t i = 0; i < o.node_of_rank.size(); ++i) os << (i ? ", " : "") << o.node_of_rank[i];
      os << "]";
    }
    os << ", inter_node: " << name_of(o.inter_node);
    if (!o.socket_interface.empty()) os << " on " << o.socket_interface;
    os << ", secret: " << (o.secret.empty() ? "none" : "set");  // never its bytes
    if (o.insecure_no_secret) os << ", insecure_no_secret";
    return os << "}";
  }
};

}  // namespace ddp::shm
