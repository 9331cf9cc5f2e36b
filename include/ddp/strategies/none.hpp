#pragma once
/// @file strategies/none.hpp
/// @brief `strategies::none`: the buffers stay local (PyTorch DDP's `broadcast_buffers=False`).

#include <ostream>
#include <string>

#include <ddp/strategies/buffer_group.hpp>
#include <ddp/strategies/buffer_strategy.hpp>
#include <ddp/work.hpp>

namespace ddp::strategies {

/// Leaves the buffers alone: no collective, no copy, nothing to mirror under join. Useful as the
/// default of a reducer whose synchronised buffers all name their strategy, or to register a
/// buffer in the reducer's storage (and its cross-rank size check) without synchronising it.
struct none {
  /// Does nothing: a completed work.
  [[nodiscard]] work sync(const buffer_group&) const { return work::ready(); }
  /// "none".
  [[nodiscard]] std::string name() const { return "none"; }
  /// False: the reducer neither packs nor synchronises these groups.
  [[nodiscard]] bool communicates() const noexcept { return false; }
  /// False: nothing to pack.
  [[nodiscard]] bool reads_local_data(const buffer_group&) const noexcept { return false; }
  /// False: nothing to unpack.
  [[nodiscard]] bool writes_local_data(const buffer_group&) const noexcept { return false; }

  /// Always true.
  friend bool operator==(const none&, const none&) = default;
  /// Writes `name()`.
  friend std::ostream& operator<<(std::ostream& os, const none& n) { return os << n.name(); }
};

static_assert(buffer_strategy<none>);

}  // namespace ddp::strategies
