#pragma once
/// @file shm/node_engine.hpp
/// @brief `node_engine`: the chunked reduce-scatter / allgather pipeline through a node's segment,
/// and the reduce-to-leader and broadcast-from-leader variants the hierarchical path uses.
///
/// The chunk pipeline (four phases per chunk, double-buffered slots, monotonic counters), the
/// single-phase path for small groups and the pre-multiplied sum: docs/shm-allreduce.md, sections
/// "Algorithm" and "Synchronisation".

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/reduce_op.hpp>
#include <ddp/shm/kernels.hpp>
#include <ddp/shm/layout.hpp>
#include <ddp/shm/spin_wait.hpp>
#include <ddp/shm/tensor_group.hpp>
#include <ddp/work.hpp>

namespace ddp::shm {

/// What one pass over a group does.
enum class node_phase : std::uint32_t {
  allreduce = 1,         ///< every rank ends with the node's reduction
  reduce_to_leader = 2,  ///< only node rank 0 copies the reduction out
  broadcast = 3,         ///< node rank 0's data to every rank
  allreduce_single = 4,  ///< small allreduce: every rank reduces everything (one round trip)
};

[[nodiscard]] constexpr const char* name_of(node_phase p) noexcept {
  switch (p) {
    case node_phase::allreduce: return "allreduce";
    case node_phase::reduce_to_leader: return "reduce to leader";
    case node_phase::broadcast: return "broadcast";
    case node_phase::allreduce_single: return "single-phase allreduce";
  }
  return "?";
}

/// One rank's side of a node's segment.
class node_engine {
 public:
  /// @param base        this rank's address of the segment
  /// @param node_ranks  rank (in the wrapped communicator) of every node rank, for messages
  /// @param single_phase_bytes  allreduce groups up to this size take the single-phase path
  node_engine(std::byte* base, segment_layout layout, int node_rank, std::vector<int> node_ranks, unsigned spins,
              std::size_t single_phase_bytes)
      : base_(base),
        layout_(layout),
        me_(node_rank),
        size_(layout.node_size()),
        world_(std::move(node_ranks)),
        spins_(spins),
        single_max_(std::min(single_phase_bytes, layout.chunk_bytes())) {}

  [[nodiscard]] int node_rank() const noexcept { return me_; }
  [[nodiscard]] int node_size() const noexcept { return size_; }
  [[nodiscard]] const segment_layout& layout() const noexcept { return layout_; }

  /// Runs `phase` over `group`. `divisor` > 1 divides the result (avg); `scale` != 1 multiplies
  /// every rank's input first (a pre-multiplied sum; floating dtypes only). `info` names the
  /// operation in errors; `deadline` bounds every wait.
  /// @throws timeout_error, communication_error (a peer aborted), mismatch_error (a peer is in
  /// another operation)
  void run(node_phase phase, const tensor_group& group, std::uint32_t group_index, reduce_op op, std::int64_t divisor,
           const op_info& info, clock::time_point deadline, double scale = 1.0) {
    if (!is_floating(group.type) || phase == node_phase::broadcast) scale = 1.0;
    const std::size_t esz = size_of(group.type);
    const std::size_t chunk_elems = layout_.chunk_bytes() / esz;
    if (phase == node_phase::allreduce && group.total * esz <= single_max_) phase = node_phase::allreduce_single;
    // Single-phase peers read a staged copy, so an arena tensor is simply this rank's output
    // there (reading it in place would cost a second round trip before it may be overwritten).
    const bool zero_copy = group.zero_copy_offset.has_value() && phase != node_phase::allreduce_single;
    // A segment a peer gave up on stays unusable, even where this call would not have to wait.
    if (const std::uint32_t by = std::atomic_ref<std::uint32_t>(header()->aborted_by).load(std::memory_order_acquire)) {
      throw_aborted(by, {info, deadline, next_chunk_, scale});
    }
    std::uint64_t last = 0;
    for (std::size_t first = 0; first < group.total; first += chunk_elems) {
      const std::size_t n = std::min(chunk_elems, group.total - first);
      const std::uint64_t g = next_chunk_++;
      last = g;
      chunk_descriptor d;
      d.op_seq = info.seq;
      d.first = first;
      d.count = n;
      d.total = group.total;
      d.type = static_cast<std::uint32_t>(group.type);
      d.op = static_cast<std::uint32_t>(op);
      d.phase = static_cast<std::uint32_t>(phase);
      d.group = group_index;
      d.scale = scale == 1.0 ? 0 : std::bit_cast<std::uint64_t>(scale);
      wait_ctx ctx{info, deadline, g, scale};
      if (g >= 2) wait_all(&rank_control::copied, g - 1, ctx, "release its staging slot");
      if (phase == node_phase::broadcast) {
        broadcast_chunk(group, d, zero_copy, ctx);
      } else if (phase == node_phase::allreduce_single) {
        single_phase_chunk(group, d, divisor, ctx);
      } else {
        reduce_chunk(phase, group, d, zero_copy, divisor, ctx);
      }
    }
    const bool others_read_mine = zero_copy && (phase != node_phase::broadcast || me_ == 0);
    if (others_read_mine && group.total > 0) {
      wait_all(&rank_control::copied, last + 1, {info, deadline, last, scale}, "finish reading this rank's buffer");
    }
  }

