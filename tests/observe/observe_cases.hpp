#pragma once
// Observability cases (straggler attribution, timeline), written once against communicator_ref
// and run over the local backend (threads) and MPI (processes). They throw suite_failure (via
// SUITE_EXPECT) rather than using Catch assertions: the local backend runs them on threads.

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <ddp/bucketer.hpp>
#include <ddp/buffer_reducer.hpp>
#include <ddp/join.hpp>
#include <ddp/straggler.hpp>
#include <ddp/timeline.hpp>

#include "../common/collective_suite.hpp"
#include "../common/mini_json.hpp"

namespace observe_cases {

// A model of `grads` gradients; the "backward pass" marks them last first, sleeping `pause` after
// the first half on the delayed rank.
struct toy_model {
  std::vector<std::vector<float>> g;
  explicit toy_model(std::size_t grads = 6, std::size_t count = 4096) : g(grads, std::vector<float>(count, 1.0f)) {}
  template <class B>
  void register_with(B& b) {
    for (auto& x : g) b.add(x);
  }
  template <class B>
  void backward(B& b, std::chrono::milliseconds pause) {
    const std::size_t n = g.size();
    for (std::size_t k = 0; k < n; ++k) {
      if (k == n / 2 && pause.count() > 0) std::this_thread::sleep_for(pause);
      b.mark_ready(n - 1 - k);
    }
  }
};

struct straggler_result {
  int ranks = 0;
  int iterations = 0;          // delayed iterations, over all choices of the delayed rank
  int named = 0;               // of those, how many named the delayed rank
  double min_late_ms = 1e300;  // smallest lateness reported for a named delayed rank
};

// Every rank in turn sleeps `delay` in the middle of its backward pass for `iters` iterations;
// with straggler_every = 1 the report must name it. All ranks must see the same report. At most
// `misses` iterations per delayed rank may name another rank (a loaded machine may deschedule a
// prompt rank for longer than the delay; the delay is chosen to make that rare).
inline straggler_result delayed_rank_is_named(ddp::communicator_ref comm, std::chrono::milliseconds delay, int iters,
                                              int misses) {
  straggler_result res;
  res.ranks = comm.size();
  toy_model m;
  ddp::Bucketer b(comm, ddp::bucketing::size_capped{.cap_bytes = 32 << 10, .small_bucket_bytes = 16 << 10},
                  {.straggler_every = 1});
  m.register_with(b);
  b.build();
  SUITE_EXPECT(b.layout().size() >= 2, "several buckets, got " << b.layout().size());
  m.backward(b, std::chrono::milliseconds(0));  // warm-up
  b.finalize();
  SUITE_EXPECT(b.last_step().straggler.valid, "a report after the warm-up step");
  SUITE_EXPECT(b.last_step().collectives == b.layout().size() + 1, "buckets + one exchange");
  for (int delayed = 0; delayed < comm.size(); ++delayed) {
    int named = 0;
    std::string seen;
    for (int it = 0; it < iters; ++it) {
      m.backward(b, comm.rank() == delayed ? delay : std::chrono::milliseconds(0));
      b.finalize();
      const ddp::step_stats& st = b.last_step();
      const ddp::straggler_report& rep = st.straggler;
      SUITE_EXPECT(rep.valid, "valid report");
      SUITE_EXPECT(rep.iteration == st.iteration, "the report describes this step");
      SUITE_EXPECT(static_cast<int>(rep.ranks.size()) == comm.size(), "one entry per rank");
      // The same report everywhere.
      std::vector<std::int64_t> mine{rep.slowest_rank, static_cast<std::int64_t>(rep.slowest_late_ms * 1e6)};
      std::vector<std::int64_t> all(2 * static_cast<std::size_t>(comm.size()));
      comm.allgather(ddp::view(mine), ddp::view(all)).wait();
      for (int r = 0; r < comm.size(); ++r) {
        SUITE_EXPECT(
            all[2 * static_cast<std::size_t>(r)] == mine[0] && all[2 * static_cast<std::size_t>(r) + 1] == mine[1],
            "rank " << r << " computed another report");
      }
      seen += std::to_string(rep.slowest_rank) + " ";
      if (rep.slowest_rank == delayed) {
        ++named;
        res.min_late_ms = std::min(res.min_late_ms, rep.slowest_late_ms);
        SUITE_EXPECT(rep.slowest_late_ms >= 0.5 * static_cast<double>(delay.count()),
                     "lateness " << rep.slowest_late_ms << " ms for a delay of " << delay.count() << " ms");
        SUITE_EXPECT(rep.ready_span_spread_ms >= 0.5 * static_cast<double>(delay.count()),
                     "backward spread " << rep.ready_span_spread_ms << " ms");
        for (int r = 0; r < comm.size(); ++r) {
          if (r == delayed) continue;
          SUITE_EXPECT(
              rep.ranks[static_cast<std::size_t>(r)].finalize_wait_ms >= 0.5 * static_cast<double>(delay.count()),
              "rank " << r << " waited only " << rep.ranks[static_cast<std::size_t>(r)].finalize_wait_ms
                      << " ms for the delayed rank");
        }
      }
    }
    res.iterations += iters;
    res.named += named;
    SUITE_EXPECT(named >= iters - misses, "delayed rank " << delayed << " named in " << named << " of " << iters
                                                          << " iterations; named: " << seen);
  }
  return res;
}

// straggler_every = 3: the exchange runs on iterations 3, 6, ...; the others report nothing and
// issue only the buckets' collectives. Local timings are there every step.
inline void exchange_period(ddp::communicator_ref comm) {
  toy_model m(4, 1024);
  ddp::Bucketer b(comm, ddp::bucketing::size_capped{}, {.straggler_every = 3});
  m.register_with(b);
  for (int it = 1; it <= 7; ++it) {
    m.backward(b, std::chrono::milliseconds(0));
    b.finalize();
    const auto& st = b.last_step();
    const bool due = it % 3 == 0;
    SUITE_EXPECT(st.straggler.valid == due, "iteration " << it << ": report " << st.straggler.valid);
    SUITE_EXPECT(st.collectives == b.layout().size() + (due ? 1 : 0), "iteration " << it);
    SUITE_EXPECT(st.last_ready_ms >= 0 && st.arrival_wait_ms >= 0, "local timings");
  }
}

// Uneven inputs with straggler_every = 1: the joined ranks' shadow iterations take part in the
// exchange (else the training ranks would wait forever) and are never named.
inline void exchange_under_join(ddp::communicator_ref comm) {
  toy_model m(4, 1024);
  ddp::Bucketer b(comm, ddp::bucketing::size_capped{}, {.straggler_every = 1});
  m.register_with(b);
  ddp::JoinContext join({}, b);
  const int batches = 2 + comm.rank();
  for (int t = 0; t < batches; ++t) {
    join.notify();
    m.backward(b, std::chrono::milliseconds(0));
    b.finalize();
    const auto& rep = b.last_step().straggler;
    SUITE_EXPECT(rep.valid, "valid report while training");
    for (int r = 0; r < comm.size(); ++r) {
      const bool joined = t >= 2 + r;
      SUITE_EXPECT(rep.ranks[static_cast<std::size_t>(r)].shadowed == joined, "rank " << r << " at batch " << t);
      if (joined) SUITE_EXPECT(rep.slowest_rank != r, "a joined rank is never the straggler");
    }
  }
  join.finish();
  SUITE_EXPECT(b.last_step().shadowed == (comm.rank() < comm.size() - 1), "last step shadowed on early ranks");
}

// ---- timeline ----------------------------------------------------------------------------------

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

struct trace_summary {
  std::map<int, std::set<std::string>> tracks;       // pid -> track names
  std::map<int, std::map<std::string, int>> events;  // pid -> "track/name" -> count
  std::set<int> processes;                           // pids with a process_name
  double min_ts = 1e300, max_end = -1e300;
};

// Parses a Chrome trace and checks its shape: an object with traceEvents, every event with
// name/ph/pid/tid, X events with dur >= 0.
inline trace_summary summarize(const std::string& text) {
  const mini_json::value doc = mini_json::parse(text);
  SUITE_EXPECT(doc.is_object(), "a JSON object");
  const mini_json::value* evs = doc.find("traceEvents");
  SUITE_EXPECT(evs && evs->is_array(), "traceEvents array");
  trace_summary s;
  std::map<std::pair<int, int>, std::string> names;
  for (const auto& e : evs->items) {
    const std::string ph = e.str("ph");
    const int pid = static_cast<int>(e.num("pid"));
    const int tid = static_cast<int>(e.num("tid"));
    SUITE_EXPECT(!e.str("name").empty() && !ph.empty() && e.find("pid") && e.find("tid"), "event fields");
    if (ph == "M") {
      const mini_json::value* a = e.find("args");
      if (e.str("name") == "thread_name") names[{pid, tid}] = a->str("name");
      if (e.str("name") == "process_name") s.processes.insert(pid);
    }
  }
  for (const auto& e : evs->items) {
    const std::string ph = e.str("ph");
    if (ph == "M") continue;
    SUITE_EXPECT(ph == "X" || ph == "i", "phase " << ph);
    const int pid = static_cast<int>(e.num("pid"));
    const int tid = static_cast<int>(e.num("tid"));
    const auto it = names.find({pid, tid});
    SUITE_EXPECT(it != names.end(), "event on a named track");
    const double ts = e.num("ts");
    const double dur = ph == "X" ? e.num("dur") : 0.0;
    SUITE_EXPECT(dur >= 0, "duration " << dur);
    s.min_ts = std::min(s.min_ts, ts);
    s.max_end = std::max(s.max_end, ts + dur);
    s.tracks[pid].insert(it->second);
    ++s.events[pid][it->second + "/" + e.str("name")];
  }
  return s;
}

// Trains `iters + rank` steps under join with a Bucketer, a BufferReducer and a recorder per rank,
// writes trace.<rank>.json into `dir`; rank 0 merges the files and checks the merged trace.
inline void timeline_of_training(ddp::communicator_ref comm, const std::filesystem::path& dir) {
  ddp::timeline::recorder rec(comm.rank());
  rec.synchronize(comm);
  SUITE_EXPECT(rec.clock_alignment() == ddp::timeline::clock_source::shared, "ranks of one host share a clock");
  toy_model m(6, 4096);
  ddp::Bucketer b(comm, ddp::bucketing::size_capped{.cap_bytes = 32 << 10, .small_bucket_bytes = 16 << 10},
                  {.straggler_every = 1});
  m.register_with(b);
  b.build();
  std::vector<float> running(16, static_cast<float>(comm.rank()));
  ddp::BufferReducer buffers(comm);
  buffers.add(running);
  ddp::JoinContext join({}, buffers, b);  // the order of their collectives in a step
  b.set_recorder(&rec);
  buffers.set_recorder(&rec);
  join.set_recorder(&rec);
  const int base = 3, mine = base + comm.rank();
  for (int t = 0; t < mine; ++t) {
    join.notify();
    buffers.sync();
    m.backward(b, std::chrono::milliseconds(0));
    b.finalize();
  }
  join.finish();
  const std::size_t buckets = b.layout().size();
  const auto file = dir / ("trace." + std::to_string(comm.rank()) + ".json");
  rec.write_file(file.string());
  comm.barrier().wait();

  // Every rank checks its own file.
  const trace_summary own = summarize(read_file(file));
  const int n = comm.size();
  const int rounds = base + n - 1;  // iterations anyone trained
  SUITE_EXPECT(own.processes.count(comm.rank()) == 1, "process_name of this rank");
  auto ev = own.events.at(comm.rank());
  SUITE_EXPECT(ev["backward/ready"] == mine * 6, "one ready mark per mark_ready: " << ev["backward/ready"]);
  for (std::size_t k = 0; k < buckets; ++k) {
    const std::string track = "bucket " + std::to_string(k);
    SUITE_EXPECT(ev[track + "/allreduce"] == mine, track << ": " << ev[track + "/allreduce"]);
    SUITE_EXPECT(ev[track + "/allreduce (shadow)"] == rounds - mine, track << " shadowed");
  }
  SUITE_EXPECT(ev["finalize/finalize"] == mine, "finalize spans");
  SUITE_EXPECT(ev["finalize/shadow iteration"] == rounds - mine, "shadow iterations");
  SUITE_EXPECT(ev["finalize/straggler exchange"] == rounds, "one exchange per round");
  SUITE_EXPECT(ev["step/step"] == rounds, "step spans");
  SUITE_EXPECT(ev["join/notify"] == mine, "notify spans");
  SUITE_EXPECT(ev["join/shadow round"] == rounds - mine + 1, "shadow rounds (+ the last, empty one)");
  SUITE_EXPECT(ev["join/post hooks"] == 1, "post hooks");
  SUITE_EXPECT(ev["buffers/sync"] == mine, "buffer syncs: " << ev["buffers/sync"]);
  SUITE_EXPECT(ev["buffers/shadow sync"] == rounds - mine, "shadowed buffer syncs");

  if (comm.rank() == 0) {
    std::vector<std::string> inputs;
    for (int r = 0; r < n; ++r) inputs.push_back((dir / ("trace." + std::to_string(r) + ".json")).string());
    const auto merged_path = dir / "merged.json";
    ddp::timeline::merge_files(inputs, merged_path.string());
    const trace_summary merged = summarize(read_file(merged_path));
    SUITE_EXPECT(static_cast<int>(merged.processes.size()) == n, "one process per rank");
    for (int r = 0; r < n; ++r) {
      SUITE_EXPECT(merged.tracks.count(r) == 1, "rank " << r << " has tracks");
      for (const char* t : {"step", "backward", "bucket 0", "finalize", "buffers", "join"}) {
        SUITE_EXPECT(merged.tracks.at(r).count(t) == 1, "rank " << r << " lacks track " << t);
      }
      SUITE_EXPECT(merged.events.at(r).at("backward/ready") == (base + r) * 6, "rank " << r << " marks in the merge");
    }
    // A common origin: every rank's events start within the run, close to 0 (synchronize()).
    SUITE_EXPECT(merged.min_ts >= -1e6 && merged.max_end < 600e6,
                 "timestamps since the common origin: " << merged.min_ts << " .. " << merged.max_end);
  }
  comm.barrier().wait();
}

}  // namespace observe_cases
