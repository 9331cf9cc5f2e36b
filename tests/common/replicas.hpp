#pragma once
// What the fault-tolerance tests share (tests/manager, tests/data): replicas as threads of this
// process, each a Manager over the local backend and an in-memory store; their deterministic
// parameters and gradients; the faults injected into them; and the scenario that runs them.

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <ddp/manager.hpp>

namespace replica_test {

/// Where a replica "crashes" (its thread unwinds by throwing `crash`, its heartbeat stops), or
/// that it stalls.
enum class fault_point { none, before_collective, during_collective, after_collective, stall };

/// One replica's fault: where, from which step on.
struct fault {
  fault_point where = fault_point::none;
  std::int64_t at_step = -1;
};

/// Thrown in a replica's thread to make it "die".
struct crash {};

/// Replica `id`'s initial parameters: `dim` values in [-1, 1) seeded by the id.
inline std::vector<double> initial_params(const std::string& id, std::size_t dim) {
  std::mt19937_64 rng(std::hash<std::string>{}(id));
  std::uniform_real_distribution<double> u(-1, 1);
  std::vector<double> p(dim);
  for (auto& x : p) x = u(rng);
  return p;
}

/// Replica `id`'s batch at step `s`: the gradient of 0.5 |p - target|^2 at `p`.
inline std::vector<double> gradient(const std::string& id, std::int64_t s, const std::vector<double>& p) {
  std::vector<double> g(p.size());
  const auto h = std::hash<std::string>{}(id) % 97;
  for (std::size_t k = 0; k < p.size(); ++k) {
    g[k] = p[k] - std::sin(static_cast<double>(h) + 0.7 * static_cast<double>(s) + static_cast<double>(k));
  }
  return g;
}

/// The Manager options of a scenario: two replicas at least, fast heartbeats, and a heal chunk
/// so small that even a tiny state heals in several chunks (spread over the sources).
inline ddp::manager_options scenario_options() {
  using namespace std::chrono_literals;
  ddp::manager_options o;
  o.min_replicas = 2;
  o.quorum_timeout = 30s;
  o.heartbeat_interval = 10ms;
  o.heartbeat_timeout = 400ms;
  o.settle = 60ms;
  o.heal_chunk_bytes = 16;
  return o;
}

/// The fabric key of a Manager's communicator: one per generation, and one per heal route
/// (manager_options::heal_over == heal_transport::source_routes) in it.
inline std::string fabric_key(const ddp::quorum_info& q) {
  return "g" + std::to_string(q.generation) + (q.heal_source >= 0 ? "/heal" + std::to_string(q.heal_source) : "");
}

/// Runs `replicas` replicas "r0", "r1", ... (replica r with `faults[r]`, if any) and, 150 ms
/// later, the `joiners`, each on its own thread of `Cluster(collective_timeout)`:
/// `run_replica(id, fault, steps, want, result, stall)`, where `want` is the quorum size the
/// replicas train until (those that do not crash, plus the joiners). `configure`, if set, is
/// called on the cluster before any replica starts. Returns each one's result, the joiners' last.
template <class Cluster, class Result>
std::vector<Result> run_scenario(int replicas, std::int64_t steps, const std::map<int, fault>& faults,
                                 const std::vector<std::string>& joiners, std::chrono::milliseconds stall,
                                 std::chrono::milliseconds collective_timeout,
                                 const std::function<void(Cluster&)>& configure = {}) {
  using namespace std::chrono_literals;
  int crashing = 0;
  for (const auto& entry : faults) crashing += entry.second.where != fault_point::stall ? 1 : 0;
  const int want = replicas - crashing + static_cast<int>(joiners.size());
  Cluster c(collective_timeout);
  if (configure) configure(c);
  std::vector<Result> results(static_cast<std::size_t>(replicas) + joiners.size());
  std::vector<std::thread> threads;
  for (int r = 0; r < replicas; ++r) {
    const fault f = faults.count(r) ? faults.at(r) : fault{};
    threads.emplace_back([&, r, f] {
      c.run_replica("r" + std::to_string(r), f, steps, want, results[static_cast<std::size_t>(r)], stall);
    });
  }
  for (std::size_t k = 0; k < joiners.size(); ++k) {
    threads.emplace_back([&, k] {
      std::this_thread::sleep_for(150ms);
      c.run_replica(joiners[k], {}, steps, want, results[static_cast<std::size_t>(replicas) + k], 0ms);
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

/// Each replica's id, whether it crashed, its error and its Manager's events: for a report.
template <class Result>
std::string history(const std::vector<Result>& results) {
  std::string out;
  for (const auto& r : results) {
    out += r.id + (r.crashed ? " (crashed)" : "") + ": " + r.error + "\n";
    for (const auto& e : r.events) out += "    " + e + "\n";
  }
  return out;
}

}  // namespace replica_test
