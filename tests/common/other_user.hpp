#pragma once
// Running part of a test as another user (uid/gid 65534, "nobody"), the co-tenant of
// docs/security.md: a forked child drops its privileges for good and runs a function; the parent
// reads its exit status. Only root can drop to another user: elsewhere `can_switch_user()` is
// false and the test prints "SKIP: ..." (registered as a skip in ctest).

#include <grp.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>

namespace other_user {

inline constexpr uid_t uid = 65534;
inline constexpr gid_t gid = 65534;

/// True where this process may become another user (it runs as root).
inline bool can_switch_user() { return ::geteuid() == 0; }

/// Starts `fn` in a child process as uid/gid 65534 and returns the child's pid (-1 if fork
/// failed). The child exits with `fn`'s return value, 125 if `fn` threw (the message goes to
/// stderr), 126 if privileges could not be dropped.
inline pid_t start(const std::function<int()>& fn) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  if (::setgroups(0, nullptr) != 0 || ::setresgid(gid, gid, gid) != 0 || ::setresuid(uid, uid, uid) != 0) {
    ::_exit(126);
  }
  int code = 125;
  try {
    code = fn();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "other_user: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "other_user: unknown exception\n");
  }
  std::fflush(nullptr);
  ::_exit(code);
}

/// Waits for a child of `start` and returns its exit code; 127 if it died of a signal (a crash
/// is a failure, never a pass) or cannot be waited for.
inline int wait(pid_t pid) {
  if (pid < 0) return 127;
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return 127;
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 127;
}

/// Runs `fn` as uid/gid 65534 in a child process and returns its exit code (see `start`, `wait`).
inline int run(const std::function<int()>& fn) { return wait(start(fn)); }

}  // namespace other_user
