#pragma once
/// @file manager/decision.hpp
/// @brief How the members of a quorum agree whether a step committed when the commit vote (an
/// allreduce) completed on some of them and failed on others: one counter per generation in the
/// store, to which every member whose vote completed adds 1 before applying the step, and every
/// member whose vote failed adds a fence. Whoever came first decides. Not for users; the
/// protocol and why it is safe: docs/fault-tolerance.md ("The commit decision").

#include <cstdint>
#include <string>

#include <ddp/store.hpp>

namespace ddp::detail {

/// What one member learns from its operation on the generation's decision counter.
enum class commit_decision : unsigned char {
  commit,   ///< the step committed: apply it
  abort,    ///< it did not, on any member
  unknown,  ///< it may have: do not apply it, and receive the state from a member that holds it
};

/// A fence's weight in the counter: commits count below it, fences above it.
inline constexpr std::int64_t decision_fence = std::int64_t{1} << 40;

/// Generation `g`'s decision counter.
[[nodiscard]] inline std::string decision_key(std::uint64_t g) { return "g" + std::to_string(g) + "/decided"; }

/// The decision a counter value implies. `v`: what this member's add returned; `fenced`: it added
/// a fence (its vote failed), else 1 (its vote completed with every member's yes); `expected`:
/// the commits of the generation's earlier steps (every member committed each of them, or the
/// generation would have ended); `members`: the generation's size. The step commits iff a commit
/// was added before the first fence. A count no member of this step could have left (the counter
/// was erased: this member is generations behind) tells nothing.
[[nodiscard]] constexpr commit_decision decide_commit(std::int64_t v, bool fenced, std::int64_t expected,
                                                      std::int64_t members) noexcept {
  const std::int64_t fences = v / decision_fence;
  const std::int64_t commits = v % decision_fence - expected;  // commits of this step, this one's included
  if (v < 0 || commits < 0 || commits > members || fences > members) return commit_decision::unknown;
  if (fenced) {
    if (commits == 0) return commit_decision::abort;  // no commit before this fence, so none before the first
    if (fences == 1) return commit_decision::commit;  // this is the first fence, and a commit came before it
    return commit_decision::unknown;                  // a commit before this fence, maybe after the first
  }
  if (commits == 0) return commit_decision::unknown;  // its own commit is missing: not this generation's count
  if (fences == 0) return commit_decision::commit;    // no fence before this commit
  if (commits == 1) return commit_decision::abort;    // the first commit, after a fence
  return commit_decision::unknown;                    // an earlier commit, before or after the first fence
}

/// Adds this member's commit (`fenced` false) or fence to generation `g`'s counter and returns
/// the decision it implies (see decide_commit). @throws ddp::error if the store fails
[[nodiscard]] inline commit_decision register_decision(store_ref store, std::uint64_t g, bool fenced,
                                                       std::int64_t expected, std::int64_t members) {
  return decide_commit(store.add(decision_key(g), fenced ? decision_fence : 1), fenced, expected, members);
}

}  // namespace ddp::detail
