#pragma once
/// @file timeline.hpp
/// @brief `timeline::recorder`: an optional per-rank event recorder that writes Chrome trace JSON
/// (chrome://tracing, https://ui.perfetto.dev), and `timeline::merge`, which joins the ranks'
/// files into one trace with a track group per rank.
///
/// Components take a `recorder*` (`set_recorder`; null records nothing); there is no global
/// recorder. Usage, the tracks, the cost and how clocks are aligned across ranks and hosts:
/// docs/observability.md ("The timeline").

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <ostream>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <unistd.h>

#include <ddp/communicator.hpp>
#include <ddp/detail/fnv1a.hpp>
#include <ddp/error.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp::timeline {

/// A named number attached to an event (shown in the trace viewer's details pane).
struct arg {
  const char* key = nullptr;  ///< static string; null: no argument
  double value = 0;           ///< the value
};

/// Where an event lies: a static name, optionally indexed ("bucket", 3 is the track "bucket 3").
struct track_ref {
  const char* name = "";  ///< static string
  int index = -1;         ///< -1: not indexed

  /// Track `n` (implicit from a string literal).
  track_ref(const char* n) noexcept : name(n) {}  // NOLINT(google-explicit-constructor)
  /// Track `n i`.
  track_ref(const char* n, int i) noexcept : name(n), index(i) {}
};

/// One recorded event.
struct event {
  clock::time_point start{};  ///< begin (instants: the moment)
  clock::time_point end{};    ///< end (instants: equal to start)
  track_ref track{""};        ///< where it is drawn
  const char* name = "";      ///< static string
  bool instant = false;       ///< a mark rather than an interval
  std::array<arg, 3> args{};  ///< up to three numbers
  std::string detail;         ///< optional text (rare events only: it allocates)
};

/// Knobs of a recorder.
struct recorder_options {
  /// Events kept; once full, each new event overwrites the oldest.
  std::size_t capacity = std::size_t{1} << 17;
};

/// How `synchronize()` related this rank's clock to rank 0's.
enum class clock_source : unsigned char {
  local,      ///< not synchronised: the steady clock's own origin
  shared,     ///< same host as rank 0: its clock, exactly
  estimated,  ///< another host: offset estimated from barrier exits
};

namespace detail {

inline void write_escaped(std::ostream& os, std::string_view s) {
  for (const char c : s) {
    switch (c) {
      case '"': os << "\\\""; break;
      case '\\': os << "\\\\"; break;
      case '\n': os << "\\n"; break;
      case '\r': os << "\\r"; break;
      case '\t': os << "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          os << buf;
        } else {
          os << c;
        }
    }
  }
}

// A number as JSON: finite, at most 3 decimals (microseconds to the nanosecond).
inline void write_number(std::ostream& os, double v) {
  if (!std::isfinite(v)) v = 0;
  char buf[64];
  if (v == std::floor(v) && std::fabs(v) < 9e15) {
    std::snprintf(buf, sizeof buf, "%.0f", v);
  } else {
    std::snprintf(buf, sizeof buf, "%.3f", v);
  }
  os << buf;
}

// Order of the known tracks in a rank's group; unknown ones follow, by name.
inline int track_rank(std::string_view name) {
  constexpr std::array<std::string_view, 8> order{"step",    "backward", "bucket",  "finalize",
                                                  "buffers", "join",     "manager", "progress"};
  for (std::size_t i = 0; i < order.size(); ++i) {
    if (order[i] == name) return static_cast<int>(i);
  }
  return static_cast<int>(order.size());
}

inline std::uint64_t host_hash() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return 0;
  return ddp::detail::fnv1a(std::string_view(name)) & 0x7fffffffffffffffull;
}

inline std::int64_t ns_of(clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

}  // namespace detail

/// Records one rank's events in memory and writes them as Chrome trace JSON. Thread-safe
/// (`Bucketer::mark_ready` may record from several threads). Neither copyable nor movable:
/// components hold a pointer to it.
class recorder {
 public:
  /// @param rank     the rank whose events these are (the trace's `pid`)
  /// @param options  capacity of the ring of events
  explicit recorder(int rank = 0, recorder_options options = {}) : rank_(rank), opts_(options) {
    if (opts_.capacity == 0) throw usage_error(rank, "timeline::recorder", "capacity must be at least 1");
  }
  recorder(const recorder&) = delete;
  recorder& operator=(const recorder&) = delete;

