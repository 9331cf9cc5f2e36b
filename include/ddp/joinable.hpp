#pragma once
/// @file joinable.hpp
/// @brief What a class provides to take part in a `JoinContext` (uneven inputs).
///
/// The `joinable` concept (`join_hook()`, `join_communicator()`; optionally
/// `join_will_communicate()`, `join_notified()`, `join_issue_phase()`), the `join_round` and
/// `join_summary` a joinable is told, and the `join_order_token` through which the context
/// learns the order in which training ranks issue the joinables' collectives. Apart from
/// join.hpp so that a component can be a joinable without the context.
/// What each member must do and the issue-order rules: docs/join.md ("Writing a joinable").

#include <algorithm>
#include <atomic>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
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

/// When, within an iteration, a joinable issues its collectives: the hint a joinable may give with
/// `join_issue_phase()`. It orders the joinables only until a JoinContext has observed the real
/// order (see the file description).
enum class join_phase : std::uint8_t {
  before_forward,  ///< e.g. a BufferReducer's sync at the start of the step
  forward,         ///< during the forward pass
  backward,        ///< during the backward pass (a Bucketer's buckets)
  after_backward,  ///< after the backward pass (an optimizer's own collectives)
};

class join_order_token;

namespace detail {

/// One context's record of the order in which its joinables issued their first collective of the
/// current round. Shared (`shared_ptr`) between the context and the tokens it hands out, so a
/// joinable that keeps a token longer than the context never touches freed memory. `record()`
/// may be called from any thread; `begin()` and `sequence()` by the context's thread between
/// iterations only.
class join_order_log {
 public:
  explicit join_order_log(std::size_t joinables)
      : slots_(std::make_unique<std::atomic<std::uint64_t>[]>(joinables)), size_(joinables) {}

  /// Starts a round: forgets what was recorded and returns the round's epoch (tokens of earlier
  /// epochs record nothing any more).
  std::uint64_t begin() noexcept {
    for (std::size_t j = 0; j < size_; ++j) slots_[j].store(0, std::memory_order_relaxed);
    next_.store(1, std::memory_order_relaxed);
    return epoch_.fetch_add(1, std::memory_order_acq_rel) + 1;
  }
  /// Ends recording: every token handed out so far records nothing.
  void close() noexcept { epoch_.fetch_add(1, std::memory_order_acq_rel); }

  /// Joinable `index` issued a collective in round `epoch`. The first call per joinable and round
  /// counts; later ones cost one atomic load.
  void record(std::uint64_t epoch, std::size_t index) noexcept {
    if (index >= size_ || epoch != epoch_.load(std::memory_order_acquire)) return;
    std::atomic<std::uint64_t>& slot = slots_[index];
    std::uint64_t current = slot.load(std::memory_order_acquire);
    if (current != 0) return;
    const std::uint64_t seq = next_.fetch_add(1, std::memory_order_acq_rel);
    // Concurrent first calls of one joinable: the earliest sequence number wins.
    while ((current == 0 || seq < current) &&
           !slot.compare_exchange_weak(current, seq, std::memory_order_acq_rel, std::memory_order_acquire)) {
    }
  }

  /// The joinables that recorded in the current round, in the order they first issued.
  [[nodiscard]] std::vector<std::size_t> sequence() const {
    std::vector<std::pair<std::uint64_t, std::size_t>> seen;
    for (std::size_t j = 0; j < size_; ++j) {
      const std::uint64_t seq = slots_[j].load(std::memory_order_acquire);
      if (seq != 0) seen.emplace_back(seq, j);
    }
    std::sort(seen.begin(), seen.end());
    std::vector<std::size_t> out;
    out.reserve(seen.size());
    for (const auto& s : seen) out.push_back(s.second);
    return out;
  }

 private:
  std::unique_ptr<std::atomic<std::uint64_t>[]> slots_;  // per joinable: sequence number of its first issue, 0: none
  std::size_t size_;
  std::atomic<std::uint64_t> next_{1};
  std::atomic<std::uint64_t> epoch_{0};
};

join_order_token make_join_order_token(std::shared_ptr<join_order_log> log, std::uint64_t epoch, std::size_t index);

}  // namespace detail

