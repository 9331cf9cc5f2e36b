#pragma once
// Ranks as processes for the gloo tests: fork N children that each run a function and exit,
// collect their exit status and what they printed, and kill whatever outlives its time limit.
// Children must not use Catch (it is not fork-aware): they throw, and the parent asserts on
// the outcome. Fork happens before any thread or connection exists in the parent.

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace gloo_test {

/// Thrown by CHILD_CHECK in a child process.
struct child_failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

#define CHILD_CHECK(cond, msg)                                               \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::ostringstream os_;                                                \
      os_ << __FILE__ << ":" << __LINE__ << ": expected " #cond ": " << msg; \
      throw ::gloo_test::child_failure(os_.str());                           \
    }                                                                        \
  } while (0)

/// Nanoseconds on CLOCK_MONOTONIC (steady_clock on Linux): comparable across processes.
inline long long now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

/// How one child ended.
struct outcome {
  int rank = -1;
  bool exited = false;  ///< normal exit (else killed by `signal`, or still running at the limit)
  int code = -1;
  int signal = 0;
  bool timed_out = false;
  std::string output;  ///< what it wrote to its report pipe

  [[nodiscard]] bool ok() const { return exited && code == 0 && !timed_out; }
  [[nodiscard]] std::string describe() const {
    std::string s = "rank " + std::to_string(rank) + ": ";
    if (timed_out) s += "still running at the time limit (killed); ";
    if (exited) {
      s += "exit " + std::to_string(code);
    } else {
      s += "killed by signal " + std::to_string(signal);
    }
    return s + "; output: " + output;
  }
  /// Value of a "key=value" line of the output, or "".
  [[nodiscard]] std::string value(const std::string& key) const {
    std::istringstream in(output);
    for (std::string line; std::getline(in, line);) {
      if (line.rfind(key + "=", 0) == 0) return line.substr(key.size() + 1);
    }
    return {};
  }
};

/// Where a child reports: "key=value" lines and, on failure, the error.
class reporter {
 public:
  explicit reporter(int fd) : fd_(fd) {}
  void say(const std::string& line) const {
    const std::string l = line + "\n";
    std::size_t done = 0;
    while (done < l.size()) {
      const ssize_t n = ::write(fd_, l.data() + done, l.size() - done);
      if (n <= 0) return;
      done += static_cast<std::size_t>(n);
    }
  }
  void set(const std::string& key, const std::string& value) const { say(key + "=" + value); }

 private:
  int fd_;
};

class process_group {
 public:
  /// Forks `n` children running `fn(rank, reporter)`; a child exits 0 if fn returns, 1 if it throws.
  process_group(int n, const std::function<void(int, const reporter&)>& fn) {
    std::fflush(nullptr);  // no buffered output duplicated into the children
    for (int r = 0; r < n; ++r) {
      int p[2];
      if (::pipe(p) != 0) throw std::runtime_error("pipe failed");
      const pid_t pid = ::fork();
      if (pid < 0) throw std::runtime_error("fork failed");
      if (pid == 0) {
        ::close(p[0]);
        for (auto& c : children_) ::close(c.fd);
        int code = 0;
        reporter rep(p[1]);
        try {
          fn(r, rep);
        } catch (const std::exception& e) {
          rep.set("error", e.what());
          code = 1;
        } catch (...) {
          rep.set("error", "unknown exception");
          code = 1;
        }
        ::close(p[1]);
        std::_Exit(code);  // no atexit handlers, no Catch teardown, no static destructors
      }
      ::close(p[1]);
      ::fcntl(p[0], F_SETFL, O_NONBLOCK);
      children_.push_back({pid, p[0], {}, false, 0});
      children_.back().out.rank = r;
    }
  }
  process_group(const process_group&) = delete;
  process_group& operator=(const process_group&) = delete;
  ~process_group() {
    for (auto& c : children_) {
      if (!c.reaped) {
        ::kill(c.pid, SIGKILL);
        ::waitpid(c.pid, nullptr, 0);
      }
      ::close(c.fd);
    }
  }

