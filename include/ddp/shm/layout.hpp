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

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include <ddp/error.hpp>

namespace ddp::shm {

/// Spacing of independently written words (two 64-byte lines).
inline constexpr std::size_t line_bytes = 128;
/// Alignment of every region of the segment.
inline constexpr std::size_t page_bytes = 4096;

/// `n` rounded up to a multiple of `to` (unchecked: callers keep n well below SIZE_MAX).
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
  /// Lays out a segment for `node_size` ranks. `rank` names the caller in errors.
  /// @throws usage_error naming the option when a size is not positive or the segment would not
  /// fit in memory (the arithmetic is checked: a huge value never wraps into a small layout)
  segment_layout(int node_size, std::size_t chunk_bytes, std::size_t arena_bytes, int rank = -1)
      : node_size_(node_size) {
    if (node_size < 1) {
      throw usage_error(rank, "shm::communicator set-up",
                        "a node needs at least one rank, got node_size " + std::to_string(node_size));
    }
    const auto n = static_cast<std::size_t>(node_size_);
    const auto overflow = [&](const char* what) {
      return usage_error(rank, "shm::communicator set-up",
                         std::string(what) + " is too large: the segment for " + std::to_string(node_size) +
                             " ranks with chunk_bytes " + std::to_string(chunk_bytes) + " and arena_bytes " +
                             std::to_string(arena_bytes) + " would exceed " + std::to_string(max_total_bytes) +
                             " bytes");
    };
    const auto need = [&](std::optional<std::size_t> v, const char* what) {
      if (!v) throw overflow(what);
      return *v;
    };
    chunk_ = need(page_up(std::max(chunk_bytes, page_bytes)), "options::chunk_bytes");
    arena_ = need(page_up(arena_bytes), "options::arena_bytes");
    control_ = round_up(sizeof(segment_header), page_bytes);
    // n <= INT_MAX and a control record is small: n * sizeof(rank_control) cannot wrap on 64 bits.
    staging_ = need(page_up(control_ + n * sizeof(rank_control)), "the node size");
    arena_offset_ = need(add(staging_, mul(n * 2, chunk_)), "options::chunk_bytes");
    total_ = need(add(arena_offset_, mul(n, arena_)), "options::arena_bytes");
  }

  /// Largest segment a layout describes: offsets stay valid pointer differences and off_t sizes.
  static constexpr std::size_t max_total_bytes = std::size_t{1} << 62;

  /// Ranks of the node.
  [[nodiscard]] int node_size() const noexcept { return node_size_; }
  /// Bytes of one staging slot (options::chunk_bytes rounded up to pages).
  [[nodiscard]] std::size_t chunk_bytes() const noexcept { return chunk_; }
  /// Bytes of one rank's arena (options::arena_bytes rounded up to pages).
  [[nodiscard]] std::size_t arena_bytes() const noexcept { return arena_; }
  /// Bytes of the whole segment (at most max_total_bytes).
  [[nodiscard]] std::size_t total_bytes() const noexcept { return total_; }

  /// Offset of node rank q's control record.
  [[nodiscard]] std::size_t control(int q) const noexcept {
    return control_ + static_cast<std::size_t>(q) * sizeof(rank_control);
  }
  /// Staging slot `parity` (0/1) of node rank q.
  [[nodiscard]] std::size_t slot(int q, std::size_t parity) const noexcept {
    return staging_ + (static_cast<std::size_t>(q) * 2 + parity) * chunk_;
  }
  /// Start of node rank q's arena.
  [[nodiscard]] std::size_t arena(int q) const noexcept { return arena_offset_ + static_cast<std::size_t>(q) * arena_; }

  /// True if `bytes` bytes at segment offset `offset` are node rank q's own memory, where a
  /// chunk descriptor q published for slot `parity` may point: exactly that staging slot, or
  /// inside q's arena (a zero-copy tensor). Peer descriptors pass this before any access, so a
  /// version-skewed or corrupt peer is an error, not a read outside the segment. A few compares.
  [[nodiscard]] bool in_own_region(int q, std::size_t parity, std::uint64_t offset, std::size_t bytes) const noexcept {
    if (offset == slot(q, parity)) return bytes <= chunk_;
    const std::size_t a = arena(q);
    return offset >= a && offset - a <= arena_ && bytes <= arena_ - static_cast<std::size_t>(offset - a);
  }

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
  // Checked arithmetic: nullopt past max_total_bytes (which also catches every wrap).
  [[nodiscard]] static std::optional<std::size_t> page_up(std::size_t n) noexcept {
    if (n > max_total_bytes) return std::nullopt;
    return round_up(n, page_bytes);
  }
  [[nodiscard]] static std::optional<std::size_t> mul(std::size_t a, std::size_t b) noexcept {
    std::size_t r = 0;
    if (__builtin_mul_overflow(a, b, &r) || r > max_total_bytes) return std::nullopt;
    return r;
  }
  [[nodiscard]] static std::optional<std::size_t> add(std::size_t a, std::optional<std::size_t> b) noexcept {
    if (!b || a > max_total_bytes || *b > max_total_bytes - a) return std::nullopt;
    return a + *b;
  }

  int node_size_ = 1;
  std::size_t chunk_ = page_bytes;
  std::size_t arena_ = 0;
  std::size_t control_ = 0;
  std::size_t staging_ = 0;
  std::size_t arena_offset_ = 0;
  std::size_t total_ = 0;
};

}  // namespace ddp::shm