  /// Makes every peer's pending and future waits fail (first caller wins). `reason`: 1 abort(),
  /// 2 a collective failed here.
  void abort(std::uint32_t reason) noexcept {
    auto* h = header();
    std::uint32_t none = 0;
    if (std::atomic_ref<std::uint32_t>(h->aborted_by)
            .compare_exchange_strong(none, static_cast<std::uint32_t>(me_ + 1))) {
      std::atomic_ref<std::uint32_t>(h->abort_reason).store(reason, std::memory_order_release);
    }
  }

 private:
  struct wait_ctx {
    const op_info& info;
    clock::time_point deadline;
    std::uint64_t chunk;
    double scale;  // pre-multiplication of every input (1: none)
  };

  [[nodiscard]] segment_header* header() const noexcept { return reinterpret_cast<segment_header*>(base_); }
  [[nodiscard]] rank_control& control(int q) const noexcept {
    return *reinterpret_cast<rank_control*>(base_ + layout_.control(q));
  }
  [[nodiscard]] rank_control& mine() const noexcept { return control(me_); }

  void publish(std::uint64_t rank_control::*field, std::uint64_t value) const noexcept {
    std::atomic_ref<std::uint64_t>(mine().*field).store(value, std::memory_order_release);
  }
  [[nodiscard]] std::uint64_t read(int q, std::uint64_t rank_control::*field) const noexcept {
    return std::atomic_ref<std::uint64_t>(control(q).*field).load(std::memory_order_acquire);
  }

  // Slice of node rank q within a chunk of n elements: equal shares rounded up to whole 64-byte
  // lines, so no two reducers write one cache line.
  [[nodiscard]] std::pair<std::size_t, std::size_t> slice(int q, std::size_t n, std::size_t esz) const noexcept {
    const std::size_t line = std::max<std::size_t>(1, 64 / esz);
    const std::size_t share =
        round_up((n + static_cast<std::size_t>(size_) - 1) / static_cast<std::size_t>(size_), line);
    const std::size_t a = std::min(n, share * static_cast<std::size_t>(q));
    return {a, std::min(n, a + share)};
  }

