#pragma once
/// @file progress.hpp
/// @brief Progress of long operations a person may be waiting on: a Manager healing a replica
/// (bytes, rate, time left) and rendezvous waits (who has not arrived yet).
///
/// Components that run such operations take a `progress_sink`, a plain callback. Its default,
/// `print_progress()`, writes rate-limited lines to stderr on rank 0 only, and only for
/// operations that last longer than a few seconds, so quick heals and rendezvous print nothing:
///
///     ddp rank 0: heal: 1.2 GiB of 3.0 GiB (40%), 310.5 MiB/s, 6.0 s left (sending state of step 812 to 1 replica)
///     ddp rank 0: gloo connect: 2 of 3 members after 4.0 s; missing: rank 2
///
/// Sinks are called from the thread running the operation; they must not throw (an exception
/// from a sink is dropped).

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace ddp {

/// One report on a long operation.
struct progress_update {
  const char* operation = "";        ///< static string: "heal", "gloo connect", "rendezvous"
  int rank = -1;                     ///< rank reporting (-1: not known yet)
  std::string detail;                ///< what is happening, in words
  std::uint64_t done_bytes = 0;      ///< bytes moved so far (transfers)
  std::uint64_t total_bytes = 0;     ///< bytes to move; 0 if the operation is not a transfer
  double elapsed_s = 0;              ///< since the operation started
  double rate_bytes_per_s = 0;       ///< average rate so far (transfers)
  double eta_s = -1;                 ///< seconds left at that rate; -1 if unknown
  int arrived = -1;                  ///< members present (rendezvous); -1 if not a rendezvous
  int expected = -1;                 ///< members waited for (rendezvous); -1 if not known
  std::vector<std::string> missing;  ///< members not arrived yet, when known
  bool finished = false;             ///< the last report of this operation

  /// One line: "heal: 1.2 GiB of 3.0 GiB (40%), 310.5 MiB/s, 6.0 s left (detail)".
  [[nodiscard]] std::string describe() const {
    std::string s = operation;
    s += ": ";
    char buf[160];
    if (total_bytes > 0) {
      const double pct = 100.0 * static_cast<double>(done_bytes) / static_cast<double>(total_bytes);
      s += bytes(static_cast<double>(done_bytes)) + " of " + bytes(static_cast<double>(total_bytes));
      std::snprintf(buf, sizeof buf, " (%.0f%%), %s/s", pct, bytes(rate_bytes_per_s).c_str());
      s += buf;
      if (finished) {
        std::snprintf(buf, sizeof buf, ", done in %.1f s", elapsed_s);
      } else if (eta_s >= 0) {
        std::snprintf(buf, sizeof buf, ", %.1f s left", eta_s);
      } else {
        buf[0] = '\0';
      }
      s += buf;
    } else if (arrived >= 0) {
      s += std::to_string(arrived);
      if (expected >= 0) s += " of " + std::to_string(expected);
      std::snprintf(buf, sizeof buf, " members after %.1f s", elapsed_s);
      s += buf;
      if (finished) s += ", complete";
      if (!missing.empty()) {
        s += "; missing: ";
        for (std::size_t i = 0; i < missing.size(); ++i) s += (i ? ", " : "") + missing[i];
      }
    } else {
      std::snprintf(buf, sizeof buf, "%s after %.1f s", finished ? "done" : "waiting", elapsed_s);
      s += buf;
    }
    if (!detail.empty()) s += " (" + detail + ")";
    return s;
  }

  /// "1.5 MiB", "812 B".
  [[nodiscard]] static std::string bytes(double b) {
    const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    std::size_t u = 0;
    while (b >= 1024.0 && u + 1 < std::size(units)) {
      b /= 1024.0;
      ++u;
    }
    char buf[32];
    std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", b, units[u]);
    return buf;
  }
};

/// Receives progress reports (see the file description).
using progress_sink = std::function<void(const progress_update&)>;

/// Settings of `print_progress()`.
struct progress_print_options {
  /// At most one line per operation this often.
  std::chrono::milliseconds interval{1000};
  /// Operations shorter than this print nothing (their final report is dropped too).
  std::chrono::milliseconds quiet{2000};
  /// false: print only reports of rank 0 (and of a rendezvous' first arrival, reported as rank 0).
  bool all_ranks = false;
  /// Where lines go.
  std::FILE* stream = stderr;
};

/// The default sink: rate-limited lines on rank 0 (see `progress_print_options`). Copies of the
/// returned function share their rate-limiting state.
[[nodiscard]] inline progress_sink print_progress(progress_print_options options = {}) {
  struct state {
    std::mutex mutex;
    std::map<std::string, std::chrono::steady_clock::time_point> last;  // per operation, once it printed
  };
  auto st = std::make_shared<state>();
  return [st, options](const progress_update& u) {
    if (!options.all_ranks && u.rank != 0) return;
    const auto now = std::chrono::steady_clock::now();
    const std::string key = std::string(u.operation) + '/' + std::to_string(u.rank);
    std::lock_guard lk(st->mutex);
    const auto it = st->last.find(key);
    const bool printed_before = it != st->last.end();
    if (u.finished) {
      if (!printed_before) return;  // a quick operation: silent
      st->last.erase(it);
    } else {
      if (u.elapsed_s * 1000.0 < static_cast<double>(options.quiet.count())) return;
      if (printed_before && now - it->second < options.interval) return;
      st->last[key] = now;
    }
    std::fprintf(options.stream, "ddp rank %d: %s\n", u.rank, u.describe().c_str());
    std::fflush(options.stream);
  };
}

/// Feeds a sink from an operation: keeps the start time, computes rate and time left, and
/// calls the sink at most every `every` (always for the final report). A null or empty sink
/// costs one branch per call.
class progress_meter {
 public:
  /// Starts timing `operation` on `rank` now.
  progress_meter(const progress_sink* sink, const char* operation, int rank, std::uint64_t total_bytes = 0,
                 std::string detail = {}, std::chrono::milliseconds every = std::chrono::milliseconds(100))
      : sink_(sink && *sink ? sink : nullptr), every_(every), start_(std::chrono::steady_clock::now()) {
    u_.operation = operation;
    u_.rank = rank;
    u_.total_bytes = total_bytes;
    u_.detail = std::move(detail);
  }
  progress_meter(const progress_meter&) = delete;
  progress_meter& operator=(const progress_meter&) = delete;

  /// True if there is a sink to report to.
  [[nodiscard]] bool active() const noexcept { return sink_ != nullptr; }
  /// True if a report would reach a sink now (lets callers skip computing what they report).
  [[nodiscard]] bool due() const noexcept { return sink_ && std::chrono::steady_clock::now() - last_ >= every_; }
  /// Adds moved bytes; reports if due.
  void add_bytes(std::uint64_t n) {
    u_.done_bytes += n;
    report(false);
  }
  /// Rendezvous state; reports if due.
  void members(int arrived, int expected, std::vector<std::string> missing = {}) {
    u_.arrived = arrived;
    u_.expected = expected;
    u_.missing = std::move(missing);
    report(false);
  }
  /// Reports that the operation is still running, if due.
  void tick() { report(false); }
  /// The final report (once).
  void finish() {
    if (u_.finished) return;
    u_.finished = true;
    u_.missing.clear();
    report(true);
  }
  /// The update as it would be reported now.
  [[nodiscard]] const progress_update& current() const noexcept { return u_; }

 private:
  void report(bool force) {
    if (!sink_) return;
    const auto now = std::chrono::steady_clock::now();
    if (!force && now - last_ < every_) return;
    last_ = now;
    u_.elapsed_s = std::chrono::duration<double>(now - start_).count();
    if (u_.total_bytes > 0 && u_.elapsed_s > 0) {
      u_.rate_bytes_per_s = static_cast<double>(u_.done_bytes) / u_.elapsed_s;
      const auto left = static_cast<double>(u_.total_bytes - std::min(u_.done_bytes, u_.total_bytes));
      u_.eta_s = u_.rate_bytes_per_s > 0 ? left / u_.rate_bytes_per_s : -1;
    }
    try {
      (*sink_)(u_);
    } catch (...) {  // a sink must not throw; a failing log line must not fail the operation
    }
  }

  const progress_sink* sink_;
  std::chrono::milliseconds every_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_{};
  progress_update u_;
};

}  // namespace ddp