  [[nodiscard]] int size() const { return static_cast<int>(children_.size()); }
  void kill(int rank, int sig) { ::kill(children_[static_cast<std::size_t>(rank)].pid, sig); }
  /// The process id of `rank`.
  [[nodiscard]] pid_t pid(int rank) const { return children_[static_cast<std::size_t>(rank)].pid; }

  /// Output a child has written so far.
  std::string output(int rank) {
    drain();
    return children_[static_cast<std::size_t>(rank)].out.output;
  }

  /// Waits up to `limit` for child `rank` to end (it is reaped; `wait_all` reports it); true if it
  /// did. A stopped child has not ended.
  bool wait_one(int rank, std::chrono::milliseconds limit) {
    child& c = children_[static_cast<std::size_t>(rank)];
    const auto deadline = std::chrono::steady_clock::now() + limit;
    for (;;) {
      drain();
      if (c.reaped) return true;
      int status = 0;
      if (::waitpid(c.pid, &status, WNOHANG) == c.pid) {
        record(c, status);
        return true;
      }
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }

  /// Waits up to `limit` for child `rank` to be stopped (SIGSTOP, e.g. raised by itself); true if
  /// it is. False if it ended instead (it is reaped).
  bool wait_stopped(int rank, std::chrono::milliseconds limit) {
    child& c = children_[static_cast<std::size_t>(rank)];
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (!c.reaped) {
      drain();
      int status = 0;
      if (::waitpid(c.pid, &status, WNOHANG | WUNTRACED) == c.pid) {
        if (WIFSTOPPED(status)) return true;
        record(c, status);
        return false;
      }
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return false;
  }

  /// Waits for every child, up to `limit`; children still running then are SIGKILLed.
  std::vector<outcome> wait_all(std::chrono::milliseconds limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    for (;;) {
      drain();
      bool all = true;
      for (auto& c : children_) {
        if (c.reaped) continue;
        int status = 0;
        if (::waitpid(c.pid, &status, WNOHANG) == c.pid) {
          record(c, status);
        } else {
          all = false;
        }
      }
      if (all) break;
      if (std::chrono::steady_clock::now() >= deadline) {
        for (auto& c : children_) {
          if (c.reaped) continue;
          ::kill(c.pid, SIGKILL);
          int status = 0;
          ::waitpid(c.pid, &status, 0);
          record(c, status);
          c.out.timed_out = true;
        }
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    drain();
    std::vector<outcome> out;
    for (auto& c : children_) out.push_back(c.out);
    return out;
  }

 private:
  struct child {
    pid_t pid;
    int fd;
    outcome out;
    bool reaped;
    int unused;
  };

  static void record(child& c, int status) {
    c.reaped = true;
    if (WIFEXITED(status)) {
      c.out.exited = true;
      c.out.code = WEXITSTATUS(status);
    } else if (WIFSIGNALED(status)) {
      c.out.signal = WTERMSIG(status);
    }
  }

  void drain() {
    char buf[4096];
    for (auto& c : children_) {
      for (;;) {
        const ssize_t n = ::read(c.fd, buf, sizeof(buf));
        if (n <= 0) break;
        c.out.output.append(buf, static_cast<std::size_t>(n));
      }
    }
  }

  std::vector<child> children_;
};

/// A fresh directory under the temp dir, removed with everything in it.
class temp_dir {
 public:
  explicit temp_dir(const std::string& tag) {
    std::string pattern = (std::filesystem::temp_directory_path() / ("ddp-" + tag + "-XXXXXX")).string();
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  [[nodiscard]] const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

/// Every outcome as text, for assertion messages.
inline std::string describe_all(const std::vector<outcome>& outs) {
  std::string s;
  for (const auto& o : outs) s += o.describe() + "\n";
  return s;
}

}  // namespace gloo_test