/// Lets a joinable on a training rank tell its `JoinContext` when it issues its first collective
/// of an iteration, so that ranks that have run out of data shadow the joinables in the order the
/// training ranks issue them. A joinable finds it in the `join_round` given to `join_notified()`
/// (`round.order_token`), keeps a copy, and calls `collective_issued()` when it issues a
/// collective of the iteration (at least the first; later calls cost one atomic load). The token
/// is valid for that iteration only: tokens of earlier iterations, of a finished context, or
/// default-constructed ones record nothing. Copying it is cheap (a `shared_ptr`); it never
/// dangles, even past the context's lifetime.
class join_order_token {
 public:
  /// Records nothing.
  join_order_token() noexcept = default;

  /// This joinable has just issued (or is about to issue) a collective of the current iteration.
  /// Thread-safe; never throws, never communicates.
  void collective_issued() const noexcept {
    if (log_) log_->record(epoch_, index_);
  }

  /// True if this token belongs to a context (it may still be out of date).
  [[nodiscard]] explicit operator bool() const noexcept { return log_ != nullptr; }

 private:
  friend join_order_token detail::make_join_order_token(std::shared_ptr<detail::join_order_log>, std::uint64_t,
                                                        std::size_t);
  std::shared_ptr<detail::join_order_log> log_;
  std::uint64_t epoch_ = 0;
  std::size_t index_ = 0;
};

namespace detail {
/// A token for joinable `index` in round `epoch` of `log` (made by `JoinContext::notify()`).
inline join_order_token make_join_order_token(std::shared_ptr<join_order_log> log, std::uint64_t epoch,
                                              std::size_t index) {
  join_order_token t;
  t.log_ = std::move(log);
  t.epoch_ = epoch;
  t.index_ = index;
  return t;
}
}  // namespace detail

/// Everything one join bookkeeping collective told every rank about one iteration.
struct join_round {
  std::uint64_t iteration = 0;    ///< rounds since the context started
  int world_size = 1;             ///< size of the communicator
  int training = 1;               ///< ranks still training in this round
  std::vector<bool> is_training;  ///< per rank
  int authoritative_rank = 0;     ///< highest rank still training (-1 if none)
  int communicating = 0;          ///< training ranks that run the current joinable's collectives this round
  join_hook_options options;      ///< the context's `join_options::hooks`
  /// Given to the current joinable's `join_notified()` on a training rank: call
  /// `collective_issued()` on it (or on a copy) when the joinable issues its first collective of
  /// the iteration. Records nothing elsewhere (main hooks, the round `notify()` returns).
  join_order_token order_token;

  /// Divisor of an average over ranks in this round, per `options`.
  [[nodiscard]] int divisor() const noexcept {
    return options.divide_by_initial_world_size || training == 0 ? world_size : training;
  }
  /// True if rank `r` is still training in this round (false for an out-of-range `r`).
  [[nodiscard]] bool training_rank(int r) const noexcept {
    return r >= 0 && static_cast<std::size_t>(r) < is_training.size() && is_training[static_cast<std::size_t>(r)];
  }
  /// `order_token.collective_issued()`.
  void collective_issued() const noexcept { order_token.collective_issued(); }
};

/// Given to post hooks once every rank has joined.
struct join_summary {
  bool is_last_joiner = true;  ///< this rank trained in the last round in which anyone trained
  int authoritative_rank = 0;  ///< highest of the last joiners: the rank whose state is final
  int world_size = 1;          ///< size of the communicator
  std::uint64_t rounds = 0;    ///< iterations in which at least one rank trained
  join_hook_options options;   ///< the context's `join_options::hooks`
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
  if constexpr (requires {
                  { j.join_will_communicate() } -> std::convertible_to<bool>;
                }) {
    return j.join_will_communicate();
  } else {
    return true;
  }
}
template <class J>
void join_notified(J& j, const join_round& r) {
  if constexpr (requires { j.join_notified(r); }) j.join_notified(r);
}
template <class J>
std::optional<join_phase> join_issue_phase(J& j) {
  if constexpr (requires {
                  { j.join_issue_phase() } -> std::convertible_to<join_phase>;
                }) {
    return j.join_issue_phase();
  } else {
    return std::nullopt;
  }
}
}  // namespace detail

}  // namespace ddp
