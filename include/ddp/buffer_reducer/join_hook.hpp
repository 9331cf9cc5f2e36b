#pragma once
/// @file buffer_reducer/join_hook.hpp
/// @brief `buffer_reducer_join_hook`: what `BufferReducer::join_hook()` returns, the reducer's
/// part in a `JoinContext` (uneven inputs; see ddp/joinable.hpp).

#include <memory>
#include <utility>

#include <ddp/buffer_reducer/engine.hpp>
#include <ddp/joinable.hpp>

namespace ddp {

/// The join hook of a `BufferReducer` (see joinable.hpp). It shares the reducer's state, so it
/// stays valid if the reducer object is moved.
class buffer_reducer_join_hook {
 public:
  /// Made by `BufferReducer::join_hook()` with the reducer's shared state.
  explicit buffer_reducer_join_hook(std::shared_ptr<detail::buffer_reducer_state> state) : state_(std::move(state)) {}

  /// On a rank that ran out of data, once per round in which the training ranks' `sync()`
  /// communicates: issues the same collectives, in the same order, with neutral data (zeros for
  /// sums and means, the identity for min and max; a receiver for broadcasts), then waits. The
  /// results land in this rank's buffers.
  void main_hook(const join_round& round) { state_->shadow(round); }

  /// Once on every rank after all joined. With a period, every rank adopts the authoritative
  /// rank's count of sync() calls (one broadcast of one int64), so the period's phase agrees if
  /// training goes on; without one, nothing.
  void post_hook(const join_summary& summary) { state_->after_join(summary); }

 private:
  std::shared_ptr<detail::buffer_reducer_state> state_;
};

}  // namespace ddp
