#pragma once
// The supervisor's faults, the same for every simulated job (manager_sim_test.cpp,
// group_sim_test.cpp): until `chaos_end`, every 20-400 ms of virtual time it picks a process tag t
// and one of eight moves: kill t (0, 1: the job's own rule, which spares the last holder), restart
// what ended (2), cut t off from the store for 100-1500 ms (3), cut t and another tag apart or
// heal every cut (4), a slow and failing store on or off (5), hang t (6), nothing (7). Then every
// fault stops, but a hung process resumes only at its hang's end. The order of the scheduler's
// draws is the seeds' (a change replays every seed differently). The hang took move 6, which was
// nothing: a job without hangs (`chaos_moves::hang` empty) draws what it drew before them.
//
// A hang (#43: a hung peer costs one step, never the job) is SIGSTOP, then SIGCONT 2-20 s later:
// longer than the heartbeat timeout, the collective timeout and the quorum timeout, so the others
// re-form without it, and it wakes up in a world that moved on, with its communicators and its
// pending collectives and store operations as it left them, and must rejoin and heal. Any process
// may hang, the last holder of the state too: it comes back with it (a job may shorten hangs:
// `chaos_moves::longest_hang`).
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <string>

#include "oracle.hpp"
#include "scheduler.hpp"
#include "sim_comm.hpp"
#include "sim_store.hpp"

namespace sim {

/// What a job does for the moves that are its own.
struct chaos_moves {
  std::function<void(int)> kill;  ///< kill (a process of) tag t, if the job's rule allows
  std::function<void()> restart;  ///< restart whatever ended
  /// Hang (a process of) tag t until then, if it runs and is not hung already (`hang_process`).
  /// Empty: move 6 is nothing, as before hangs (the regression seeds' schedules).
  std::function<void(int, clock::time_point)> hang;
  std::function<std::string(int)> name;  ///< tag t in the trace
  /// A hang lasts 2 s to this. A job whose processes count a peer as dead after some time of their
  /// own (a group's ranks, after their inner communicator's timeout) keeps it well below that:
  /// such a hang would be a kill, which the job's rule may forbid.
  std::chrono::milliseconds longest_hang{20000};
};

/// The shortest hang: longer than the simulated jobs' heartbeat and collective timeouts.
inline constexpr std::chrono::milliseconds shortest_hang{2000};

/// Hangs process `pid` (of tag `who`) until `until`, if it runs and is not hung already.
inline void hang_process(scheduler& s, oracle& o, int pid, const std::string& who, clock::time_point until) {
  if (s.frozen(pid) || !s.freeze(pid, until)) return;
  const auto ms = [](auto d) {
    return std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(d).count());
  };
  o.log("supervisor",
        "hangs " + who + " for " + ms(until - s.now()) + " ms (until " + ms(until - s.now() + s.elapsed()) + " ms)");
}

/// Runs a job's processes until every one ended (true), or until `bound` of virtual time after its
/// faults stopped (false; `s.why()` says why): at `chaos_end`, or when its last hang ended, if later.
inline bool run_job(scheduler& s, clock::time_point chaos_end, std::chrono::milliseconds bound) {
  for (clock::time_point limit = chaos_end + bound;;) {
    if (s.run(limit)) return true;
    const clock::time_point later = std::max(chaos_end, s.last_thaw()) + bound;
    if (later <= limit) return false;
    limit = later;  // a hang outlasted the chaos: the bound counts from its end
  }
}

inline void run_chaos(scheduler& s, ddp::clock::time_point chaos_end, int tags, store_faults& store, comm_faults& net,
                      oracle& o, const chaos_moves& moves) {
  std::map<int, ddp::clock::time_point> store_cut_until;
  while (s.now() < chaos_end) {
    s.sleep_until(s.now() + std::chrono::milliseconds(s.uniform(20, 400)));
    for (auto& [cut, until] : store_cut_until) {
      if (store.cut_off[static_cast<std::size_t>(cut)] && s.now() >= until) {
        store.cut_off[static_cast<std::size_t>(cut)] = false;
        o.log("supervisor", "reconnects " + moves.name(cut) + " to the store");
      }
    }
    const int t = static_cast<int>(s.uniform(0, tags - 1));
    switch (s.uniform(0, 7)) {
      case 0:
      case 1: moves.kill(t); break;
      case 2: moves.restart(); break;
      case 3:  // cut off from the store for a while (shorter than the quorum timeout)
        if (!store.cut_off[static_cast<std::size_t>(t)]) {
          store.cut_off[static_cast<std::size_t>(t)] = true;
          store_cut_until[t] = s.now() + std::chrono::milliseconds(s.uniform(100, 1500));
          o.log("supervisor", "cuts " + moves.name(t) + " from the store");
        }
        break;
      case 4: {  // cut two apart, or heal every cut
        const int q = static_cast<int>(s.uniform(0, tags - 1));
        if (q != t && net.cut.empty()) {
          net.cut.insert({t, q});
          net.cut.insert({q, t});
          o.log("supervisor", "cuts " + moves.name(t) + " from " + moves.name(q));
        } else {
          net.cut.clear();
          o.log("supervisor", "heals the network");
        }
        break;
      }
      case 5:  // the store slows down or fails now and then
        store.slow_rate = store.slow_rate > 0 ? 0 : 0.05;
        store.error_rate = store.error_rate > 0 ? 0 : 0.002;
        break;
      case 6:  // hang, if the job has hangs
        if (moves.hang) {
          const std::chrono::milliseconds length(s.uniform(shortest_hang.count(), moves.longest_hang.count()));
          moves.hang(t, s.now() + length);
        }
        break;
      default: break;
    }
  }
  o.log("supervisor", "faults stop");
  net.cut.clear();
  store.cut_off.assign(store.cut_off.size(), false);
  store.slow_rate = 0;
  store.error_rate = 0;
}

}  // namespace sim
