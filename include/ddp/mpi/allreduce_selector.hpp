#pragma once
/// @file mpi/allreduce_selector.hpp
/// @brief `ddp::mpi::allreduce_selector`: the one place that maps an allreduce's size and rank
/// count to the algorithm `ddp::mpi::communicator` runs (`ddp::mpi::algorithm`). Plain C++, no
/// MPI: a program or a test can ask it what a call would run. Why these algorithms and these
/// defaults: docs/allreduce-model.md.

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <limits>
#include <ostream>
#include <string_view>

namespace ddp::mpi {

/// The algorithms `ddp::mpi::communicator` runs an allreduce region (one dtype group) with.
enum class algorithm : std::uint8_t {
  recursive_doubling,  ///< ddp's own: `log2 P` exchanges of the whole message (recursive_doubling.hpp)
  halving_doubling,    ///< ddp's own: Rabenseifner's reduce-scatter and allgather (halving_doubling.hpp)
  ring,                ///< ddp's own: reduce-scatter and allgather around the ranks (ring_allreduce.hpp)
  mpi_iallreduce,      ///< MPI's own `MPI_Iallreduce`, in place (in chunks of at most INT_MAX elements)
};

/// The algorithm's name, e.g. "recursive doubling".
[[nodiscard]] constexpr std::string_view name_of(algorithm a) noexcept {
  constexpr std::string_view names[] = {"recursive doubling", "halving-doubling", "ring", "MPI_Iallreduce"};
  const auto i = static_cast<std::size_t>(a);
  return i < std::size(names) ? names[i] : "?";
}

/// Prints `name_of(a)`.
inline std::ostream& operator<<(std::ostream& os, algorithm a) { return os << name_of(a); }

/// Maps an allreduce region's size in bytes and the rank count to an `algorithm`, by three
/// thresholds (the defaults are today's measured ones, not the cost model of
/// allreduce_model.hpp, which only benchmarks consult):
///
/// 1. on one rank: `mpi_iallreduce` (nothing to exchange);
/// 2. from `ring_threshold(ranks)` = `ring_min_bytes * (ranks - 1)` bytes up: `ring`;
/// 3. below `recursive_doubling_max_bytes`: `recursive_doubling`;
/// 4. below `halving_doubling_max_bytes`: `halving_doubling` (with the defaults, only on 3+ ranks:
///    on 2 the ring starts where recursive doubling stops);
/// 5. otherwise `mpi_iallreduce`.
///
/// ddp's point-to-point algorithms other than the ring send a region in one message, so they
/// never take a region of INT_MAX bytes or more. Every rank must select the same algorithm: the
/// selector must be the same on every rank, like the calls themselves.
/// @code
/// const ddp::mpi::allreduce_selector pick{.recursive_doubling_max_bytes = 0};
/// assert(pick(1024, 4) == ddp::mpi::algorithm::halving_doubling);
/// @endcode
struct allreduce_selector {
  /// Value of a threshold that never triggers: `ring_min_bytes = never` disables the ring,
  /// `halving_doubling_max_bytes = never` bounds halving-doubling only by the ring's threshold.
  static constexpr std::size_t never = std::numeric_limits<std::size_t>::max();

  /// Regions of at least `ring_min_bytes * (ranks - 1)` bytes run the ring (the threshold grows
  /// with the ranks because the ring's latency does: `2 (ranks - 1)` steps). 0: always the ring
  /// (on 2+ ranks); `never`: never.
  std::size_t ring_min_bytes = std::size_t{4} << 10;
  /// Regions below this many bytes (and below the ring's threshold) run recursive doubling. 0: never.
  std::size_t recursive_doubling_max_bytes = std::size_t{4} << 10;
  /// Regions from recursive doubling's limit up to below this many bytes (and below the ring's
  /// threshold) run halving-doubling. 0: never.
  std::size_t halving_doubling_max_bytes = never;

  /// The size from which a region runs the ring on `ranks` ranks; `never` on one rank, if
  /// `ring_min_bytes` is `never`, or if the product overflows.
  [[nodiscard]] constexpr std::size_t ring_threshold(int ranks) const noexcept {
    if (ranks < 2 || ring_min_bytes == never) return never;
    const auto peers = static_cast<std::size_t>(ranks - 1);
    if (ring_min_bytes > never / peers) return never;
    return ring_min_bytes * peers;
  }

  /// The algorithm for a region of `bytes` bytes (> 0) over `ranks` ranks.
  [[nodiscard]] constexpr algorithm operator()(std::size_t bytes, int ranks) const noexcept {
    if (ranks < 2) return algorithm::mpi_iallreduce;
    const std::size_t ring_from = ring_threshold(ranks);
    if (bytes >= ring_from) return algorithm::ring;
    // One message of `bytes` bytes: below INT_MAX (MPI counts are ints).
    const std::size_t one_message = std::min(ring_from, std::size_t{INT_MAX});
    if (bytes < std::min(recursive_doubling_max_bytes, one_message)) return algorithm::recursive_doubling;
    if (bytes < std::min(halving_doubling_max_bytes, one_message)) return algorithm::halving_doubling;
    return algorithm::mpi_iallreduce;
  }

  /// Member-wise equality.
  friend constexpr bool operator==(const allreduce_selector&, const allreduce_selector&) = default;
};

}  // namespace ddp::mpi
