#pragma once
/// @file manager/decision.hpp
/// @brief How the members of a quorum agree whether a step committed when the commit vote (an
/// allreduce) completed on some of them and failed on others: one record per step in the store,
/// "commit" from a member whose vote completed, "abort" from one whose vote failed, and the first
/// write wins (`set_if_absent`). Not for users; the protocol and why it is safe:
/// docs/fault-tolerance.md ("The commit decision").

#include <chrono>
#include <cstdint>
#include <string>

#include <ddp/error.hpp>
#include <ddp/store.hpp>
#include <ddp/stores/backoff.hpp>
#include <ddp/time_source.hpp>

namespace ddp::detail {

/// What one member learns from the step's decision record.
enum class commit_decision : unsigned char {
  commit,   ///< the step committed: apply it
  abort,    ///< it did not, on any member
  unknown,  ///< the store could not be reached: do not apply it, receive the state from a holder
};

/// Steps per block of decision records: rank 0 erases a generation's block b-2 once its steps
/// reach block b (every member decides within a step of the others), except the block of the
/// generation's first step, which tells later quorums whether it committed (latest_committing).
inline constexpr std::int64_t decision_block_steps = 1024;

/// The folder of generation `g`'s decision records of block `block`.
[[nodiscard]] inline std::string decision_block(std::uint64_t g, std::int64_t block) {
  return "g" + std::to_string(g) + "/decided/" + std::to_string(block) + "/";
}

/// Generation `g`'s decision record of `step`.
[[nodiscard]] inline std::string decision_record(std::uint64_t g, std::int64_t step) {
  return decision_block(g, step / decision_block_steps) + std::to_string(step);
}

/// Proposes `mine` ("commit" or "abort") as the decision on `step` of generation `g` and returns
/// the decision that stands: the first proposal written. @throws ddp::error if the store fails
[[nodiscard]] inline commit_decision propose_decision(store_ref store, std::uint64_t g, std::int64_t step,
                                                      bool commit) {
  const std::string v =
      to_text(store.set_if_absent(decision_record(g, step), as_bytes(std::string(commit ? "commit" : "abort"))));
  return v == "commit" ? commit_decision::commit : v == "abort" ? commit_decision::abort : commit_decision::unknown;
}

/// This member's decision on `step` of generation `g`, whose first step was `first_step`;
/// `vote_failed`: it voted yes but its vote did not complete. Idempotent, so a member retries it
/// after a store error. Rank 0 erases records two blocks old.
/// @throws ddp::error if the store fails
[[nodiscard]] inline commit_decision decide_step(store_ref store, std::uint64_t g, std::int64_t step,
                                                 std::int64_t first_step, bool vote_failed, int rank) {
  const commit_decision d = propose_decision(store, g, step, !vote_failed);
  const std::int64_t block = step / decision_block_steps;
  if (rank == 0 && d == commit_decision::commit && step % decision_block_steps == 0 &&
      block - 2 > first_step / decision_block_steps) {
    (void)store.erase_prefix(decision_block(g, block - 2));
  }
  return d;
}

/// The step a member decides and how its vote went (`decide_step`'s question).
struct step_vote {
  std::uint64_t generation = 0;
  std::int64_t step = 0;
  std::int64_t first_step = 0;  ///< the generation's first step
  bool vote_failed = false;     ///< voted yes, but the vote did not complete here
  int rank = 0;
};

/// `decide_step`, asked again after each store error until `deadline` on `time`'s clock: without
/// the store no quorum forms anyway, and giving up makes the member one that needs healing (the
/// last holder of the state would stop the job). It gives up (`unknown`) only after an attempt
/// that began past the deadline failed: a member that hung (SIGSTOP) inside an attempt wakes past
/// it and must ask once more (the simulation's hang fault, seed 10875).
[[nodiscard]] inline commit_decision decide_step_until(store_ref store, const step_vote& v,
                                                       std::chrono::steady_clock::time_point deadline,
                                                       time_source* time) {
  stores::detail::backoff pause(std::chrono::milliseconds(50));
  for (;;) {
    const bool last = now_of(time) >= deadline;
    try {
      return decide_step(store, v.generation, v.step, v.first_step, v.vote_failed, v.rank);
    } catch (const ddp::error&) {
      if (last) return commit_decision::unknown;
      pause.sleep_until_next(deadline, time);
    }
  }
}

}  // namespace ddp::detail