  /// The rank written as the trace's process id.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// Sets the rank (e.g. after a Manager assigned one).
  void set_rank(int r) noexcept { rank_ = r; }

  /// False while paused: components skip their hooks.
  [[nodiscard]] bool enabled() const noexcept { return enabled_.load(std::memory_order_relaxed); }
  /// Stops recording (events are dropped, not counted) until `resume()`.
  void pause() noexcept { enabled_.store(false, std::memory_order_relaxed); }
  /// Records again.
  void resume() noexcept { enabled_.store(true, std::memory_order_relaxed); }

  /// An interval on `track` from `start` to `end`.
  void span(track_ref track, const char* name, clock::time_point start, clock::time_point end,
            std::initializer_list<arg> args = {}, std::string_view detail = {}) {
    if (!enabled()) return;
    event e;
    e.start = start;
    e.end = std::max(start, end);
    e.track = track;
    e.name = name;
    fill(e, args, detail);
    push(std::move(e));
  }

  /// A mark on `track` at `at`.
  void instant(track_ref track, const char* name, clock::time_point at, std::initializer_list<arg> args = {},
               std::string_view detail = {}) {
    if (!enabled()) return;
    event e;
    e.start = e.end = at;
    e.track = track;
    e.name = name;
    e.instant = true;
    fill(e, args, detail);
    push(std::move(e));
  }

  /// Events currently held, oldest first.
  [[nodiscard]] std::vector<event> events() const {
    std::lock_guard lk(mutex_);
    std::vector<event> out;
    out.reserve(ring_.size());
    for (std::size_t k = 0; k < ring_.size(); ++k) out.push_back(ring_[(head_ + k) % ring_.size()]);
    return out;
  }
  /// Number of events held.
  [[nodiscard]] std::size_t size() const {
    std::lock_guard lk(mutex_);
    return ring_.size();
  }
  /// Events overwritten because the ring was full.
  [[nodiscard]] std::uint64_t dropped() const {
    std::lock_guard lk(mutex_);
    return dropped_;
  }
  /// Forgets every event.
  void clear() {
    std::lock_guard lk(mutex_);
    ring_.clear();
    head_ = 0;
    dropped_ = 0;
  }

  /// Collective over `comm` (every rank calls it, with its own recorder): agrees on a common
  /// time origin, rank 0's clock at the first round (see the file description). Costs
  /// `rounds` barriers and allgathers of two int64 per rank. Also sets `rank()` to `comm.rank()`.
  void synchronize(communicator_ref comm, int rounds = 5) {
    rounds = std::max(rounds, 1);
    const auto n = static_cast<std::size_t>(comm.size());
    const auto me = static_cast<std::size_t>(comm.rank());
    const std::int64_t host = detail::host_hash();
    std::vector<std::int64_t> diffs;
    std::int64_t origin0 = 0;
    bool same_host = true;
    for (int k = 0; k < rounds; ++k) {
      comm.barrier().wait();
      std::vector<std::int64_t> mine{detail::ns_of(clock::now()), host};
      std::vector<std::int64_t> all(2 * n);
      comm.allgather(view(mine), view(all)).wait();
      if (k == 0) origin0 = all[0];
      same_host = all[1] == host;
      diffs.push_back(all[2 * me] - all[0]);
    }
    std::sort(diffs.begin(), diffs.end());
    const std::int64_t offset = same_host ? 0 : diffs[diffs.size() / 2];
    std::lock_guard lk(mutex_);
    rank_ = comm.rank();
    origin_ns_ = origin0 + offset;  // rank 0's first reading, on this rank's clock
    offset_ns_ = offset;
    source_ = same_host ? clock_source::shared : clock_source::estimated;
  }
  /// How the clock was related to rank 0's (`local` before `synchronize()`).
  [[nodiscard]] clock_source clock_alignment() const {
    std::lock_guard lk(mutex_);
    return source_;
  }
  /// This rank's clock minus rank 0's, as estimated by `synchronize()` (0 on rank 0's host).
  [[nodiscard]] std::chrono::nanoseconds clock_offset() const {
    std::lock_guard lk(mutex_);
    return std::chrono::nanoseconds(offset_ns_);
  }

