#pragma once
// Running a simulation's seeds (manager_sim_test.cpp, group_sim_test.cpp): on DDP_SIM_JOBS
// threads, each seed a job of its own; the environment knobs; the failed seeds as text.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace sim {

inline std::uint64_t env_or(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  return v ? std::strtoull(v, nullptr, 10) : fallback;
}

/// Whether the supervisor hangs processes (chaos.hpp): DDP_SIM_HANGS=0 turns hangs off, and every
/// seed replays the schedule it had before them.
inline bool hangs_wanted() { return env_or("DDP_SIM_HANGS", 1) != 0; }

// Runs `seeds` on DDP_SIM_JOBS threads (default: one per core), each thread taking the next seed
// not taken yet. A seed is a job of its own (its scheduler, store, network and fibers live on the
// thread that runs it, and share nothing), so which thread runs it changes nothing in it: its
// replay alone (DDP_SIM_SEED) is the same run. `run_seed(seed)`: true if it passed. Returns the
// seeds that failed, in order.
inline std::vector<std::uint64_t> run_seeds(const char* program, const std::vector<std::uint64_t>& seeds,
                                            const char* what, const std::function<bool(std::uint64_t)>& run_seed) {
  const auto cores = static_cast<std::uint64_t>(std::max(1u, std::thread::hardware_concurrency()));
  const auto jobs = static_cast<std::size_t>(std::clamp<std::uint64_t>(env_or("DDP_SIM_JOBS", cores), 1, 64));
  std::atomic<std::size_t> next{0};
  std::vector<char> ok(seeds.size(), 1);
  const auto work = [&] {
    for (std::size_t i = next++; i < seeds.size(); i = next++) {
      try {
        ok[i] = run_seed(seeds[i]) ? 1 : 0;
      } catch (const std::exception& e) {  // the simulation itself failed (no stack, ...)
        std::fprintf(stderr, "seed %llu: the simulation failed: %s\n", static_cast<unsigned long long>(seeds[i]),
                     e.what());
        ok[i] = 0;
      }
    }
  };
  const auto began = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (std::size_t k = 1; k < std::min(jobs, seeds.size()); ++k) threads.emplace_back(work);
  work();
  for (auto& t : threads) t.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  std::printf("%s: %zu %s in %.1f s on %zu thread(s): %.0f seeds/s\n", program, seeds.size(), what, seconds,
              std::min(jobs, seeds.size()), static_cast<double>(seeds.size()) / std::max(seconds, 1e-9));
  std::vector<std::uint64_t> failed;
  for (std::size_t i = 0; i < seeds.size(); ++i) {
    if (!ok[i]) failed.push_back(seeds[i]);
  }
  return failed;
}

/// The seeds as "1 2 3".
inline std::string joined(const std::vector<std::uint64_t>& seeds) {
  std::string out;
  for (const std::uint64_t s : seeds) out += (out.empty() ? "" : " ") + std::to_string(s);
  return out;
}

}  // namespace sim
