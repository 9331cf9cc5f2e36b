#pragma once
/// @file time_source.hpp
/// @brief `time_source`: where the fault-tolerance protocol (the Manager, its quorum rendezvous
/// in the store) reads the time and sleeps. The machine's clocks unless told otherwise; the
/// deterministic simulation (tests/sim, docs/testing.md) passes its virtual clock, so that the
/// same protocol code runs under a seeded scheduler that decides every interleaving.

#include <chrono>
#include <cstdint>
#include <thread>

#include <ddp/work.hpp>

namespace ddp {

/// A clock and a way to wait for it. Implementations must be safe to call from every thread
/// that uses them.
class time_source {
 public:
  time_source() = default;
  time_source(const time_source&) = delete;
  time_source& operator=(const time_source&) = delete;
  virtual ~time_source() = default;
  /// Monotonic time: deadlines, intervals.
  [[nodiscard]] virtual clock::time_point now() = 0;
  /// Wall-clock milliseconds since the epoch: what a heartbeat holds, compared across processes.
  [[nodiscard]] virtual std::int64_t wall_ms() = 0;
  /// Returns at `t` or later.
  virtual void sleep_until(clock::time_point t) = 0;
};

namespace detail {

/// `t->now()`, or the machine's monotonic clock when `t` is null.
[[nodiscard]] inline clock::time_point now_of(time_source* t) { return t ? t->now() : clock::now(); }

/// `t->wall_ms()`, or the machine's wall clock when `t` is null.
[[nodiscard]] inline std::int64_t wall_ms_of(time_source* t) {
  if (t) return t->wall_ms();
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

/// `t->sleep_until(until)`, or a real sleep when `t` is null.
inline void sleep_until_of(time_source* t, clock::time_point until) {
  if (t) {
    t->sleep_until(until);
  } else {
    std::this_thread::sleep_until(until);
  }
}

}  // namespace detail

}  // namespace ddp
