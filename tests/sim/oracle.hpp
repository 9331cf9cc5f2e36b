#pragma once
// The invariants every simulated fault-tolerance job is checked against (manager_sim_test.cpp,
// group_sim_test.cpp), as the replicas report commits, quorums and heals:
//   1. every replica that commits step s holds the same state as every other one committing s,
//      and started it from the state step s-1 committed (no half-finished or stale step);
//   2. one membership per quorum generation;
//   3. no step is committed twice with different results.
// Liveness (4) is the job's: every replica reaches the target step once the faults stop.
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/detail/fnv1a.hpp>

#include "scheduler.hpp"

namespace sim {

inline std::uint64_t hash_of(const std::vector<double>& p) {
  return ddp::detail::fnv1a(std::as_bytes(std::span<const double>(p)));
}

// What every replica reports; checks the invariants as the reports arrive.
struct oracle {
  struct commit {
    std::uint64_t before = 0, after = 0;
    std::vector<std::string> members;
    std::string first_by;
  };
  std::map<std::int64_t, commit> commits;
  std::map<std::uint64_t, std::vector<std::string>> generations;
  std::map<std::string, std::int64_t> reached;  // replica -> steps it committed (its latest incarnation)
  std::vector<std::string> violations, trace;
  sim::scheduler* s = nullptr;

  void log(const std::string& who, const std::string& what) {
    trace.push_back(std::to_string(s->elapsed().count()) + " ms " + who + ": " + without_real_time(what));
  }
  // A timeout's message says how long the wait lasted on the machine's clock (work::wait): the
  // one thing in a trace that is not the seed's, so a replay would differ there. Left out.
  static std::string without_real_time(std::string text) {
    static constexpr std::string_view mark = "ms timeout: waited ";
    for (std::size_t at = text.find(mark); at != std::string::npos; at = text.find(mark, at)) {
      at += mark.size();
      std::size_t end = at;
      while (end < text.size() && text[end] >= '0' && text[end] <= '9') ++end;
      text.replace(at, end - at, "(real time)");
    }
    return text;
  }
  void violated(const std::string& what) {
    violations.push_back(what);
    log("ORACLE", "VIOLATION " + what);
  }
  void on_commit(const std::string& id, std::int64_t step, std::uint64_t before, std::uint64_t after,
                 const std::vector<std::string>& members) {
    log(id, "committed step " + std::to_string(step));
    reached[id] = step + 1;
    auto [it, fresh] = commits.emplace(step, commit{before, after, members, id});
    if (!fresh) {
      const commit& c = it->second;
      if (c.after != after || c.before != before) {
        violated("step " + std::to_string(step) + " committed by " + c.first_by + " and by " + id +
                 " with different states (invariants 1, 3)");
      }
      if (c.members != members) {
        violated("step " + std::to_string(step) + " committed by two different quorums (" + c.first_by + ", " + id +
                 ")");
      }
    }
    if (step > 0) {
      const auto prev = commits.find(step - 1);
      if (prev != commits.end() && prev->second.after != before) {
        violated(id + " committed step " + std::to_string(step) + " from a state that step " +
                 std::to_string(step - 1) + " did not commit (invariant 1)");
      }
    }
  }
  void on_quorum(const std::string& id, std::uint64_t gen, const std::vector<std::string>& members) {
    std::string list;
    for (const auto& m : members) list += " " + m;
    log(id, "quorum " + std::to_string(gen) + ":" + list);
    auto [it, fresh] = generations.emplace(gen, members);
    if (!fresh && it->second != members)
      violated("generation " + std::to_string(gen) + " has two memberships (invariant 2)");
  }
  void on_heal(const std::string& id, std::int64_t step, std::uint64_t state) {
    log(id, "healed to step " + std::to_string(step));
    reached[id] = step;
    const auto prev = commits.find(step - 1);
    if (step > 0 && prev != commits.end() && prev->second.after != state) {
      violated(id + " healed to step " + std::to_string(step) + " with a state step " + std::to_string(step - 1) +
               " did not commit (invariant 1)");
    }
  }
};

}  // namespace sim
