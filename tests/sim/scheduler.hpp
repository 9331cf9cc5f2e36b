#pragma once
// The deterministic simulation's scheduler (docs/testing.md, "Deterministic simulation"): every
// simulated process is a thread, but only one runs at a time. It runs until its next scheduling
// point (a store operation, a collective, a sleep, a poll), then hands control back, and the
// scheduler picks the next process with its seeded generator. Time is virtual: it moves only
// when no process can run, to the earliest deadline one of them waits for. So one seed is one
// interleaving and one timing, replayed exactly, and the protocol code under test is the
// production code, given this scheduler as its `ddp::time_source`.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <ddp/time_source.hpp>

namespace sim {

using ddp::clock;
using namespace std::chrono_literals;

/// Thrown into a process the scheduler killed, at its next scheduling point: it unwinds as if
/// the process had vanished there.
struct killed {};

class scheduler final : public ddp::time_source {
 public:
  explicit scheduler(std::uint64_t seed) : rng_(seed) {}
  ~scheduler() override {
    // Processes still running (a run that hit its limit) die now: they unwind at their next
    // scheduling point, with time free to move.
    for (auto& p : procs_) {
      if (p->state != proc::done) p->kill = true;
    }
    run(clock::time_point::max());
    for (auto& p : procs_) {
      if (p->thread.joinable()) p->thread.join();
    }
  }

  // ---- processes --------------------------------------------------------------------------

  /// A new process running `body` (from the driver or from another process). It starts when
  /// the scheduler first picks it. Returns its id.
  int spawn(std::string name, std::function<void()> body) {
    auto p = std::make_unique<proc>();
    p->name = std::move(name);
    p->id = static_cast<int>(procs_.size());
    proc* raw = p.get();
    procs_.push_back(std::move(p));
    raw->thread = std::thread([this, raw, body = std::move(body)] {
      {
        std::unique_lock lk(mu_);
        raw->cv.wait(lk, [&] { return running_ == raw->id; });
      }
      try {
        if (!raw->kill) body();
      } catch (const killed&) {
      } catch (...) {
        raw->error = std::current_exception();
      }
      std::lock_guard lk(mu_);
      raw->state = proc::done;
      running_ = -1;
      driver_cv_.notify_one();
    });
    return raw->id;
  }

  /// Process `id` dies at its next scheduling point (at once if it is waiting).
  void kill(int id) {
    proc& p = *procs_.at(static_cast<std::size_t>(id));
    if (p.state != proc::done) p.kill = true;
  }
  [[nodiscard]] bool alive(int id) const { return procs_.at(static_cast<std::size_t>(id))->state != proc::done; }
  [[nodiscard]] const std::string& name(int id) const { return procs_.at(static_cast<std::size_t>(id))->name; }
  /// The process running now (-1: the driver).
  [[nodiscard]] int current() const noexcept { return running_; }
  /// An exception a process ended with (other than being killed), or null.
  [[nodiscard]] std::exception_ptr error(int id) const { return procs_.at(static_cast<std::size_t>(id))->error; }

  // ---- the driver ---------------------------------------------------------------------------

  /// Runs processes until every one ended (true), or until virtual time reaches `limit` or no
  /// process can ever move again (false; `why()` says which).
  bool run(clock::time_point limit) {
    for (;;) {
      std::vector<proc*> runnable;
      clock::time_point next = clock::time_point::max();
      bool any = false;
      for (auto& p : procs_) {
        if (p->state == proc::done) continue;
        any = true;
        if (p->state == proc::runnable || p->kill || (p->until && p->until()) || p->wake <= now_) {
          runnable.push_back(p.get());
        } else {
          next = std::min(next, p->wake);
        }
      }
      if (!any) return true;
      if (runnable.empty()) {
        if (next == clock::time_point::max()) {
          why_ = "no process can move: every one waits without a deadline";
          return false;
        }
        if (next > limit) {
          why_ = "virtual time limit reached";
          return false;
        }
        now_ = next;
        continue;
      }
      ++steps_;
      proc* p = runnable[std::uniform_int_distribution<std::size_t>(0, runnable.size() - 1)(rng_)];
      std::unique_lock lk(mu_);
      running_ = p->id;
      p->cv.notify_one();
      driver_cv_.wait(lk, [&] { return running_ == -1; });
    }
  }
  [[nodiscard]] const std::string& why() const noexcept { return why_; }
  /// Scheduling decisions taken so far.
  [[nodiscard]] std::uint64_t steps() const noexcept { return steps_; }

  // ---- on a process's thread ----------------------------------------------------------------

  /// A point at which another process may run.
  void yield() { block(nullptr, now_); }

  /// Waits until `ready()` holds (true) or virtual time reaches `deadline` (false).
  bool block_until(const std::function<bool()>& ready, clock::time_point deadline) {
    for (;;) {
      if (ready && ready()) return true;
      if (now_ >= deadline) return false;
      block(ready, deadline);
    }
  }

  /// The seeded generator (draws happen in scheduling order, so they are deterministic too).
  [[nodiscard]] std::mt19937_64& rng() noexcept { return rng_; }
  /// A uniform draw in [lo, hi].
  std::int64_t uniform(std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng_);
  }
  /// True with probability `p`.
  bool chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }

  // ---- ddp::time_source ---------------------------------------------------------------------

  clock::time_point now() override { return now_; }
  std::int64_t wall_ms() override {
    return 1'800'000'000'000 + std::chrono::duration_cast<std::chrono::milliseconds>(now_ - epoch()).count();
  }
  void sleep_until(clock::time_point t) override { block_until(nullptr, t); }

  /// Virtual time since the simulation began.
  [[nodiscard]] std::chrono::milliseconds elapsed() const {
    return std::chrono::duration_cast<std::chrono::milliseconds>(now_ - epoch());
  }

 private:
  struct proc {
    enum state_t { runnable, blocked, done };
    std::string name;
    int id = 0;
    state_t state = runnable;
    std::function<bool()> until;  // what a blocked process waits for (may be null)
    clock::time_point wake{};     // ... or until when
    bool kill = false;
    std::exception_ptr error;
    std::condition_variable cv;  // signalled when the scheduler picks this process
    std::thread thread;
  };

  static clock::time_point epoch() { return clock::time_point(std::chrono::hours(1)); }

  // Hands control to the driver; returns when this process is picked again.
  void block(const std::function<bool()>& ready, clock::time_point wake) {
    proc& me = *procs_.at(static_cast<std::size_t>(running_));
    me.state = ready || wake > now_ ? proc::blocked : proc::runnable;
    me.until = ready;
    me.wake = wake;
    {
      std::unique_lock lk(mu_);
      running_ = -1;
      driver_cv_.notify_one();
      me.cv.wait(lk, [&] { return running_ == me.id; });
    }
    me.state = proc::runnable;
    me.until = nullptr;
    // At every scheduling point from now on: code that catches everything (the Manager captures
    // a collective's error) must not keep a dead process running. No destructor on the way out
    // reaches a scheduling point (they abort communicators, which is immediate).
    if (me.kill) throw killed{};
  }

  std::mt19937_64 rng_;
  clock::time_point now_ = epoch();
  std::vector<std::unique_ptr<proc>> procs_;
  std::mutex mu_;
  std::condition_variable driver_cv_;  // signalled when the running process hands control back
  int running_ = -1;
  std::string why_;
  std::uint64_t steps_ = 0;
};

}  // namespace sim
