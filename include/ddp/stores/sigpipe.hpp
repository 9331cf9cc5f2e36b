#pragma once
/// @file stores/sigpipe.hpp
/// @brief SIGPIPE handling for code that writes to sockets with plain write(2): gloo and hiredis.
///
/// Writing to a socket whose peer is gone raises SIGPIPE, and the default action kills the
/// process: a dead peer or a dead Redis server would take every survivor down with it instead of
/// turning into a `communication_error`. The library never changes the process-wide disposition
/// behind the user's back. It blocks SIGPIPE only in the threads that write (`sigpipe_guard`):
/// the write then fails with EPIPE, which the caller reports. Threads inherit the mask of the
/// thread that creates them, so gloo's I/O thread, created under a guard, keeps SIGPIPE blocked
/// for its lifetime. `ignore_sigpipe()` is there for programs that prefer the simple, global fix.

#include <pthread.h>
#include <signal.h>

#include <ctime>

namespace ddp {

/// Blocks SIGPIPE in the calling thread for the guard's lifetime, then discards a SIGPIPE that
/// became pending meanwhile (our own failed write) and restores the previous mask.
class sigpipe_guard {
 public:
  sigpipe_guard() noexcept {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    sigset_t pending;
    sigemptyset(&pending);
    was_pending_ = sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1;
    active_ = pthread_sigmask(SIG_BLOCK, &pipe_, &old_) == 0;
  }
  ~sigpipe_guard() {
    if (!active_) return;
    sigset_t pending;
    sigemptyset(&pending);
    if (!was_pending_ && sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1) {
      const timespec zero{0, 0};
      (void)sigtimedwait(&pipe_, nullptr, &zero);
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  sigpipe_guard(const sigpipe_guard&) = delete;
  sigpipe_guard& operator=(const sigpipe_guard&) = delete;

 private:
  sigset_t pipe_{};
  sigset_t old_{};
  bool was_pending_ = false;
  bool active_ = false;
};

/// Process-wide alternative: ignore SIGPIPE unless the program installed its own handler.
/// Call once, early in main. Returns true if it changed the disposition.
inline bool ignore_sigpipe() noexcept {
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) != 0 || current.sa_handler != SIG_DFL) return false;
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  return sigaction(SIGPIPE, &ignore, nullptr) == 0;
}

}  // namespace ddp
