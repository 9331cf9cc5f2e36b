#pragma once
/// @file detail/step_errors.hpp
/// @brief `step_errors`: the first error of a fault-tolerant training step, and the forwarding of
/// collectives whose errors land there instead of being thrown (the Manager's, and a replica
/// group follower's: groups/group_manager.hpp). The gradients of a failed collective may be
/// garbage; the step's commit vote refuses it on every replica.
///
/// A step has one deadline (`manager_options::step_timeout`): a collective of the step that is
/// still pending when it passes, whether it is waited on, tested or polled by whatever loop (the
/// Bucketer, the reproducible reducer, a replica group's stages, DiLoCo), fails the step with a
/// `timeout_error` that names it, the rank, the deadline and the time waited. A hung peer costs the
/// others one step (docs/fault-tolerance.md, "Timing").

#include <algorithm>
#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include <ddp/error.hpp>
#include <ddp/time_source.hpp>
#include <ddp/work.hpp>

namespace ddp::detail {

class step_errors {
 public:
  /// @param on_first called with the first error of each step, outside the lock (the owner
  ///   aborts its communicator there, so that peers fail fast, and logs it)
  /// @param time the clock of the step's deadline (null: the machine's; the simulation's virtual one)
  explicit step_errors(std::function<void(const std::exception_ptr&)> on_first, time_source* time = nullptr)
      : on_first_(std::move(on_first)), time_(time) {}
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
  /// A new step: no error yet.
  void clear() {
    std::lock_guard lk(mutex_);
    error_ = nullptr;
  }
  /// The step's clock starts: the collectives issued from now on must complete within `timeout`.
  void start_clock(std::chrono::milliseconds timeout) {
    std::lock_guard lk(mutex_);
    started_ = now_of(time_);
    timeout_ = timeout;
  }
  /// Time left until the step's deadline (negative once it passed).
  [[nodiscard]] std::chrono::milliseconds left() const {
    return std::chrono::ceil<std::chrono::milliseconds>(deadline() - now_of(time_));
  }
  /// When the current step's collectives time out.
  [[nodiscard]] clock::time_point deadline() const {
    std::lock_guard lk(mutex_);
    return started_ + timeout_;
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
    info.timeout = std::max(std::chrono::milliseconds(0), left());  // what `work::timeout()` tells a loop
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
        : work_state(info),
          inner_(std::move(inner)),
          errors_(errors),
          what_(inner_.describe()),
          issued_(now_of(errors->time_)) {
      if (what_.empty()) what_ = info.name;
    }
    bool poll() override {
      try {
        if (inner_.test()) return true;
      } catch (...) {
        errors_->capture(std::current_exception());
        return true;
      }
      if (errors_->left().count() > 0) return false;
      expire();
      return true;
    }
    // Waits for the inner work up to the earlier of `deadline` and the step's deadline; either
    // way the work completes here, its failure (a timeout too) captured.
    bool wait_until(clock::time_point deadline) override {
      try {
        if (errors_->time_) {
          inner_.wait();  // the virtual clock: the inner work keeps its own (virtual) deadline
        } else {
          inner_.wait_until(std::min(deadline, clock::now() + std::max(std::chrono::milliseconds(0), errors_->left())));
        }
      } catch (const timeout_error&) {
        if (errors_->left().count() > 0) {
          errors_->capture(std::current_exception());
        } else {
          expire();
        }
        return true;
      } catch (...) {
        errors_->capture(std::current_exception());
        return true;
      }
      if (errors_->left().count() <= 0 && !inner_.done()) expire();
      return true;
    }
    // The inner work is no longer waited for: its backend is told (the abort that follows the
    // step's first error fails it on every peer).
    void abandon() noexcept override { inner_ = work(); }

   private:
    // The step's deadline passed with the inner work pending: the step fails with a timeout_error.
    void expire() {
      inner_ = work();
      errors_->capture(std::make_exception_ptr(timeout_error(info().rank, what_, errors_->expired_text(issued_))));
    }

    work inner_;
    step_errors* errors_;
    std::string what_;          // the inner collective, as a timeout names it
    clock::time_point issued_;  // on the step's clock
  };

  [[nodiscard]] std::string expired_text(clock::time_point issued) const {
    std::chrono::milliseconds timeout;
    clock::time_point started;
    {
      std::lock_guard lk(mutex_);
      timeout = timeout_;
      started = started_;
    }
    const auto now = now_of(time_);
    const auto ms = [](clock::duration d) {
      return std::to_string(std::chrono::round<std::chrono::milliseconds>(d).count());
    };
    return "did not complete within the step's deadline (step_timeout " + std::to_string(timeout.count()) +
           " ms): waited " + ms(now - issued) + " ms for it, " + ms(now - started) +
           " ms into the step (a peer is hung, slow or dead: the step fails, and the quorum re-forms without it)";
  }

  std::function<void(const std::exception_ptr&)> on_first_;
  time_source* time_ = nullptr;
  mutable std::mutex mutex_;
  std::exception_ptr error_;
  clock::time_point started_ = now_of(time_);  // before the first step: the library's default timeout
  std::chrono::milliseconds timeout_ = default_timeout;
};

}  // namespace ddp::detail
