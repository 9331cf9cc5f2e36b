#pragma once
// The deterministic simulation's scheduler (docs/testing.md, "Deterministic simulation"): every
// simulated process has its own stack and runs the production code, but only one runs at a time.
// It runs until its next scheduling point (a store operation, a collective, a sleep, a poll),
// then hands control back, and the scheduler picks the next process with its seeded generator.
// Time is virtual: it moves only when no process can run, to the earliest deadline one of them
// waits for. So one seed is one interleaving and one timing, replayed exactly, and the protocol
// code under test is the production code, given this scheduler as its `ddp::time_source`.
// A process can also hang (`freeze`): it is not picked until a virtual time, while time moves on.
//
// The processes are fibers on the scheduler's thread (fiber.hpp): a hand-off is a user-space
// context switch, not two trips through the kernel's scheduler as with one thread per process.
// A scheduler and its processes stay on the thread that created it; schedulers on different
// threads (seeds run in parallel) share nothing.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <ddp/time_source.hpp>

#include "fiber.hpp"

namespace sim {

using ddp::clock;
using namespace std::chrono_literals;

/// Thrown into a process the scheduler killed, at its next scheduling point: it unwinds as if
/// the process had vanished there.
struct killed {};

class scheduler final : public ddp::time_source {
 public:
  explicit scheduler(std::uint64_t seed) : rng_(seed) {}
  ~scheduler() override { shutdown(); }

  /// Processes still running (a run that hit its limit) die now: they unwind at their next
  /// scheduling point, with time free to move. Whoever owns what they use (the store, the
  /// network, the oracle they report to) calls this before destroying it.
  void shutdown() {
    for (auto& p : procs_) {
      if (p->state != proc::done) p->kill = true;
    }
    run(clock::time_point::max());
  }

  // ---- processes --------------------------------------------------------------------------

  /// A new process running `body` (from the driver or from another process). It starts when
  /// the scheduler first picks it. Returns its id.
  int spawn(std::string name, std::function<void()> body) {
    auto p = std::make_unique<proc>();
    p->name = std::move(name);
    p->id = static_cast<int>(procs_.size());
    p->owner = this;
    p->body = std::move(body);
    p->stack = detail::stack::take();
    p->ctx.make(p->stack, &proc_main, p.get());
    live_.push_back(p.get());
    procs_.push_back(std::move(p));
    return procs_.back()->id;
  }

  /// Process `id` dies at its next scheduling point (at once if it is waiting, or hung: a
  /// stopped process dies of SIGKILL too).
  void kill(int id) {
    proc& p = *procs_.at(static_cast<std::size_t>(id));
    if (p.state == proc::done) return;
    p.kill = true;
    p.frozen_until = {};
  }

  /// Process `id` hangs where it waits until virtual time `until`, as under SIGSTOP then SIGCONT:
  /// the scheduler does not pick it meanwhile, whatever it waits for, but it keeps everything it
  /// holds (its communicators, its place in collectives, its store session) and its deadlines keep
  /// passing. It waits at a scheduling point, so it holds no lock of the shared world: the store
  /// and the network are changed only between scheduling points. False if it ended or is dying.
  bool freeze(int id, clock::time_point until) {
    proc& p = *procs_.at(static_cast<std::size_t>(id));
    if (p.state == proc::done || p.kill) return false;
    p.frozen_until = std::max(p.frozen_until, until);
    return true;
  }
  [[nodiscard]] bool frozen(int id) const { return procs_.at(static_cast<std::size_t>(id))->frozen_until > now_; }
  /// When the last hang ends, or ended by itself (a killed process's hang does not count): a job's
  /// faults last until then at least (the epoch if it had no hang).
  [[nodiscard]] clock::time_point last_thaw() const noexcept {
    clock::time_point t = last_thaw_;
    for (const proc* p : live_) t = std::max(t, p->frozen_until);
    return t;
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
    std::vector<proc*>& runnable = runnable_;
    for (;;) {
      runnable.clear();
      clock::time_point next = clock::time_point::max();
      bool any = false;
      for (proc* p : live_) {  // in the order of their ids, as the draw below expects
        any = true;
        if (p->frozen_until > now_) {  // hung: only time moves it (to its end, if nothing else runs)
          next = std::min(next, p->frozen_until);
          continue;
        }
        if (p->frozen_until != clock::time_point{}) thaw(*p);
        if (p->state == proc::runnable || p->kill || (p->until && (*p->until)()) || p->wake <= now_) {
          runnable.push_back(p);
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
      running_ = p->id;
      detail::context::jump(driver_, p->ctx);  // back when it reaches a scheduling point or ends
      if (p->state == proc::done) {
        p->body = nullptr;
        p->stack.release();
        live_.erase(std::find(live_.begin(), live_.end(), p));
      }
    }
  }
  [[nodiscard]] const std::string& why() const noexcept { return why_; }
  /// Scheduling decisions taken so far.
  [[nodiscard]] std::uint64_t steps() const noexcept { return steps_; }

  // ---- in a process --------------------------------------------------------------------------

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
    const std::function<bool()>* until = nullptr;  // what a blocked process waits for (may be null)
    clock::time_point wake{};                      // ... or until when
    bool kill = false;
    clock::time_point frozen_until{};  // hung until then (freeze); before the epoch: not hung
    std::exception_ptr error;
    scheduler* owner = nullptr;
    std::function<void()> body;
    detail::stack stack;
    detail::context ctx;  // where it resumes when the scheduler picks it
  };

  // A process's first frame, on its own stack: runs the body, then hands control back for good.
  static void proc_main(void* arg) {
    proc& p = *static_cast<proc*>(arg);
    try {
      if (!p.kill) p.body();
    } catch (const killed&) {
    } catch (...) {
      p.error = std::current_exception();
    }
    p.state = proc::done;
    p.owner->running_ = -1;
    detail::context::leave(p.ctx, p.owner->driver_);  // never resumed: its stack is released
  }

  static clock::time_point epoch() { return clock::time_point(std::chrono::hours(1)); }

  // A hang ended: the process is picked again as what it waits for allows.
  void thaw(proc& p) {
    last_thaw_ = std::max(last_thaw_, p.frozen_until);
    p.frozen_until = {};
  }

  // Hands control to the driver; returns when this process is picked again.
  void block(const std::function<bool()>& ready, clock::time_point wake) {
    proc& me = *procs_.at(static_cast<std::size_t>(running_));
    me.state = ready || wake > now_ ? proc::blocked : proc::runnable;
    me.until = ready ? &ready : nullptr;  // lives on this process's stack while it waits
    me.wake = wake;
    running_ = -1;
    detail::context::jump(me.ctx, driver_);
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
  std::vector<proc*> live_;  // the processes not done, in the order of their ids
  detail::context driver_;   // where the driver resumes when a process hands control back
  std::vector<proc*> runnable_;
  int running_ = -1;
  std::string why_;
  std::uint64_t steps_ = 0;
  clock::time_point last_thaw_ = epoch();
};

}  // namespace sim
