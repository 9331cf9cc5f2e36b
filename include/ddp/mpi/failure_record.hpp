#pragma once
/// @file mpi/failure_record.hpp
/// @brief `detail::failure_record`: what an `environment` and the communicators made with it
/// share, so that the environment knows at teardown whether one of them failed.

#include <atomic>
#include <mutex>
#include <string>

namespace ddp::mpi::detail {

/// Whether a communicator made with an environment saw a communication failure (an MPI error, a
/// timed-out wait, `abort()`), and the first one's description. Owned jointly (shared_ptr) by the
/// environment and its communicators' states: a process-local record, not a global.
class failure_record {
 public:
  /// Records `what` if nothing was recorded yet. Never throws.
  void note(const std::string& what) noexcept {
    try {
      std::lock_guard lock(mutex_);
      if (failed_.load(std::memory_order_relaxed)) return;
      first_ = what;
    } catch (...) {  // out of memory, or the lock failed: still record that something failed
    }
    failed_.store(true, std::memory_order_release);
  }

  /// True once a failure was recorded.
  [[nodiscard]] bool failed() const noexcept { return failed_.load(std::memory_order_acquire); }

  /// The first failure's description ("" if none).
  [[nodiscard]] std::string first() const {
    std::lock_guard lock(mutex_);
    return first_;
  }

 private:
  mutable std::mutex mutex_;
  std::atomic<bool> failed_{false};
  std::string first_;
};

}  // namespace ddp::mpi::detail