  void reduce_chunk(node_phase phase, const tensor_group& group, chunk_descriptor& d, bool zero_copy,
                    std::int64_t divisor, const wait_ctx& ctx) {
    const std::size_t esz = size_of(group.type);
    const std::size_t parity = ctx.chunk & 1;
    const std::size_t n = static_cast<std::size_t>(d.count);
    const auto [a, b] = slice(me_, n, esz);
    // This rank's own slice is read (and written) where it is, in its private buffer, a piece per
    // tensor it spans; only the slices the peers reduce are staged.
    if (zero_copy) {
      d.offset = *group.zero_copy_offset + d.first * esz;
    } else {
      d.offset = layout_.slot(me_, parity);
      for (int q = 0; q < size_; ++q) {
        const auto [qa, qb] = slice(q, n, esz);
        if (qb > qa && q != me_) group.copy_out(d.first + qa, qb - qa, base_ + d.offset + qa * esz);
      }
    }
    const void** inputs = exchange_inputs(d, parity, a * esz, ctx);
    // The result goes to the slot (for the peers) and straight into this rank's output.
    const bool output_here = phase == node_phase::allreduce || me_ == 0;
    const auto op = static_cast<reduce_op>(d.op);
    if (zero_copy) {
      detail::reduce_many(group.type, op, base_ + d.offset + a * esz, nullptr, inputs, size_, b - a, divisor,
                          ctx.scale);
    } else {
      const std::size_t first = a;  // a structured binding cannot be captured before clang 16
      group.pieces(d.first + first, b - first, [&](std::byte* own, std::size_t done, std::size_t m) {
        for (int q = 0; q < size_; ++q) {
          inputs[q] = q == me_ ? own : base_ + offsets_[static_cast<std::size_t>(q)] + (first + done) * esz;
        }
        detail::reduce_many(group.type, op, base_ + d.offset + (first + done) * esz, output_here ? own : nullptr,
                            inputs, size_, m, divisor, ctx.scale);
      });
    }
    publish(&rank_control::reduced, ctx.chunk + 1);

    if (output_here) {
      wait_all(&rank_control::reduced, ctx.chunk + 1, ctx, "reduce its slice");
      for (int q = 0; q < size_; ++q) {
        const auto [qa, qb] = slice(q, n, esz);
        if (qb == qa || q == me_) continue;  // this rank's slice: written by its reduction
        const std::byte* src = base_ + offsets_[static_cast<std::size_t>(q)] + qa * esz;
        if (zero_copy) {
          std::memcpy(base_ + d.offset + qa * esz, src, (qb - qa) * esz);
        } else {
          group.copy_in(d.first + qa, qb - qa, src);
        }
      }
    }
    publish(&rank_control::copied, ctx.chunk + 1);
  }

  // The whole (small) group is one chunk: stage it, wait once, reduce all of it locally.
  void single_phase_chunk(const tensor_group& group, chunk_descriptor& d, std::int64_t divisor, const wait_ctx& ctx) {
    const std::size_t esz = size_of(group.type);
    const std::size_t parity = ctx.chunk & 1;
    const std::size_t n = static_cast<std::size_t>(d.count);
    std::byte* own = group.contiguous(0, n);
    d.offset = layout_.slot(me_, parity);
    group.copy_out(0, n, base_ + d.offset);
    const void** inputs = exchange_inputs(d, parity, 0, ctx);
    if (own != nullptr) inputs[me_] = own;  // read in place: the peers read the staged copy
    // Peers read this rank's staged copy, never its tensors: the result goes straight there.
    std::byte* out = own != nullptr ? own : scratch(n * esz);
    detail::reduce_many(group.type, static_cast<reduce_op>(d.op), out, nullptr, inputs, size_, n, divisor, ctx.scale);
    publish(&rank_control::reduced, ctx.chunk + 1);
    publish(&rank_control::copied, ctx.chunk + 1);
    if (own == nullptr) group.copy_in(0, n, out);
  }

  const void** input_table() {
    inputs_.resize(static_cast<std::size_t>(size_));
    offsets_.resize(static_cast<std::size_t>(size_));
    return inputs_.data();
  }

