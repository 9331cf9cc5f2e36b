#pragma once
// The supervisor's faults, the same for every simulated job (manager_sim_test.cpp,
// group_sim_test.cpp): until `chaos_end`, every 20-400 ms of virtual time it picks a process tag t
// and one of eight moves: kill t (0, 1: the job's own rule, which spares the last holder), restart
// what ended (2), cut t off from the store for 100-1500 ms (3), cut t and another tag apart or
// heal every cut (4), a slow and failing store on or off (5), nothing (6, 7). Then every fault
// stops. The order of the scheduler's draws is the seeds' (a change replays every seed differently).
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
  std::function<void(int)> kill;         ///< kill (a process of) tag t, if the job's rule allows
  std::function<void()> restart;         ///< restart whatever ended
  std::function<std::string(int)> name;  ///< tag t in the trace
};

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
