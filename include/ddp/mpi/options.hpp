#pragma once
/// @file mpi/options.hpp
/// @brief `options` of an MPI communicator (designated initialisers, printable, comparable).

#include <chrono>
#include <cstddef>
#include <optional>
#include <ostream>

#include <ddp/mpi/allreduce_selector.hpp>
#include <ddp/mpi/thread_level.hpp>
#include <ddp/work.hpp>

namespace ddp::mpi {

/// Knobs of `ddp::mpi::communicator`.
/// @code
/// auto comm = ddp::mpi::communicator::world({.timeout = std::chrono::seconds(30)});
/// @endcode
struct options {
  /// Deadline of every blocking wait on this communicator's work.
  std::chrono::milliseconds timeout = default_timeout;

  /// Use at most this thread level even if MPI provides more. `serialized` makes the
  /// communicator lock around its MPI calls. Default: the level MPI provides.
  std::optional<thread_level> max_thread_level{};

  /// The three thresholds of `selector()`, the `allreduce_selector` that picks the algorithm of
  /// every allreduce region (per dtype group) by its size and the rank count; the rules and the
  /// defaults are documented there (mpi/allreduce_selector.hpp). Kept here, flat, so that
  /// designated initialisers such as `{.recursive_doubling_max_bytes = 0}` keep working.
  ///
  /// Regions of at least `ring_min_bytes * (ranks - 1)` bytes run ddp's ring (reduce-scatter then
  /// allgather over MPI_Isend/MPI_Irecv) instead of MPI_Iallreduce. Why: Open MPI 4.1's
  /// non-blocking allreduce picks a binomial tree for in-place calls on fewer than 4 ranks,
  /// 1.3-2.5x slower than the blocking MPI_Allreduce from 4 KiB up (2 ranks); the ring matches
  /// the blocking call. 0: always the ring (on 2+ ranks); `never`: never the ring. For
  /// MPI_Iallreduce only: `{.ring_min_bytes = never, .recursive_doubling_max_bytes = 0,
  /// .halving_doubling_max_bytes = 0}`.
  std::size_t ring_min_bytes = allreduce_selector{}.ring_min_bytes;

  /// Regions below this many bytes (and below the ring's threshold) run ddp's recursive doubling
  /// (`log2 P` exchanges of the whole message, recursive_doubling.hpp) instead of MPI_Iallreduce,
  /// whose in-place form is a binomial tree in Open MPI 4.1 (twice the latencies). 0: never. The
  /// default is where the model's recursive doubling stops beating the ring for the latency and
  /// summing speed measured here (docs/allreduce-model.md).
  std::size_t recursive_doubling_max_bytes = allreduce_selector{}.recursive_doubling_max_bytes;

  /// Regions from recursive doubling's limit up to below this many bytes (and below the ring's
  /// threshold: with the default thresholds, only on 3+ ranks) run ddp's halving-doubling (a
  /// reduce-scatter by recursive halving, then an allgather by recursive doubling: the ring's bytes
  /// in `2 log2 P` messages; halving_doubling.hpp) instead of MPI_Iallreduce. 0: never.
  std::size_t halving_doubling_max_bytes = allreduce_selector{}.halving_doubling_max_bytes;

  /// Message size of the ring: blocks are sent in segments of this many bytes, and a ring holds
  /// two segments of scratch memory. Clamped to [element size, INT_MAX]. 4 MiB measured best on
  /// 2 ranks from 4 to 16 MiB allreduces (1 MiB segments: 1.1-1.5x slower than MPI_Allreduce).
  std::size_t ring_segment_bytes = std::size_t{4} << 20;

  /// Value of `ring_min_bytes` that disables the ring (`allreduce_selector::never`).
  static constexpr std::size_t never = allreduce_selector::never;

  /// The selector these options make: what `ddp::mpi::communicator` runs each allreduce region with.
  [[nodiscard]] constexpr allreduce_selector selector() const noexcept {
    return {.ring_min_bytes = ring_min_bytes,
            .recursive_doubling_max_bytes = recursive_doubling_max_bytes,
            .halving_doubling_max_bytes = halving_doubling_max_bytes};
  }

  /// Member-wise equality.
  friend bool operator==(const options&, const options&) = default;

  /// Prints every field: `{timeout: 300000 ms, max_thread_level: provided, ...}`.
  friend std::ostream& operator<<(std::ostream& os, const options& o) {
    os << "{timeout: " << o.timeout.count() << " ms, max_thread_level: ";
    if (o.max_thread_level) {
      os << *o.max_thread_level;
    } else {
      os << "provided";
    }
    os << ", ring_min_bytes: ";
    if (o.ring_min_bytes == never) {
      os << "never";
    } else {
      os << o.ring_min_bytes;
    }
    os << ", recursive_doubling_max_bytes: " << o.recursive_doubling_max_bytes << ", halving_doubling_max_bytes: ";
    if (o.halving_doubling_max_bytes == never) {
      os << "unbounded";
    } else {
      os << o.halving_doubling_max_bytes;
    }
    return os << ", ring_segment_bytes: " << o.ring_segment_bytes << "}";
  }
};

}  // namespace ddp::mpi
