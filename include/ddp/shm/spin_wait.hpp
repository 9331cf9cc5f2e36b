#pragma once
/// @file shm/spin_wait.hpp
/// @brief `backoff`: how a rank waits for a peer in shared memory — spin with a CPU pause first
/// (a peer on another core answers within microseconds), then yield the core (with more ranks
/// than cores the peer may need this very core to make progress), then sleep briefly.

#include <sched.h>

#include <chrono>
#include <thread>

namespace ddp::shm {

/// Tells the CPU this is a spin loop (saves power, frees the sibling hyper-thread).
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

/// One waiter's escalating back-off. Cheap to construct; make one per wait.
class backoff {
 public:
  explicit backoff(unsigned spins_before_yield) noexcept : spin_limit_(spins_before_yield) {}

  /// Waits a little; each call waits at least as long as the previous one.
  void pause() noexcept {
    if (steps_ < spin_limit_) {
      cpu_relax();
    } else if (steps_ < spin_limit_ + yields_before_sleep) {
      ::sched_yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    ++steps_;
  }

  /// Steps taken so far (callers check clocks every few hundred steps, not every step).
  [[nodiscard]] unsigned steps() const noexcept { return steps_; }

 private:
  // About 10-50 ms of yielding before sleeping: a peer descheduled by an oversubscribed kernel
  // comes back within a time slice; a peer gone for longer is computing, not racing us.
  static constexpr unsigned yields_before_sleep = 200;
  unsigned spin_limit_;
  unsigned steps_ = 0;
};

}  // namespace ddp::shm
