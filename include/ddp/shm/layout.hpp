#pragma once
/// @file shm/layout.hpp
/// @brief `segment_layout`: where everything lives in a node's segment, and the control records
/// the ranks synchronise through.
///
/// ```
/// offset 0            segment_header      config (checked by every rank) + abort flag
/// control_offset      rank_control x L    per node rank: 3 progress counters + 2 chunk descriptors
/// staging_offset      2 x chunk x L       per node rank: double-buffered staging slots
/// arena_offset        arena x L           per node rank: zero-copy buffers (allocate())
/// ```
/// Every counter has its own 128-byte line (one writer each; 128 because adjacent-line
/// prefetchers fetch 64-byte lines in pairs), and every region starts on a page.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include <ddp/error.hpp>

namespace ddp::shm {

/// Spacing of independently written words (two 64-byte lines).
inline constexpr std::size_t line_bytes = 128;
inline constexpr std::size_t page_bytes = 4096;

[[nodiscard]] constexpr std::size_t round_up(std::size_t n, std::size_t to) noexcept { return (n + to - 1) / to * to; }

/// What a rank published about one chunk: where its data is and which operation it belongs to.
/// Written with plain stores, then published by a release store of `rank_control::staged`.
struct chunk_descriptor {
  std::uint64_t offset = 0;  ///< segment offset of this rank's chunk data
  std::uint64_t op_seq = 0;  ///< the communicator's allreduce sequence number
  std::uint64_t first = 0;   ///< first element of the chunk within its dtype group
  std::uint64_t count = 0;   ///< elements in the chunk
  std::uint64_t total = 0;   ///< elements in the dtype group
  std::uint32_t type = 0;    ///< ddp::dtype
  std::uint32_t op = 0;      ///< ddp::reduce_op
  std::uint32_t phase = 0;   ///< node_phase
  std::uint32_t group = 0;   ///< index of the dtype group within the call
  std::uint64_t scale = 0;   ///< bits of the pre-multiplication factor (0: none)
};

/// One rank's control record. Counters hold "chunks done + 1" in the node's global chunk
/// sequence (0: none yet); each is written by its rank only, through std::atomic_ref.
struct rank_control {
  alignas(line_bytes) std::uint64_t staged;      ///< chunk g's input is in place (and described)
  alignas(line_bytes) std::uint64_t reduced;     ///< this rank's slice of chunk g is reduced
  alignas(line_bytes) std::uint64_t copied;      ///< this rank finished reading chunk g everywhere
  alignas(line_bytes) chunk_descriptor desc[2];  ///< by chunk parity (double buffering)
};

/// Fixed-size header at offset 0.
struct segment_header {
  static constexpr std::uint64_t magic_value = 0x6464702d73686d31ull;  // "ddp-shm1"
  std::uint64_t magic;
  std::uint64_t node_size;
  std::uint64_t chunk_bytes;
  std::uint64_t arena_bytes;
  std::uint64_t total_bytes;
  alignas(line_bytes) std::uint32_t aborted_by;  ///< 0, or node rank + 1 of the first rank that aborted
  std::uint32_t abort_reason;                    ///< 1: abort(), 2: a collective failed on that rank
};

static_assert(std::atomic_ref<std::uint64_t>::is_always_lock_free,
              "cross-process synchronisation needs address-free, lock-free 64-bit atomics");
static_assert(std::atomic_ref<std::uint32_t>::is_always_lock_free);

/// Offsets of a node's segment for `node_size` ranks.
class segment_layout {
 public:
  segment_layout() = default;
  segment_layout(int node_size, std::size_t chunk_bytes, std::size_t arena_bytes)
      : node_size_(node_size),
        chunk_(round_up(chunk_bytes < page_bytes ? page_bytes : chunk_bytes, page_bytes)),
        arena_(round_up(arena_bytes, page_bytes)) {
    const auto n = static_cast<std::size_t>(node_size_);
    control_ = round_up(sizeof(segment_header), page_bytes);
    staging_ = round_up(control_ + n * sizeof(rank_control), page_bytes);
    arena_offset_ = staging_ + n * 2 * chunk_;
    total_ = arena_offset_ + n * arena_;
  }

  [[nodiscard]] int node_size() const noexcept { return node_size_; }
  [[nodiscard]] std::size_t chunk_bytes() const noexcept { return chunk_; }
  [[nodiscard]] std::size_t arena_bytes() const noexcept { return arena_; }
  [[nodiscard]] std::size_t total_bytes() const noexcept { return total_; }

  [[nodiscard]] std::size_t control(int q) const noexcept {
    return control_ + static_cast<std::size_t>(q) * sizeof(rank_control);
  }
  /// Staging slot `parity` (0/1) of node rank q.
  [[nodiscard]] std::size_t slot(int q, std::size_t parity) const noexcept {
    return staging_ + (static_cast<std::size_t>(q) * 2 + parity) * chunk_;
  }
  [[nodiscard]] std::size_t arena(int q) const noexcept { return arena_offset_ + static_cast<std::size_t>(q) * arena_; }

  /// Writes the header of a fresh (zeroed) segment. Called by the rank that created it, before
  /// the others map it.
  void initialise(std::byte* base) const noexcept {
    auto* h = reinterpret_cast<segment_header*>(base);
    h->magic = segment_header::magic_value;
    h->node_size = static_cast<std::uint64_t>(node_size_);
    h->chunk_bytes = chunk_;
    h->arena_bytes = arena_;
    h->total_bytes = total_;
  }

  /// Checks that the mapped segment was laid out for the same configuration as this rank's.
  /// @throws usage_error naming both configurations
  void check(std::byte* base, int rank) const {
    const auto* h = reinterpret_cast<const segment_header*>(base);
    if (h->magic != segment_header::magic_value || h->node_size != static_cast<std::uint64_t>(node_size_) ||
        h->chunk_bytes != chunk_ || h->arena_bytes != arena_ || h->total_bytes != total_) {
      throw usage_error(rank, "shm::communicator set-up",
                        "the node's segment was created for " + std::to_string(h->node_size) + " ranks, chunk " +
                            std::to_string(h->chunk_bytes) + " B, arena " + std::to_string(h->arena_bytes) +
                            " B; this rank expects " + std::to_string(node_size_) + " ranks, chunk " +
                            std::to_string(chunk_) + " B, arena " + std::to_string(arena_) +
                            " B (every rank must pass the same options)");
    }
  }

 private:
  int node_size_ = 1;
  std::size_t chunk_ = page_bytes;
  std::size_t arena_ = 0;
  std::size_t control_ = 0;
  std::size_t staging_ = 0;
  std::size_t arena_offset_ = 0;
  std::size_t total_ = 0;
};

}  // namespace ddp::shm