  /// Writes Chrome trace JSON: one object, `traceEvents` holding one event per line (the layout
  /// `merge()` relies on), timestamps in microseconds since the common origin.
  void write(std::ostream& os) const {
    const std::vector<event> evs = events();
    std::int64_t origin = 0;
    int pid = 0;
    std::uint64_t dropped = 0;
    clock_source src = clock_source::local;
    std::int64_t offset = 0;
    {
      std::lock_guard lk(mutex_);
      origin = origin_ns_;
      pid = rank_;
      dropped = dropped_;
      src = source_;
      offset = offset_ns_;
    }
    // Tracks in display order.
    struct track_key {
      std::string name;
      int index;
    };
    std::vector<track_key> tracks;
    auto tid_of = [&](const track_ref& t) -> std::size_t {
      for (std::size_t i = 0; i < tracks.size(); ++i) {
        if (tracks[i].index == t.index && tracks[i].name == t.name) return i;
      }
      tracks.push_back({t.name, t.index});
      return tracks.size() - 1;
    };
    for (const auto& e : evs) tid_of(e.track);
    std::vector<std::size_t> order(tracks.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      const int ra = detail::track_rank(tracks[a].name), rb = detail::track_rank(tracks[b].name);
      if (ra != rb) return ra < rb;
      if (tracks[a].name != tracks[b].name) return tracks[a].name < tracks[b].name;
      return tracks[a].index < tracks[b].index;
    });
    std::vector<std::size_t> tid(tracks.size());
    for (std::size_t pos = 0; pos < order.size(); ++pos) tid[order[pos]] = pos + 1;

    const char* src_name = src == clock_source::shared      ? "shared"
                           : src == clock_source::estimated ? "estimated"
                                                            : "local";
    os << "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"ddp_rank\":" << pid << ",\"clock\":\"" << src_name
       << "\",\"clock_offset_us\":";
    detail::write_number(os, static_cast<double>(offset) / 1e3);
    os << ",\"dropped_events\":" << dropped << "},\n\"traceEvents\":[\n";
    bool first = true;
    auto next = [&] {
      if (!first) os << ",\n";
      first = false;
    };
    next();
    os << "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << pid << ",\"tid\":0,\"args\":{\"name\":\"rank " << pid
       << "\"}}";
    next();
    os << "{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":" << pid
       << ",\"tid\":0,\"args\":{\"sort_index\":" << pid << "}}";
    for (std::size_t i = 0; i < tracks.size(); ++i) {
      next();
      os << "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" << pid << ",\"tid\":" << tid[i]
         << ",\"args\":{\"name\":\"";
      detail::write_escaped(os, tracks[i].name);
      if (tracks[i].index >= 0) os << ' ' << tracks[i].index;
      os << "\"}}";
      next();
      os << "{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":" << pid << ",\"tid\":" << tid[i]
         << ",\"args\":{\"sort_index\":" << tid[i] << "}}";
    }
    for (const auto& e : evs) {
      next();
      os << "{\"name\":\"";
      detail::write_escaped(os, e.name);
      os << "\",\"cat\":\"ddp\",\"ph\":\"" << (e.instant ? "i" : "X") << "\",\"ts\":";
      detail::write_number(os, static_cast<double>(detail::ns_of(e.start) - origin) / 1e3);
      if (e.instant) {
        os << ",\"s\":\"t\"";
      } else {
        os << ",\"dur\":";
        detail::write_number(os, static_cast<double>(detail::ns_of(e.end) - detail::ns_of(e.start)) / 1e3);
      }
      os << ",\"pid\":" << pid << ",\"tid\":" << tid[tid_of(e.track)];
      bool any = !e.detail.empty();
      for (const auto& a : e.args) any = any || a.key != nullptr;
      if (any) {
        os << ",\"args\":{";
        bool first_arg = true;
        for (const auto& a : e.args) {
          if (!a.key) continue;
          os << (first_arg ? "" : ",") << '"';
          detail::write_escaped(os, a.key);
          os << "\":";
          detail::write_number(os, a.value);
          first_arg = false;
        }
        if (!e.detail.empty()) {
          os << (first_arg ? "" : ",") << "\"detail\":\"";
          detail::write_escaped(os, e.detail);
          os << '"';
        }
        os << '}';
      }
      os << '}';
    }
    os << "\n]}\n";
  }

  /// `write()` to a file (replaced if it exists).
  /// @throws usage_error if the file cannot be written
  void write_file(const std::string& path) const {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    if (!f) throw usage_error(rank_, "timeline::recorder::write_file", "cannot open '" + path + "' for writing");
    write(f);
    f.flush();
    if (!f) throw usage_error(rank_, "timeline::recorder::write_file", "failed writing '" + path + "'");
  }

 private:
  static void fill(event& e, std::initializer_list<arg> args, std::string_view detail) {
    std::size_t k = 0;
    for (const arg& a : args) {
      if (k < e.args.size()) e.args[k++] = a;
    }
    if (!detail.empty()) e.detail = std::string(detail);
  }

  void push(event&& e) {
    std::lock_guard lk(mutex_);
    if (ring_.size() < opts_.capacity) {
      ring_.push_back(std::move(e));
      return;
    }
    ring_[head_] = std::move(e);
    head_ = (head_ + 1) % ring_.size();
    ++dropped_;
  }

  int rank_;
  recorder_options opts_;
  std::atomic<bool> enabled_{true};
  mutable std::mutex mutex_;
  std::vector<event> ring_;
  std::size_t head_ = 0;  // oldest event once the ring is full
  std::uint64_t dropped_ = 0;
  std::int64_t origin_ns_ = 0;
  std::int64_t offset_ns_ = 0;
  clock_source source_ = clock_source::local;
};

