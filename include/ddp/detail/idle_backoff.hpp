#pragma once
/// @file detail/idle_backoff.hpp
/// @brief `idle_backoff`: how a thread waits for something it can only poll. It spins for a few
/// polls (small collectives complete within microseconds), yields while the wait is young
/// (oversubscribed ranks, 4 on 2 cores, need the core), then sleeps with pauses that grow with
/// the time already waited, to at most 1 ms: a rank waiting on a hung peer polls about a thousand
/// times a second (measured: 1-3 % of a core for a Bucketer's wait on four pending buckets over
/// gloo, docs/benchmarks.md), and a wait that does complete late overshoots by at most 1/32 of
/// its length. The schedule follows the time waited, not the number of polls, so it
/// does not depend on how cheap one poll is. What it waits for decides how long it yields
/// (`progress_mode`): an operation that moves only while it is polled (MPI) keeps being polled
/// for a second (docs/fault-tolerance.md, "Timing").

#include <algorithm>
#include <chrono>
#include <thread>

namespace ddp::detail {

/// How an operation moves: by itself (a backend thread, the network), or only while its owner
/// polls it (Open MPI's requests and ddp's MPI ring make progress inside MPI_Test alone).
enum class progress_mode : unsigned char { background, polled };

class idle_backoff {
  using clock = std::chrono::steady_clock;  // ddp::clock (work.hpp includes this header)

 public:
  /// Polls that spin before the first yield.
  static constexpr unsigned spins = 64;
  /// The longest pause between two polls.
  static constexpr auto longest_pause = std::chrono::milliseconds(1);

  /// @param mode what is waited for: `polled` yields (polls at full rate) for a second before it
  ///   sleeps, `background` for 2 ms
  explicit idle_backoff(progress_mode mode = progress_mode::background) noexcept
      : yield_for_(mode == progress_mode::polled ? std::chrono::milliseconds(1000) : std::chrono::milliseconds(2)) {}

  /// Something happened (a poll made progress): the next pause starts the schedule again.
  void reset() noexcept {
    polls_ = 0;
    since_ = {};
  }

  /// Pauses after a poll that found nothing new; never sleeps past `deadline`.
  void pause(clock::time_point deadline = clock::time_point::max()) {
    if (polls_ < spins) {
      ++polls_;
      return;
    }
    const auto now = clock::now();
    if (since_ == clock::time_point{}) since_ = now;
    const auto waited = now - since_;
    if (waited < yield_for_) {
      std::this_thread::yield();
      return;
    }
    const auto pause = std::clamp<clock::duration>((waited - yield_for_) / 32 + std::chrono::microseconds(50),
                                                   std::chrono::microseconds(50), longest_pause);
    std::this_thread::sleep_until(std::min(deadline, now + pause));
  }

 private:
  clock::duration yield_for_;
  unsigned polls_ = 0;
  clock::time_point since_{};  // first pause past the spins
};

}  // namespace ddp::detail
