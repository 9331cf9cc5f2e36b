#pragma once
/// @file bucketer/observe.hpp
/// @brief The Bucketer's observation part: the end-of-step timings, the straggler exchange
/// (straggler.hpp) and the timeline events (timeline.hpp) of one iteration. Not for users.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include <ddp/bucketer/options.hpp>
#include <ddp/communicator.hpp>
#include <ddp/straggler.hpp>
#include <ddp/tensor.hpp>
#include <ddp/timeline.hpp>
#include <ddp/work.hpp>

namespace ddp::detail {

/// Milliseconds from `a` to `b`.
[[nodiscard]] inline double ms_between(clock::time_point a, clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

/// One allgather of `timing_words` int64 per rank; every rank computes the same report into
/// `s.straggler`. Collective.
inline void exchange_timings(step_stats& s, communicator_ref comm, timeline::recorder* rec) {
  const timeline::scoped_span span(rec, "finalize", "straggler exchange");
  rank_timing mine;
  mine.ready_span_ms = s.last_ready_ms;
  mine.finalize_wait_ms = s.finalize_wait_ms;
  mine.arrival_wait_ms = s.arrival_wait_ms;
  mine.shadowed = s.shadowed;
  std::vector<std::int64_t> words = timing_to_words(s.iteration, mine);
  std::vector<std::int64_t> all(timing_words * static_cast<std::size_t>(comm.size()), timing_unset);
  comm.allgather(view(words), view(all)).wait();
  ++s.collectives;
  s.straggler = attribute_straggler(all);
}

/// End of a synchronised or shadowed iteration `s` (its number already set): local timings, the
/// straggler exchange when due (every `straggler_every`-th iteration), the timeline's finalize
/// and step spans.
inline void observe_step(step_stats& s, std::uint32_t straggler_every, communicator_ref comm, timeline::recorder* rec,
                         clock::time_point iteration_start, clock::time_point finalize_called) {
  double last_launch = 0, last_complete = 0;
  for (const auto& b : s.buckets) {
    last_launch = std::max(last_launch, b.launched_ms);
    last_complete = std::max(last_complete, b.completed_ms);
  }
  s.last_ready_ms = s.shadowed ? 0.0 : last_launch;
  s.arrival_wait_ms = std::max(0.0, last_complete - last_launch);
  const auto end = clock::now();
  if (straggler_every > 0 && s.iteration % straggler_every == 0) exchange_timings(s, comm, rec);
  if (rec) {
    const char* what = s.shadowed ? "shadow iteration" : "finalize";
    rec->span("finalize", what, finalize_called, end, {{"wait_ms", s.finalize_wait_ms}});
    const auto& st = s.straggler;
    rec->span("step", "step", iteration_start, clock::now(),
              {{"iteration", static_cast<double>(s.iteration)},
               {"slowest_rank", st.valid ? static_cast<double>(st.slowest_rank) : -1.0},
               {"arrival_wait_ms", s.arrival_wait_ms}});
  }
}

/// Bucket `b`'s collective on its own timeline track, from its launch to `completed`.
inline void record_bucket(timeline::recorder& rec, std::size_t b, const bucket_stats& s,
                          clock::time_point iteration_start, clock::time_point completed, bool shadowing) {
  const auto launched = iteration_start + std::chrono::duration_cast<clock::duration>(
                                              std::chrono::duration<double, std::milli>(s.launched_ms));
  rec.span({"bucket", static_cast<int>(b)}, shadowing ? "allreduce (shadow)" : "allreduce", launched, completed,
           {{"bytes", static_cast<double>(s.bytes)}, {"gradients", static_cast<double>(s.gradients)}});
}

}  // namespace ddp::detail