  // Publishes this rank's descriptor `d` of the chunk (its input staged), waits until every node
  // rank did, checks theirs against it, and returns the table of their inputs: each rank's staged
  // chunk from byte `from` on.
  const void** exchange_inputs(const chunk_descriptor& d, std::size_t parity, std::size_t from, const wait_ctx& ctx) {
    mine().desc[parity] = d;
    publish(&rank_control::staged, ctx.chunk + 1);
    wait_all(&rank_control::staged, ctx.chunk + 1, ctx, "stage its input");
    const void** inputs = input_table();
    const std::size_t esz = size_of(static_cast<dtype>(d.type));
    const std::size_t bytes = static_cast<std::size_t>(d.count) * esz;
    for (int q = 0; q < size_; ++q) {
      const chunk_descriptor& dq = control(q).desc[parity];
      check_same(q, dq, d, ctx);
      // Read once, checked, then only the checked copy is used (the peer's record is not re-read).
      offsets_[static_cast<std::size_t>(q)] = checked_offset(q, parity, dq.offset, bytes, esz, ctx);
      inputs[q] = base_ + offsets_[static_cast<std::size_t>(q)] + from;
    }
    return inputs;
  }

  // A peer's data offset, once it is known to lie in that peer's own slot or arena and to be
  // aligned to its elements (`esz`, a power of two), as every honest offset is. A few compares
  // per peer and chunk: the hot path stays as it was.
  [[nodiscard]] std::size_t checked_offset(int q, std::size_t parity, std::uint64_t offset, std::size_t bytes,
                                           std::size_t esz, const wait_ctx& ctx) const {
    if ((offset & (esz - 1)) == 0 && layout_.in_own_region(q, parity, offset, bytes)) {
      return static_cast<std::size_t>(offset);
    }
    throw communication_error(
        ctx.info.rank, ctx.info.describe(),
        "rank " + std::to_string(world_rank(q)) + " (same node) published chunk " + std::to_string(ctx.chunk) +
            " at segment offset " + std::to_string(offset) + " (+" + std::to_string(bytes) +
            " bytes), misaligned or outside its staging slot and arena in a " + std::to_string(layout_.total_bytes()) +
            "-byte segment: a version-skewed or corrupt peer");
  }

  std::byte* scratch(std::size_t bytes) {
    if (scratch_.size() < bytes) scratch_.resize(bytes);
    return scratch_.data();
  }

  void broadcast_chunk(const tensor_group& group, chunk_descriptor& d, bool zero_copy, const wait_ctx& ctx) {
    const std::size_t esz = size_of(group.type);
    const std::size_t parity = ctx.chunk & 1;
    if (me_ == 0) {
      if (zero_copy) {
        d.offset = *group.zero_copy_offset + d.first * esz;
      } else {
        d.offset = layout_.slot(0, parity);
        group.copy_out(d.first, d.count, base_ + d.offset);
      }
      mine().desc[parity] = d;
      publish(&rank_control::staged, ctx.chunk + 1);
    } else {
      wait_for(0, &rank_control::staged, ctx.chunk + 1, ctx, "stage the broadcast");
      const chunk_descriptor& d0 = control(0).desc[parity];
      check_same(0, d0, d, ctx);
      const std::byte* src = base_ + checked_offset(0, parity, d0.offset, d.count * esz, esz, ctx);
      if (zero_copy) {
        std::memcpy(base_ + *group.zero_copy_offset + d.first * esz, src, d.count * esz);
      } else {
        group.copy_in(d.first, d.count, src);
      }
    }
    publish(&rank_control::copied, ctx.chunk + 1);
  }

  void wait_all(std::uint64_t rank_control::*field, std::uint64_t value, const wait_ctx& ctx, const char* what) const {
    for (int q = 0; q < size_; ++q) {
      if (q != me_) wait_for(q, field, value, ctx, what);
    }
  }

