#pragma once
/// @file strategies/broadcast.hpp
/// @brief `strategies::broadcast`: every rank receives the root's values (PyTorch DDP's
/// `broadcast_buffers=True`, the default strategy of `BufferReducer`).

#include <ostream>
#include <string>

#include <ddp/strategies/buffer_group.hpp>
#include <ddp/strategies/buffer_strategy.hpp>
#include <ddp/work.hpp>

namespace ddp::strategies {

/// Copies the root's buffers to every rank: one broadcast per group and sync.
///
/// Under join the root must be a rank that still trains (a joined rank's buffers stopped
/// changing). If `root` is not training in the sync's round, the round's authoritative rank
/// (highest rank still training) is the root instead; every rank derives it from the same round,
/// so training and joined ranks agree. A joined rank takes part as a receiver.
struct broadcast {
  int root = 0;  ///< rank whose values win; must be a rank of the communicator

  /// The root of this sync: `root`, unless the sync's join round says it stopped training.
  [[nodiscard]] int effective_root(const buffer_group& g) const noexcept {
    if (g.round != nullptr && !g.round->training_rank(root) && g.round->authoritative_rank >= 0) {
      return g.round->authoritative_rank;
    }
    return root;
  }

  /// @throws usage_error (from the communicator) if the root is not a rank of it
  [[nodiscard]] work sync(const buffer_group& g) const { return g.comm.broadcast(g.tensors, effective_root(g)); }

  /// "broadcast(root=N)".
  [[nodiscard]] std::string name() const { return "broadcast(root=" + std::to_string(root) + ")"; }

  /// Only the root's values travel: receivers need not pack their buffers.
  [[nodiscard]] bool reads_local_data(const buffer_group& g) const { return g.comm.rank() == effective_root(g); }
  /// The root's buffers do not change: it need not unpack.
  [[nodiscard]] bool writes_local_data(const buffer_group& g) const { return g.comm.rank() != effective_root(g); }

  /// Same root.
  friend bool operator==(const broadcast&, const broadcast&) = default;
  /// Writes `name()`.
  friend std::ostream& operator<<(std::ostream& os, const broadcast& b) { return os << b.name(); }
};

static_assert(buffer_strategy<broadcast>);

}  // namespace ddp::strategies
