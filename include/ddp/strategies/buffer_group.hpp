#pragma once
/// @file strategies/buffer_group.hpp
/// @brief `buffer_group`: one coalesced group of buffers at one synchronisation, as the group's
/// strategy sees it.
///
/// A `BufferReducer` puts the buffers that share a strategy, a dtype and a device into one group
/// and calls the strategy once per group and sync. The strategy issues its collective(s) on
/// `tensors` (one flat view of host memory holding every buffer of the group back to back, so a
/// single collective covers the group) and returns the work.

#include <cstddef>
#include <span>
#include <string>

#include <ddp/communicator.hpp>
#include <ddp/joinable.hpp>
#include <ddp/tensor.hpp>

namespace ddp {

/// One group of buffers at one sync. Every span points into the reducer's state and is valid
/// for the duration of the strategy's `sync()` call only; a continuation that needs them later
/// must copy them (tensor views are cheap to copy).
struct buffer_group {
  /// The communicator to issue collectives on.
  communicator_ref comm;
  /// What the collective runs on. For a host group: one flat view of the group's storage (or the
  /// trainer's buffer itself when the group is that single buffer). For device memory, which the
  /// reducer cannot pack: the trainer's buffers, one view each (a coalesced multi-tensor call).
  std::span<const tensor_view> tensors;
  /// Each buffer of the group, in registration order, as the collective sees it: slices of the
  /// flat view (or the trainer's buffers when the group is not packed).
  std::span<const tensor_view> buffers;
  /// Registration index of each element of `buffers` (for error messages).
  std::span<const std::size_t> indices;
  /// The join round of this sync, or null outside a `JoinContext`. On a training rank it is the
  /// round recorded by the last `join_notified()`; on a joined rank the round of the main hook.
  const join_round* round = nullptr;
  /// True on a rank that ran out of data and mirrors the training ranks' collectives: the
  /// strategy must issue the same collectives with neutral data (its results still land in the
  /// buffers, so a joined rank ends up with the values the training ranks agreed on).
  bool joined = false;

  /// Element type shared by every buffer of the group.
  [[nodiscard]] ddp::dtype type() const noexcept { return tensors.empty() ? dtype::f32 : tensors.front().type; }
  /// Where the group's memory lives.
  [[nodiscard]] ddp::device where() const noexcept { return tensors.empty() ? device::host() : tensors.front().where; }
  /// Elements over the whole group.
  [[nodiscard]] std::size_t count() const noexcept {
    std::size_t n = 0;
    for (const tensor_view& t : tensors) n += t.count;
    return n;
  }

  /// "buffers #0, #3 (f32 x 1024 on host)", for error messages.
  [[nodiscard]] std::string describe() const {
    std::string s = indices.size() == 1 ? "buffer " : "buffers ";
    for (std::size_t k = 0; k < indices.size(); ++k) s += (k ? ", #" : "#") + std::to_string(indices[k]);
    s += " (" + std::string(name_of(type())) + " x " + std::to_string(count()) + " on " + where().str() + ")";
    return s;
  }
};

}  // namespace ddp