  void wait_for(int q, std::uint64_t rank_control::*field, std::uint64_t value, const wait_ctx& ctx,
                const char* what) const {
    if (read(q, field) >= value) return;
    backoff wait(spins_);
    auto& aborted = header()->aborted_by;
    while (read(q, field) < value) {
      if (const std::uint32_t by = std::atomic_ref<std::uint32_t>(aborted).load(std::memory_order_acquire); by != 0) {
        throw_aborted(by, ctx);
      }
      if ((wait.steps() & 127u) == 127u && clock::now() >= ctx.deadline) throw_timeout(q, what, ctx);
      wait.pause();
    }
  }

  [[noreturn]] void throw_aborted(std::uint32_t by, const wait_ctx& ctx) const {
    // `by` is peer-written: any value must give a message (a wrong one names no rank), never UB.
    const std::uint32_t q = by - 1;
    const std::string who =
        q < static_cast<std::uint32_t>(size_)
            ? "rank " + std::to_string(world_rank(static_cast<int>(q)))
            : "node rank " + std::to_string(q) + " (out of range: a version-skewed or corrupt peer)";
    const std::uint32_t reason = std::atomic_ref<std::uint32_t>(header()->abort_reason).load(std::memory_order_acquire);
    throw communication_error(ctx.info.rank, ctx.info.describe(),
                              who + (reason == 1 ? " aborted its communicator" : " failed a shared-memory collective") +
                                  "; the node's segment is unusable");
  }

  [[noreturn]] void throw_timeout(int q, const char* what, const wait_ctx& ctx) const {
    throw timeout_error(ctx.info.rank, ctx.info.describe(),
                        "rank " + std::to_string(world_rank(q)) + " (same node) did not " + what + " for chunk " +
                            std::to_string(ctx.chunk) + " within " + std::to_string(ctx.info.timeout.count()) +
                            " ms (a peer is slow, dead, or issued a different collective)");
  }

  void check_same(int q, const chunk_descriptor& theirs, const chunk_descriptor& ours, const wait_ctx& ctx) const {
    if (theirs.op_seq == ours.op_seq && theirs.first == ours.first && theirs.count == ours.count &&
        theirs.total == ours.total && theirs.type == ours.type && theirs.op == ours.op && theirs.phase == ours.phase &&
        theirs.group == ours.group && theirs.scale == ours.scale) {
      return;
    }
    throw mismatch_error(ctx.info.rank, ctx.info.describe(),
                         "ranks issued different collectives at the same position: rank " +
                             std::to_string(world_rank(q)) + " is at " + describe(theirs) + ", this rank at " +
                             describe(ours));
  }

  [[nodiscard]] static std::string describe(const chunk_descriptor& d) {
    const std::string op = d.scale == 0 ? std::string(name_of(static_cast<reduce_op>(d.op)))
                                        : "sum of inputs x " + std::to_string(std::bit_cast<double>(d.scale));
    return "allreduce #" + std::to_string(d.op_seq) + " (" + op + ", " +
           std::string(name_of(static_cast<dtype>(d.type))) + " x " + std::to_string(d.total) + ", dtype group " +
           std::to_string(d.group) + ", " + name_of(static_cast<node_phase>(d.phase)) + ", elements " +
           std::to_string(d.first) + "+" + std::to_string(d.count) + ")";
  }

  [[nodiscard]] int world_rank(int q) const {
    return q >= 0 && static_cast<std::size_t>(q) < world_.size() ? world_[static_cast<std::size_t>(q)] : q;
  }

  std::byte* base_;
  segment_layout layout_;
  int me_;
  int size_;
  std::vector<int> world_;
  unsigned spins_;
  std::size_t single_max_;
  std::uint64_t next_chunk_ = 0;
  std::vector<const void*> inputs_;   // per node rank: where its data of the current slice is
  std::vector<std::size_t> offsets_;  // per node rank: its checked data offset for the current chunk
  std::vector<std::byte> scratch_;    // single-phase results that cannot go straight to the output
};

}  // namespace ddp::shm
