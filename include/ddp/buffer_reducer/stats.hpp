#pragma once
/// @file buffer_reducer/stats.hpp
/// @brief What a `BufferReducer` (ddp/buffer_reducer.hpp) reports about itself: its counters
/// (`buffer_reducer_stats`) and its groups once built (`buffer_group_info`).

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include <ddp/device.hpp>
#include <ddp/dtype.hpp>

namespace ddp {

/// What a `BufferReducer` did. Collective counts exclude `build()`'s one-time layout check.
struct buffer_reducer_stats {
  std::size_t buffers = 0;  ///< registered buffers
  std::size_t groups = 0;   ///< groups (strategy, dtype, device), known once built
  std::size_t collectives_per_sync =
      0;                    ///< collectives a communicating sync issues: one per group whose strategy communicates
  std::uint64_t syncs = 0;  ///< `sync()` / `sync_async()` calls
  std::uint64_t communicating_syncs = 0;  ///< of those, the calls that communicated (the period skips the others)
  std::uint64_t shadowed_syncs = 0;       ///< syncs mirrored by the join hook after this rank ran out of data
  std::uint64_t collectives = 0;          ///< collectives issued by syncs and join hooks, in total
  std::size_t last_sync_collectives = 0;  ///< collectives issued by the last communicating (or shadowed) sync
  std::uint64_t bytes_communicated = 0;   ///< bytes handed to those collectives
  std::uint64_t bytes_copied = 0;         ///< bytes the copy path packed and unpacked (0 on the view path)

  /// Memberwise.
  friend bool operator==(const buffer_reducer_stats&, const buffer_reducer_stats&) = default;
  /// Every field, as "{buffers=..., groups=..., ...}".
  friend std::ostream& operator<<(std::ostream& os, const buffer_reducer_stats& s) {
    return os << "{buffers=" << s.buffers << ", groups=" << s.groups
              << ", collectives_per_sync=" << s.collectives_per_sync << ", syncs=" << s.syncs
              << ", communicating_syncs=" << s.communicating_syncs << ", shadowed_syncs=" << s.shadowed_syncs
              << ", collectives=" << s.collectives << ", last_sync_collectives=" << s.last_sync_collectives
              << ", bytes_communicated=" << s.bytes_communicated << ", bytes_copied=" << s.bytes_copied << "}";
  }
};

/// One group of a built reducer, for introspection and logs.
struct buffer_group_info {
  std::string strategy;                ///< the strategy's name()
  ddp::dtype type = dtype::f32;        ///< dtype of every buffer of the group
  ddp::device where = device::host();  ///< device of every buffer of the group
  std::vector<std::size_t> buffers;    ///< registration indices
  std::size_t count = 0;               ///< elements over the group
  bool flat = false;                   ///< the collective runs on the reducer's flat storage
  bool copies = false;                 ///< some buffers are packed and unpacked around the collective
  bool communicates = true;            ///< the strategy issues a collective
};

}  // namespace ddp
