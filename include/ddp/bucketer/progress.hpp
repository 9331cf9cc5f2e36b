#pragma once
/// @file bucketer/progress.hpp
/// @brief The Bucketer's optional progress thread (`bucketer_options::progress_interval`). Not
/// for users.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace ddp::detail {

/// A thread that sleeps until `wake()`, then calls `step()` every `interval` until it returns
/// false (nothing left in flight), then sleeps again. Stopped and joined by `stop()` or the
/// destructor, before the state `step` uses goes away (the owner calls `stop()` first).
class progress_thread {
 public:
  progress_thread() = default;
  progress_thread(const progress_thread&) = delete;
  progress_thread& operator=(const progress_thread&) = delete;
  ~progress_thread() { stop(); }

  /// True once started (and not stopped).
  [[nodiscard]] bool running() const noexcept { return thread_.joinable(); }

  /// Starts the thread (once). `step` returns true while more progress is wanted.
  void start(std::chrono::microseconds interval, std::function<bool()> step) {
    if (thread_.joinable()) return;
    interval_ = interval;
    step_ = std::move(step);
    thread_ = std::thread([this] { loop(); });
  }

  /// Something was launched: start stepping (no lost wake-up: the flag is set under the mutex).
  void wake() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard lk(mutex_);
      wanted_.store(true, std::memory_order_release);
    }
    cv_.notify_one();
  }

  /// Stops and joins the thread.
  void stop() noexcept {
    if (!thread_.joinable()) return;
    {
      std::lock_guard lk(mutex_);
      stop_.store(true);
    }
    cv_.notify_one();
    thread_.join();
  }

 private:
  void loop() {
    std::unique_lock wait_lock(mutex_);
    while (!stop_.load()) {
      cv_.wait(wait_lock, [&] { return stop_.load() || wanted_.load(); });
      if (stop_.load()) break;
      wait_lock.unlock();
      while (!stop_.load()) {
        std::this_thread::sleep_for(interval_);
        if (!step_()) {
          wanted_.store(false);
          break;
        }
      }
      wait_lock.lock();
    }
  }

  std::chrono::microseconds interval_{0};
  std::function<bool()> step_;
  std::mutex mutex_;  // guards stop_ and the sleep
  std::condition_variable cv_;
  std::atomic<bool> wanted_{false};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace ddp::detail