/// An interval recorded when the scope ends (nothing if the recorder is null or paused).
class [[nodiscard]] scoped_span {
 public:
  /// Starts the interval now on `track` of `rec` (which may be null).
  scoped_span(recorder* rec, track_ref track, const char* name) noexcept
      : rec_(rec && rec->enabled() ? rec : nullptr), track_(track), name_(name) {
    if (rec_) start_ = clock::now();
  }
  scoped_span(const scoped_span&) = delete;
  scoped_span& operator=(const scoped_span&) = delete;
  /// Records the interval (errors while recording are swallowed: never throws).
  ~scoped_span() {
    if (!rec_) return;
    try {
      rec_->span(track_, name_, start_, clock::now(), {args_[0], args_[1], args_[2]}, detail_);
    } catch (...) {  // out of memory while recording: drop the event
    }
  }
  /// Attaches a number (up to three; later ones are ignored).
  void set(const char* key, double value) noexcept {
    if (n_ < args_.size()) args_[n_++] = {key, value};
  }
  /// Attaches a text.
  void set_detail(std::string text) {
    if (rec_) detail_ = std::move(text);
  }
  /// When the interval started (meaningless if nothing is recorded).
  [[nodiscard]] clock::time_point start() const noexcept { return start_; }

 private:
  recorder* rec_;
  track_ref track_;
  const char* name_;
  clock::time_point start_{};
  std::array<arg, 3> args_{};
  std::size_t n_ = 0;
  std::string detail_;
};

/// Merges traces written by `recorder::write` (one per rank) into one Chrome trace: every
/// rank's events with their own `pid`, so the viewer shows one group of tracks per rank.
/// Relies on the writer's layout (one event per line); timestamps are kept as written, so
/// ranks align as well as their `synchronize()` did.
/// @throws usage_error if an input is not such a file
inline void merge(std::span<const std::string> inputs, std::ostream& out) {
  out << "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"merged_traces\":" << inputs.size() << "},\n\"traceEvents\":[\n";
  bool first = true;
  for (const auto& path : inputs) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw usage_error(-1, "timeline::merge", "cannot open '" + path + "'");
    std::string line;
    bool inside = false, closed = false;
    std::size_t events = 0;
    while (std::getline(in, line)) {
      if (!inside) {
        if (line == "\"traceEvents\":[") inside = true;
        continue;
      }
      if (line == "]}") {
        closed = true;
        break;
      }
      if (!line.empty() && line.back() == ',') line.pop_back();
      if (line.size() < 2 || line.front() != '{' || line.back() != '}') {
        throw usage_error(-1, "timeline::merge", "'" + path + "' is not a trace written by ddp::timeline::recorder");
      }
      out << (first ? "" : ",\n") << line;
      first = false;
      ++events;
    }
    if (!closed) {
      throw usage_error(-1, "timeline::merge",
                        "'" + path + "' is not a complete trace written by ddp::timeline::recorder (" +
                            std::to_string(events) + " events read)");
    }
  }
  out << "\n]}\n";
}

/// `merge()` into the file `output`.
/// @throws usage_error if an input cannot be read or the output cannot be written
inline void merge_files(std::span<const std::string> inputs, const std::string& output) {
  std::ostringstream buf;
  merge(inputs, buf);
  std::ofstream f(output, std::ios::binary | std::ios::trunc);
  if (!f) throw usage_error(-1, "timeline::merge", "cannot open '" + output + "' for writing");
  f << buf.str();
  if (!f) throw usage_error(-1, "timeline::merge", "failed writing '" + output + "'");
}

}  // namespace ddp::timeline
