#pragma once
/// @file joinable.hpp
/// @brief What a class provides to take part in a `JoinContext` (uneven inputs).
///
/// A joinable is any class with
/// - `join_hook(const join_hook_options&)` returning a `join_hook`: an object whose
///   `main_hook(const join_round&)` runs on a rank that has run out of data, once per round in
///   which training ranks run this joinable's collectives, and issues exactly those collectives
///   (with neutral data); and whose `post_hook(const join_summary&)` runs once on every rank after
///   all ranks have joined;
/// - `join_communicator()` returning the communicator its collectives use.
/// Optionally:
/// - `bool join_will_communicate()`: asked on a training rank at each `notify()`; whether this
///   joinable issues its per-iteration collectives in this iteration (false, e.g., in a `no_sync`
///   iteration of a Bucketer). Default: true.
/// - `void join_notified(const join_round&)`: told the round's bookkeeping on a training rank
///   (ranks still training, authoritative rank), e.g. to pick a divisor or a broadcast root.

#include <concepts>
#include <cstdint>
#include <vector>

#include <ddp/communicator.hpp>

namespace ddp {

/// Options forwarded to every joinable's hooks.
struct join_hook_options {
  /// true: the average over ranks divides by the initial world size (joined ranks count as zeros);
  /// false: it divides by the number of ranks still training.
  bool divide_by_initial_world_size = true;

  /// Memberwise.
  friend bool operator==(const join_hook_options&, const join_hook_options&) = default;
};

/// Everything one join bookkeeping collective told every rank about one iteration.
struct join_round {
  std::uint64_t iteration = 0;  ///< rounds since the context started
  int world_size = 1;           ///< size of the communicator
  int training = 1;             ///< ranks still training in this round
  std::vector<bool> is_training;  ///< per rank
  int authoritative_rank = 0;   ///< highest rank still training (-1 if none)
  int communicating = 0;        ///< training ranks that run the current joinable's collectives this round
  join_hook_options options;    ///< the context's `join_options::hooks`

  /// Divisor of an average over ranks in this round, per `options`.
  [[nodiscard]] int divisor() const noexcept {
    return options.divide_by_initial_world_size || training == 0 ? world_size : training;
  }
  /// True if rank `r` is still training in this round (false for an out-of-range `r`).
  [[nodiscard]] bool training_rank(int r) const noexcept {
    return r >= 0 && static_cast<std::size_t>(r) < is_training.size() && is_training[static_cast<std::size_t>(r)];
  }
};

/// Given to post hooks once every rank has joined.
struct join_summary {
  bool is_last_joiner = true;   ///< this rank trained in the last round in which anyone trained
  int authoritative_rank = 0;   ///< highest of the last joiners: the rank whose state is final
  int world_size = 1;           ///< size of the communicator
  std::uint64_t rounds = 0;     ///< iterations in which at least one rank trained
  join_hook_options options;    ///< the context's `join_options::hooks`
};

/// The object a joinable's `join_hook()` returns: `main_hook(const join_round&)` and
/// `post_hook(const join_summary&)` (see the file description).
template <class H>
concept join_hook = requires(H& h, const join_round& r, const join_summary& s) {
  h.main_hook(r);
  h.post_hook(s);
};

/// A class that can take part in a `JoinContext` (see the file description).
template <class J>
concept joinable = requires(J& j, const join_hook_options& o) {
  { j.join_hook(o) } -> join_hook;
  { j.join_communicator() } -> std::convertible_to<communicator_ref>;
};

namespace detail {
template <class J>
bool join_will_communicate(J& j) {
  if constexpr (requires { { j.join_will_communicate() } -> std::convertible_to<bool>; }) {
    return j.join_will_communicate();
  } else {
    return true;
  }
}
template <class J>
void join_notified(J& j, const join_round& r) {
  if constexpr (requires { j.join_notified(r); }) j.join_notified(r);
}
}  // namespace detail

}  // namespace ddp
