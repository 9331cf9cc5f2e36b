#pragma once
/// @file training_state.hpp
/// @brief What a replica must receive to take part in training again: the `transferable_state`
/// concept and `training_state`, a ready-made model of it.
///
/// A recovering replica receives, from up-to-date peers, every tensor and scalar of the state
/// (parameters, buffers, optimizer state, schedule counters) so that afterwards its state is
/// bit-identical to theirs. Everything registered must therefore be identical on every
/// up-to-date replica (no per-replica random state, no data-loader position).

#include <concepts>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <ddp/tensor.hpp>

namespace ddp {

/// Any type that lists its tensors (views into its own memory) and a few int64 scalars.
template <class S>
concept transferable_state = requires(S& s) {
  { s.state_tensors() } -> std::convertible_to<std::span<const tensor_view>>;
  { s.state_scalars() } -> std::convertible_to<std::span<std::int64_t>>;
};

/// A list of tensors (any tensor type) and int64 scalars that make up a replica's training state.
class training_state {
 public:
  /// Registers a tensor (parameters, buffers, optimizer moments, ...), in host or device memory.
  template <tensor T>
  training_state& add(T& t) {
    return add(view(t));
  }
  /// Registers a tensor given as a view; returns `*this` so calls chain. Device tensors are
  /// healed through the Manager's communicator, which must then be a device communicator on
  /// their device (its `device_queue()` also copies them to the host for the state hash); their
  /// contents must be settled (no writes pending on other streams) when `start_quorum()` runs.
  training_state& add(tensor_view v) {
    tensors_.push_back(v);
    return *this;
  }
  /// Registers an int64 scalar (an optimizer step count, a schedule position, ...). The value
  /// lives here; read and write it through `scalar(i)`.
  std::size_t add_scalar(std::int64_t initial = 0) {
    scalars_.push_back(initial);
    return scalars_.size() - 1;
  }
  /// Scalar `i` (the index `add_scalar` returned), for reading and writing.
  /// @throws std::out_of_range for an index never returned by `add_scalar`
  [[nodiscard]] std::int64_t& scalar(std::size_t i) { return scalars_.at(i); }

  /// The registered tensors, in registration order (`transferable_state`).
  [[nodiscard]] std::span<const tensor_view> state_tensors() const noexcept { return tensors_; }
  /// The scalars, in registration order (`transferable_state`); healing overwrites them.
  [[nodiscard]] std::span<std::int64_t> state_scalars() noexcept { return scalars_; }

 private:
  std::vector<tensor_view> tensors_;
  std::vector<std::int64_t> scalars_;
};

static_assert(transferable_state<training_state>);

}  // namespace ddp
