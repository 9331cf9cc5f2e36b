#pragma once
/// @file straggler.hpp
/// @brief Which rank made a step slow: straggler attribution from the synchronisation itself,
/// without synchronised clocks.
///
/// The last bucket's collective completes on every rank at about the same moment, so the rank
/// that waited least for it (shortest `arrival_wait`) arrived last. The Bucketer measures the
/// timings every step and, with `bucketer_options::straggler_every`, exchanges them;
/// `attribute_straggler()` is the computation alone. How and what it costs: docs/observability.md.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace ddp {

/// One rank's timing of one step, as exchanged.
struct rank_timing {
  double ready_span_ms = 0;     ///< first mark_ready to last mark_ready (this rank's backward pass)
  double finalize_wait_ms = 0;  ///< time finalize() spent waiting for collectives
  double arrival_wait_ms = 0;   ///< last mark_ready to the completion of the last bucket
  double late_ms = 0;           ///< how long after the earliest rank this rank arrived (0 for the earliest)
  bool shadowed = false;        ///< the rank had joined (uneven inputs) and only mirrored the collectives

  /// Memberwise.
  friend bool operator==(const rank_timing&, const rank_timing&) = default;
};

/// What every rank learns about one step from the exchange (the same on every rank).
struct straggler_report {
  /// False when no exchange ran in this step (`straggler_every` is 0 or the step was not due),
  /// or when the exchange carried no data (e.g. a Manager skipped it after a failed step).
  bool valid = false;
  std::uint64_t iteration = 0;      ///< the Bucketer's synchronised iteration it describes
  int slowest_rank = -1;            ///< the rank the others waited for (shortest arrival wait)
  double slowest_late_ms = 0;       ///< how long after the earliest rank the slowest arrived
  double ready_span_spread_ms = 0;  ///< max - min of the training ranks' ready spans (backward times)
  double max_finalize_wait_ms = 0;  ///< the longest finalize() wait of any rank
  std::vector<rank_timing> ranks;   ///< per rank

  /// One line: "step 12: slowest rank 2, arrived 31.20 ms after the earliest; backward spread
  /// 30.95 ms; finalize waits 31.4/0.3/30.8 ms".
  [[nodiscard]] std::string describe() const {
    if (!valid) return "no straggler report";
    char buf[256];
    std::snprintf(
        buf, sizeof buf,
        "step %llu: slowest rank %d, arrived %.2f ms after the earliest; backward spread %.2f ms; finalize waits ",
        static_cast<unsigned long long>(iteration), slowest_rank, slowest_late_ms, ready_span_spread_ms);
    std::string s = buf;
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      std::snprintf(buf, sizeof buf, "%s%.1f", r ? "/" : "", ranks[r].finalize_wait_ms);
      s += buf;
    }
    return s + " ms";
  }
  /// Memberwise.
  friend bool operator==(const straggler_report&, const straggler_report&) = default;
};

/// int64 words per rank in the exchange: iteration, ready span, finalize wait, arrival wait (ns),
/// flags (bit 0: shadowed).
inline constexpr std::size_t timing_words = 5;

/// A rank's words for the exchange, in the layout `attribute_straggler()` reads.
[[nodiscard]] inline std::vector<std::int64_t> timing_to_words(std::uint64_t iteration, const rank_timing& t) {
  auto ns = [](double ms) { return static_cast<std::int64_t>(std::llround(ms * 1e6)); };
  return {static_cast<std::int64_t>(iteration), ns(t.ready_span_ms), ns(t.finalize_wait_ms), ns(t.arrival_wait_ms),
          t.shadowed ? 1 : 0};
}

/// Sentinel a receive buffer is filled with before the exchange: a rank whose words still hold
/// it contributed nothing (the exchange was skipped).
inline constexpr std::int64_t timing_unset = std::numeric_limits<std::int64_t>::min();

/// Computes the report from every rank's `timing_words` words (rank r's at `words[r * timing_words]`).
/// Returns an invalid report if any rank's words are unset or describe another iteration.
/// The slowest rank is the training (non-shadowed) rank with the shortest arrival wait; ties go
/// to the lowest rank.
[[nodiscard]] inline straggler_report attribute_straggler(std::span<const std::int64_t> words) {
  straggler_report rep;
  const std::size_t n = words.size() / timing_words;
  if (n == 0 || words.size() % timing_words != 0) return rep;
  rep.iteration = static_cast<std::uint64_t>(words[0]);
  rep.ranks.resize(n);
  for (std::size_t r = 0; r < n; ++r) {
    const auto w = words.subspan(r * timing_words, timing_words);
    for (const auto x : w) {
      if (x == timing_unset) return straggler_report{};
    }
    if (static_cast<std::uint64_t>(w[0]) != rep.iteration) return straggler_report{};
    rank_timing& t = rep.ranks[r];
    t.ready_span_ms = static_cast<double>(w[1]) / 1e6;
    t.finalize_wait_ms = static_cast<double>(w[2]) / 1e6;
    t.arrival_wait_ms = static_cast<double>(w[3]) / 1e6;
    t.shadowed = (w[4] & 1) != 0;
  }
  double max_wait = 0, min_span = 0, max_span = 0;
  bool any = false;
  for (std::size_t r = 0; r < n; ++r) {
    const rank_timing& t = rep.ranks[r];
    max_wait = std::max(max_wait, t.arrival_wait_ms);
    rep.max_finalize_wait_ms = std::max(rep.max_finalize_wait_ms, t.finalize_wait_ms);
    if (t.shadowed) continue;
    if (!any || t.arrival_wait_ms < rep.ranks[static_cast<std::size_t>(rep.slowest_rank)].arrival_wait_ms) {
      rep.slowest_rank = static_cast<int>(r);
    }
    min_span = any ? std::min(min_span, t.ready_span_ms) : t.ready_span_ms;
    max_span = any ? std::max(max_span, t.ready_span_ms) : t.ready_span_ms;
    any = true;
  }
  for (auto& t : rep.ranks) t.late_ms = max_wait - t.arrival_wait_ms;
  if (any) {
    rep.slowest_late_ms = rep.ranks[static_cast<std::size_t>(rep.slowest_rank)].late_ms;
    rep.ready_span_spread_ms = max_span - min_span;
  }
  rep.valid = any;
  return rep;
}

}  // namespace ddp
