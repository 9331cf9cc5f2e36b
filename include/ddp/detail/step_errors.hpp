#pragma once
/// @file detail/step_errors.hpp
/// @brief `step_errors`: the first error of a fault-tolerant training step, and the forwarding of
/// collectives whose errors land there instead of being thrown (the Manager's, and a replica
/// group follower's: groups/group_manager.hpp). The gradients of a failed collective may be
/// garbage; the step's commit vote refuses it on every replica.

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>

#include <ddp/work.hpp>

namespace ddp::detail {

class step_errors {
 public:
  /// @param on_first called with the first error of each step, outside the lock (the owner
  ///   aborts its communicator there, so that peers fail fast, and logs it)
  explicit step_errors(std::function<void(const std::exception_ptr&)> on_first) : on_first_(std::move(on_first)) {}
  step_errors(const step_errors&) = delete;
  step_errors& operator=(const step_errors&) = delete;

  /// True once an error was captured in this step.
  [[nodiscard]] bool failed() const {
    std::lock_guard lk(mutex_);
    return error_ != nullptr;
  }
  /// The first error captured in this step, or null.
  [[nodiscard]] std::exception_ptr error() const {
    std::lock_guard lk(mutex_);
    return error_;
  }
  /// A new step: no error.
  void clear() {
    std::lock_guard lk(mutex_);
    error_ = nullptr;
  }
  /// Records `e` if it is the step's first error (then tells the owner).
  void capture(std::exception_ptr e) {
    {
      std::lock_guard lk(mutex_);
      if (error_) return;
      error_ = e;
    }
    if (on_first_) on_first_(e);
  }

  /// The work of `issue()`, whose error (when issuing or completing) is captured and never
  /// thrown; a completed work, communicating nothing, once the step failed or without a
  /// communicator (`connected` false): the step is lost anyway, skip rather than block.
  template <class Issue>
  work forward(bool connected, int rank, const char* name, Issue&& issue) {
    if (failed() || !connected) return work::ready();
    op_info info;
    info.rank = rank;
    info.name = name;
    info.timeout = std::chrono::hours(24);  // the inner work carries the real deadline
    try {
      return work(std::make_unique<captured_work>(issue(), this, info));
    } catch (...) {
      capture(std::current_exception());
      return work::ready();
    }
  }

 private:
  class captured_work final : public work_state {
   public:
    captured_work(work inner, step_errors* errors, op_info info)
        : work_state(info), inner_(std::move(inner)), errors_(errors) {}
    bool poll() override {
      try {
        return inner_.test();
      } catch (...) {
        errors_->capture(std::current_exception());
        return true;
      }
    }
    bool wait_until(clock::time_point deadline) override {
      try {
        inner_.wait_for(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now()));
      } catch (...) {
        errors_->capture(std::current_exception());
      }
      return true;
    }

   private:
    work inner_;
    step_errors* errors_;
  };

  std::function<void(const std::exception_ptr&)> on_first_;
  mutable std::mutex mutex_;
  std::exception_ptr error_;
};

}  // namespace ddp::detail
