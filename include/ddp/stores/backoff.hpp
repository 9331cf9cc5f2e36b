#pragma once
/// @file stores/backoff.hpp
/// @brief The polling schedule of store waits: fast at first (a peer usually publishes within a
/// millisecond of us on one node), then capped so that many waiting processes on 2 cores do not
/// spin the machine or hammer a Redis server.

#include <algorithm>
#include <chrono>
#include <thread>

#include <ddp/time_source.hpp>

namespace ddp::stores::detail {

class backoff {
 public:
  explicit backoff(std::chrono::microseconds cap) noexcept : cap_(std::max(cap, std::chrono::microseconds(50))) {}

  /// Sleeps for the next interval, never past `deadline`, by `time` (null: the machine's clock).
  void sleep_until_next(std::chrono::steady_clock::time_point deadline, time_source* time = nullptr) {
    const auto now = ddp::detail::now_of(time);
    if (now >= deadline) return;
    const auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - now);
    ddp::detail::sleep_until_of(time, now + std::min(next_, left));
    next_ = std::min(next_ * 2, cap_);
  }

 private:
  std::chrono::microseconds cap_;
  std::chrono::microseconds next_{50};
};

}  // namespace ddp::stores::detail
