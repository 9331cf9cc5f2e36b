#pragma once
/// @file manager/exchange.hpp
/// @brief What the members of a new quorum tell each other before training (step, fresh, layout,
/// state size, needs healing, participation rules), and what they decide from it: who is left
/// out (a layout, state size or participation rules that differ, malformed words, an impossible
/// step), who holds the committed state and at which step; and the store's bound on committed
/// steps ("step_limit"). Pure functions of the gathered words, so that they can run without a
/// Manager (ddp/manager.hpp). Not for users; the rules are in docs/fault-tolerance.md, "The quorum
/// rule".

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/error.hpp>
#include <ddp/manager/options.hpp>
#include <ddp/store.hpp>

namespace ddp::detail {

/// What one member reports when a quorum forms.
struct member_report {
  std::int64_t step = 0;                   ///< its committed steps
  std::int64_t formed = 0;                 ///< the last generation whose forming it completed (0: none, fresh)
  std::uint64_t layout = 0;                ///< its gradient layout's fingerprint (0: none set)
  std::size_t state_bytes = 0;             ///< bytes of its registered state tensors
  bool needs_heal = false;                 ///< it received part of a heal that has not passed its check
  std::int64_t rules = 0;                  ///< its participation rules (participation_rules())
  static constexpr std::size_t words = 6;  ///< int64 words per member in the exchange
  /// The words it contributes to the allgather, in this order.
  [[nodiscard]] std::vector<std::int64_t> encode() const {
    return {step, formed, static_cast<std::int64_t>(layout), static_cast<std::int64_t>(state_bytes), needs_heal ? 1 : 0,
            rules};
  }
};

/// The options every member must share, or their divisors differ (`active_replicas`,
/// `healed_replicas_participate`) or their heals do not meet (`heal_over`), as one word.
[[nodiscard]] inline std::int64_t participation_rules(const manager_options& o) noexcept {
  return std::int64_t{o.active_replicas} * 4 + (o.heal_over == heal_transport::source_routes ? 2 : 0) +
         (o.healed_replicas_participate ? 1 : 0);
}

/// A member left out of a quorum, and why.
using refused_member = std::pair<int, std::string>;

/// What the members decide from the exchange.
struct heal_plan {
  std::vector<refused_member> refused;  ///< members left out (then nothing else is decided)
  std::vector<int> sources;             ///< ranks that hold the committed state; empty: none here
  std::int64_t step = -1;               ///< the sources' step
};

/// Decides from `all` (the allgathered words, `member_report::words` per member in rank order)
/// who is left out, and who holds the committed state: the members that completed the forming
/// of generation `latest_formed` (the latest that may have committed a step: manager/quorum.hpp,
/// latest_committing; each commit holds every one of its members) or of a later one,
/// are not part-way through a heal, and are at their highest step. `latest_formed` 0: nothing formed yet
/// (then nobody holds anything: see first_heal_plan). `step_limit`: the store's "step_limit".
[[nodiscard]] inline heal_plan plan_heal(std::span<const std::int64_t> all, const std::vector<std::string>& members,
                                         std::int64_t latest_formed, std::int64_t step_limit) {
  const std::size_t n = members.size();
  const auto word = [&](std::size_t r, std::size_t k) { return all[r * member_report::words + k]; };
  // A member that completed the forming of a later generation holds the same: that generation
  // committed nothing (some member never finished forming it, so never voted), and it started
  // from the state of `latest_formed`.
  const auto holds = [&](std::size_t r) { return latest_formed == 0 || word(r, 1) >= latest_formed; };
  // The layout most members that hold the state share (of all members at a job's start); ties
  // go to the lowest rank. Replicas with another one are left out.
  std::size_t ref = 0, ref_votes = 0;
  for (std::size_t r = 0; r < n; ++r) {
    std::size_t votes = 0;
    for (std::size_t q = 0; q < n; ++q) {
      votes += holds(q) && word(q, 2) == word(r, 2) && word(q, 3) == word(r, 3) ? 1 : 0;
    }
    if (votes > ref_votes) {
      ref = r;
      ref_votes = votes;
    }
  }
  heal_plan plan;
  std::vector<bool> ok(n, true);
  for (std::size_t r = 0; r < n; ++r) {
    if (word(r, 2) != word(ref, 2) || word(r, 3) != word(ref, 3)) {
      plan.refused.emplace_back(static_cast<int>(r), "replica " + members[r] +
                                                         " registered a different gradient layout or state size (" +
                                                         std::to_string(word(r, 3)) + " state bytes) than replica " +
                                                         members[ref] + " (" + std::to_string(word(ref, 3)) + ")");
      ok[r] = false;
    } else if (word(r, 5) != word(ref, 5)) {
      const auto rules = [&](std::size_t q) {
        return "active_replicas = " + std::to_string(word(q, 5) / 4) +
               ", healed_replicas_participate = " + (word(q, 5) % 2 != 0 ? "true" : "false") +
               ", heal_over = " + (word(q, 5) / 2 % 2 != 0 ? "source_routes" : "quorum_broadcast");
      };
      plan.refused.emplace_back(static_cast<int>(r), "replica " + members[r] + " runs with " + rules(r) + ", replica " +
                                                         members[ref] + " with " + rules(ref) +
                                                         ": every replica must use the same (manager_options)");
      ok[r] = false;
    } else if (word(r, 1) < 0 || word(r, 4) < 0 || word(r, 4) > 1 || word(r, 0) < 0) {
      plan.refused.emplace_back(static_cast<int>(r), "replica " + members[r] + " reported malformed words");
      ok[r] = false;
    }
  }
  const auto holder = [&](std::size_t r) { return ok[r] && latest_formed > 0 && holds(r) && word(r, 4) == 0; };
  // The holders completed the same generation's forming, so they hold its state at its last
  // commit: their steps agree (a vote that completed on some of them only is decided in the
  // store, manager/decision.hpp; who cannot tell reports needs_heal).
  std::int64_t lo = std::numeric_limits<std::int64_t>::max();
  for (std::size_t r = 0; r < n; ++r) {
    if (holder(r)) lo = std::min(lo, word(r, 0));
  }
  const bool have_holder = lo != std::numeric_limits<std::int64_t>::max();
  // No quorum ever committed beyond "step_limit" (raise_step_limit()).
  for (std::size_t r = 0; r < n; ++r) {
    if (!ok[r] || word(r, 4) != 0) continue;
    const bool ahead = word(r, 0) == std::numeric_limits<std::int64_t>::max() || word(r, 0) > step_limit ||
                       (have_holder && word(r, 0) > lo + 1);
    if (ahead) {
      plan.refused.emplace_back(static_cast<int>(r),
                                "replica " + members[r] + " reported step " + std::to_string(word(r, 0)) +
                                    ", ahead of every committed quorum (the members that hold the state "
                                    "hold step " +
                                    (have_holder ? std::to_string(lo) : std::string("none")) +
                                    ", no quorum may have committed beyond " + std::to_string(step_limit) + ")");
      ok[r] = false;
    }
  }
  if (!plan.refused.empty()) return plan;
  for (std::size_t r = 0; r < n; ++r) {
    if (holder(r)) plan.step = std::max(plan.step, word(r, 0));
  }
  for (std::size_t r = 0; r < n; ++r) {
    if (holder(r) && word(r, 0) == plan.step) plan.sources.push_back(static_cast<int>(r));
  }
  return plan;
}

/// The members' reports for an error message: "id (formed g, step s[, healing]), ...".
[[nodiscard]] inline std::string describe_reports(std::span<const std::int64_t> all,
                                                  const std::vector<std::string>& members) {
  std::string out;
  for (std::size_t r = 0; r < members.size(); ++r) {
    const std::int64_t* w = all.data() + r * member_report::words;
    out += (r ? ", " : "") + members[r] + " (formed " + std::to_string(w[1]) + ", step " + std::to_string(w[0]) +
           (w[4] ? ", healing" : "") + ")";
  }
  return out;
}

/// Before any step committed, any member's state may start the job: of the members not part-way
/// through a heal (their state is their own), the first at the highest step (a job resumed from
/// checkpoints: `Manager::resume`), else rank 0's.
[[nodiscard]] inline heal_plan first_heal_plan(std::span<const std::int64_t> all) {
  const std::size_t n = all.size() / member_report::words;
  std::size_t first = n;
  for (std::size_t r = 0; r < n; ++r) {
    const std::int64_t* w = all.data() + r * member_report::words;
    if (w[4] == 0 && (first == n || w[0] > all[first * member_report::words])) first = r;
  }
  if (first == n) first = 0;
  heal_plan plan;
  plan.sources.push_back(static_cast<int>(first));
  plan.step = n == 0 ? 0 : all[first * member_report::words];
  return plan;
}

/// The plan when `plan_heal` found no holder of the committed state here: before any step
/// committed (`latest_formed` 0) any member's state may start the job (`first_heal_plan`); after,
/// waiting for a holder is the only safe course.
/// @throws communication_error naming every member's report, when a step committed
[[nodiscard]] inline heal_plan plan_without_holder(std::span<const std::int64_t> all,
                                                   const std::vector<std::string>& members, std::int64_t latest_formed,
                                                   int rank, std::uint64_t generation) {
  if (latest_formed > 0) {
    throw communication_error(
        rank, "Manager quorum " + std::to_string(generation),
        "no member holds the committed state (none of the members of generation " + std::to_string(latest_formed) +
            ", the latest that committed, is here: " + describe_reports(all, members) + "); waiting for one");
  }
  return first_heal_plan(all);
}

/// The error a member of quorum `generation` gets when `refused` (not empty) are left out: its
/// own refusal if it is one of them (`mine`: a `usage_error` for a layout or options, a `manager_error` for
/// the rest), kept for good, or a `communication_error` after which the others re-form without
/// them.
struct refusal {
  std::exception_ptr error;  ///< to throw
  bool mine = false;         ///< this member is left out
};
[[nodiscard]] inline refusal refusal_for(const std::vector<refused_member>& refused, int rank,
                                         std::uint64_t generation) {
  const std::string op = "Manager quorum " + std::to_string(generation);
  for (const auto& entry : refused) {
    if (entry.first != rank) continue;
    const std::string& why = entry.second;
    const bool usage = why.find("layout") != std::string::npos || why.find("manager_options") != std::string::npos;
    return {usage ? std::make_exception_ptr(usage_error(rank, op, why))
                  : std::make_exception_ptr(manager_error(rank, op, why)),
            true};
  }
  return {std::make_exception_ptr(
              communication_error(rank, op, "left out: " + refused.front().second + "; re-forming without it")),
          false};
}

/// The store's "step_limit": no quorum ever committed a step beyond it.
[[nodiscard]] inline std::int64_t read_step_limit(store_ref store) { return store.add("step_limit", 0); }

/// Before a step can commit, "step_limit" covers it: rank 0 raises it before the vote (every
/// commit needs rank 0's vote), 1024 steps at a time, so a reported step above it is impossible.
/// Monotone through add(): a stale rank 0 can only raise it, never lower it. Returns the limit.
[[nodiscard]] inline std::int64_t raise_step_limit(store_ref store, std::int64_t step) {
  std::int64_t v = read_step_limit(store);
  if (v <= step) v = store.add("step_limit", step + 1024 - v);
  return v;
}

}  // namespace ddp::detail
