// Replica groups (GroupManager) under deterministic simulation (docs/testing.md, "Deterministic
// simulation"; docs/replica-groups.md): groups of two ranks, each rank a process, over the
// simulated store and network, DDP inside each group over group_communicator(inner, GroupManager).
// One seeded scheduler kills single ranks (the group-mate must stop too, and the supervisor then
// restarts the whole group), hangs single ranks (the group-mate waits for it on the inner
// communicator, the other groups re-form without the group), delays and fails store operations,
// delays deliveries, and cuts groups off from the store and from each other. The invariants of
// oracle.hpp are checked over every rank of every group: every rank committing step s holds the
// same state, started from the state of step s-1; one membership per generation; and, once the
// faults stop, every rank of every group reaches the target step.
// Environment: DDP_SIM_GROUP_SEEDS (how many, default `default_seeds`), DDP_SIM_FIRST,
// DDP_SIM_JOBS, DDP_SIM_SEED (just this one, with its trace), DDP_SIM_ROUTES=1 (heal over routes),
// DDP_SIM_HANGS=0 (no hangs: the schedules from before them).
#include <time.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/any_communicator.hpp>
#include <ddp/groups.hpp>
#include <ddp/stores/memory_store.hpp>
#include <ddp/training_state.hpp>

#include "chaos.hpp"
#include "oracle.hpp"
#include "scheduler.hpp"
#include "seed_runner.hpp"
#include "sim_comm.hpp"
#include "sim_store.hpp"

using namespace std::chrono_literals;

// As in manager_sim_test.cpp: every simulated process is a fiber; yielding the thread is a no-op.
// So is sleeping: a wait on a group_communicator collective polls (work_state's default wait,
// which sleeps 50 us between polls after a while), and every poll of the simulated network moves
// virtual time already. The real sleeps were 70% of this program's time.
extern "C" int sched_yield() noexcept { return 0; }
extern "C" int nanosleep(const struct timespec*, struct timespec*) noexcept { return 0; }
extern "C" int clock_nanosleep(clockid_t, int, const struct timespec*, struct timespec*) noexcept { return 0; }

namespace {

using sim::hash_of;

constexpr std::size_t dim = 4;
constexpr int k = 2;  // ranks per group
// About 12 s on the 2-core machine.
constexpr std::uint64_t default_seeds = 5000;

struct scenario {
  int groups = 3;
  std::int64_t target = 10;
  std::chrono::milliseconds chaos{3000};
  std::chrono::milliseconds bound{25000};
  ddp::heal_transport heal_over = ddp::heal_transport::quorum_broadcast;
  bool hangs = true;  // the supervisor hangs ranks (chaos.hpp)
};

class group_job {
 public:
  group_job(std::uint64_t seed, scenario sc) : sched_(seed), sc_(sc), fab_(sched_, net_), inner_fab_(sched_, inner_) {
    // The followers wait on the inner communicator while their leader forms a quorum and heals.
    inner_.timeout = 20s;
    oracle_.s = &sched_;
    store_faults_.watch = [this](int tag, const std::string& what) { oracle_.log(id_of(tag), what); };
  }
  group_job(const group_job&) = delete;
  group_job& operator=(const group_job&) = delete;
  ~group_job() { sched_.shutdown(); }

  std::vector<std::string> run() {
    for (int g = 0; g < sc_.groups; ++g) start(g);
    sched_.spawn("supervisor", [this] { supervise(); });
    const bool finished = sim::run_job(sched_, clock_start() + sc_.chaos, sc_.bound);
    if (!finished)
      oracle_.violated("liveness (invariant 4): " + sched_.why() + " before every rank reached step " +
                       std::to_string(sc_.target));
    return oracle_.violations;
  }
  [[nodiscard]] const std::vector<std::string>& trace() const { return oracle_.trace; }
  [[nodiscard]] std::uint64_t steps() const { return sched_.steps(); }

 private:
  using clock = ddp::clock;
  clock::time_point clock_start() { return sched_.now() - sched_.elapsed(); }
  static std::string id_of(int g) { return "g" + std::to_string(g); }
  static std::string rank_id(int g, int i) { return id_of(g) + "." + std::to_string(i); }

  void start(int g) {
    const int incarnation = ++incarnations_[g];
    formed_[g] = 0;
    for (int i = 0; i < k; ++i) {
      oracle_.reached[rank_id(g, i)] = 0;
      pids_[g][static_cast<std::size_t>(i)] = sched_.spawn(rank_id(g, i) + "#" + std::to_string(incarnation),
                                                           [this, g, i, incarnation] { rank(g, i, incarnation); });
    }
  }
  [[nodiscard]] bool all_alive(int g) const {
    return std::all_of(pids_.at(g).begin(), pids_.at(g).end(), [this](int pid) { return sched_.alive(pid); });
  }
  [[nodiscard]] bool all_ended(int g) const {
    return std::none_of(pids_.at(g).begin(), pids_.at(g).end(), [this](int pid) { return sched_.alive(pid); });
  }

  // Rank i of group g (one incarnation): the production GroupManager over the simulated store and
  // network.
  void rank(int g, int i, int incarnation) {
    const std::string id = id_of(g), me = rank_id(g, i);
    sim::sim_store st(sched_, shared_, store_faults_, g);
    auto inner = inner_fab_.connect("inner/" + id + "#" + std::to_string(incarnation), i, k, g * k + i);
    // A rank that ends or dies fails its group's next inner collective (its process is gone).
    struct gone_on_exit {
      sim::fabric::endpoint& e;
      ~gone_on_exit() { e.abort(); }
    } gone{inner};
    std::vector<double> p(dim), grad(dim);
    for (std::size_t j = 0; j < dim; ++j) p[j] = static_cast<double>(g + 1) * 0.25 + static_cast<double>(j);
    ddp::training_state state;
    state.add(p);
    ddp::manager_options o;
    o.replica_id = id;
    o.min_replicas = 2;
    o.quorum_timeout = 5s;
    o.heartbeat_interval = 20ms;
    o.heartbeat_timeout = 400ms;
    o.settle = 60ms;
    o.heal_chunk_bytes = 16;
    o.progress = {};
    o.time = &sched_;
    o.heal_over = sc_.heal_over;
    ddp::GroupManager<sim::fabric::endpoint> gm(
        inner, st,
        [&](const ddp::quorum_info& q) {
          const std::string route = q.heal_source >= 0 ? "/heal" + std::to_string(q.heal_source) : "";
          return ddp::any_communicator(fab_.connect(
              "g" + std::to_string(q.generation) + route + "/index" + std::to_string(i), q.rank, q.size, g));
        },
        state, ddp::group_state::replicated, o);
    gm.on_event([&](const ddp::manager_event& e) {  // the leader's
      if (e.what == ddp::manager_event::kind::quorum) {
        oracle_.on_quorum(id, gm.generation(), gm.members());
        formed_[g] = gm.generation();
        latest_formed_ = std::max(latest_formed_, gm.generation());
      }
      if (e.what == ddp::manager_event::kind::healed) oracle_.on_heal(me, gm.step(), hash_of(p));
      if (e.what == ddp::manager_event::kind::discarded || e.what == ddp::manager_event::kind::error) {
        oracle_.log(me, e.text);
      }
    });
    ddp::group_communicator<ddp::communicator_ref, ddp::communicator_ref> comm(inner, gm);
    oracle_.log(me, "started");
    try {
      while (!stop_) {
        try {
          gm.start_quorum();
        } catch (const ddp::manager_error& e) {
          // Every rank of the group gets it (the leader's no-quorum-in-time). As a flat trainer: it
          // ends unless its group alone holds the latest committed step.
          if (another_holder_alive(g)) throw;
          oracle_.log(me, std::string("tries again: ") + e.what());
          continue;
        }
        const std::int64_t s = gm.step();
        for (std::size_t j = 0; j < dim; ++j) grad[j] = p[j] - static_cast<double>((g * 7 + i + s) % 5);
        sched_.sleep_until(sched_.now() + std::chrono::milliseconds(sched_.uniform(1, 8)));  // compute
        ddp::communicator_ref(comm).allreduce(grad, ddp::reduce_op::sum).wait();
        if (gm.should_commit()) {
          const std::uint64_t before = hash_of(p);
          for (std::size_t j = 0; j < dim; ++j) p[j] -= 0.1 * grad[j] / static_cast<double>(comm.size());
          oracle_.on_commit(me, s, before, hash_of(p), gm.members());
        }
      }
    } catch (const sim::killed&) {
      oracle_.log(me, "killed");
      throw;
    } catch (const std::exception& e) {
      oracle_.log(me, std::string("ended: ") + e.what());
    }
  }

  void supervise() {
    sim::run_chaos(sched_, clock_start() + sc_.chaos, sc_.groups, store_faults_, net_, oracle_,
                   {.kill =
                        [this](int g) {  // one rank of the group, unless its group holds the last copy
                          const int i = static_cast<int>(sched_.uniform(0, k - 1));
                          const int pid = pids_[g][static_cast<std::size_t>(i)];
                          if (sched_.alive(pid) && another_holder_alive(g)) {
                            oracle_.log("supervisor", "kills " + rank_id(g, i));
                            sched_.kill(pid);
                          }
                        },
                    .restart = [this] { restart_ended(); },
                    .hang = hang_move(),
                    .name = [](int g) { return id_of(g); },
                    .longest_hang = longest_hang()});
    for (;;) {
      restart_ended();
      if (every_rank_reached_target()) break;
      sched_.sleep_until(sched_.now() + 100ms);
    }
    stop_ = true;
    for (auto& [g, pids] : pids_) {
      for (const int pid : pids) sched_.kill(pid);
    }
  }

  // The supervisor's hang: one rank of the group, any group (a hung rank comes back with its state,
  // and counts as alive, as a group that holds the state).
  std::function<void(int, clock::time_point)> hang_move() {
    if (!sc_.hangs) return {};
    return [this](int g, clock::time_point until) {
      const int i = static_cast<int>(sched_.uniform(0, k - 1));
      sim::hang_process(sched_, oracle_, pids_[g][static_cast<std::size_t>(i)], rank_id(g, i), until);
    };
  }

  // Half the inner communicator's timeout: a rank hung longer than that may be dead to its
  // group-mate (whose inner collective fails at the timeout: the group ends and restarts without
  // its state), and hanging a rank of the last group that holds the state would then be the kill
  // the supervisor never makes (with hangs of up to 20 s, seeds 154, 297, 412, 468, 1109, 2309,
  // 2520 and 2621 of 1-5000 hung such a rank for 17-20 s: nothing could ever commit again). Longer
  // hangs are kills of a rank, which the supervisor makes anyway.
  [[nodiscard]] std::chrono::milliseconds longest_hang() const {
    return std::chrono::duration_cast<std::chrono::milliseconds>(inner_.timeout / 2);
  }

  // Some group other than `victim` holds the committed state: every rank alive at the latest
  // committed step, and a member of the latest generation that formed (its members are the ones
  // the Manager heals others from: once a generation formed, a quorum without one of them waits).
  bool another_holder_alive(int victim) {
    if (latest_formed_ == 0) return true;  // nothing formed: every state may start the job
    const std::int64_t latest = oracle_.commits.empty() ? 0 : oracle_.commits.rbegin()->first + 1;
    for (int g = 0; g < sc_.groups; ++g) {
      if (g == victim || !all_alive(g) || formed_[g] != latest_formed_) continue;
      bool holds = true;
      for (int i = 0; i < k; ++i) holds = holds && oracle_.reached[rank_id(g, i)] == latest;
      if (holds) return true;
    }
    return false;
  }

  bool every_rank_reached_target() {
    for (int g = 0; g < sc_.groups; ++g) {
      for (int i = 0; i < k; ++i) {
        if (oracle_.reached[rank_id(g, i)] < sc_.target) return false;
      }
    }
    return true;
  }

  // A group whose ranks have all ended starts again as a whole (a half-dead group waits for its
  // other rank to notice).
  void restart_ended() {
    for (int g = 0; g < sc_.groups; ++g) {
      if (!all_ended(g)) continue;
      oracle_.log("supervisor", "restarts " + id_of(g));
      start(g);
    }
  }

  sim::scheduler sched_;
  scenario sc_;
  ddp::stores::memory_store shared_;
  sim::store_faults store_faults_;
  sim::comm_faults net_, inner_;
  sim::fabric fab_, inner_fab_;
  sim::oracle oracle_;
  std::map<int, std::array<int, k>> pids_;
  std::map<int, int> incarnations_;
  std::map<int, std::uint64_t> formed_;  // the latest generation each group's incarnation formed
  std::uint64_t latest_formed_ = 0;
  bool stop_ = false;
};

ddp::heal_transport transport_of(std::uint64_t routes) {
  return routes != 0 ? ddp::heal_transport::source_routes : ddp::heal_transport::quorum_broadcast;
}

bool run_seed(std::uint64_t seed, bool verbose, ddp::heal_transport heal_over, bool hangs = sim::hangs_wanted()) {
  group_job j(seed, scenario{.groups = 3 + static_cast<int>(seed % 2), .heal_over = heal_over, .hangs = hangs});
  const auto violations = j.run();
  if (violations.empty() && !verbose) return true;
  std::ostringstream out;
  out << "seed " << seed << ": " << violations.size() << " violation(s), " << j.steps() << " scheduling steps\n";
  for (const auto& v : violations) out << "  " << v << "\n";
  const auto& t = j.trace();
  const std::size_t from = verbose || t.size() < 150 ? 0 : t.size() - 150;
  for (std::size_t i = from; i < t.size(); ++i) out << "    " << t[i] << "\n";
  out << "replay: DDP_SIM_SEED=" << seed << " "
      << (heal_over == ddp::heal_transport::source_routes ? "DDP_SIM_ROUTES=1 " : "")
      << (hangs ? "" : "DDP_SIM_HANGS=0 ") << "group_sim\n";
  std::fputs(out.str().c_str(), stderr);
  return violations.empty();
}

}  // namespace

TEST_CASE("GroupManager under deterministic simulation: the invariants hold for every seed", "[sim][groups]") {
  if (const char* one = std::getenv("DDP_SIM_SEED")) {
    CHECK(run_seed(std::strtoull(one, nullptr, 10), true, transport_of(sim::env_or("DDP_SIM_ROUTES", 0))));
    return;
  }
  const std::uint64_t first = sim::env_or("DDP_SIM_FIRST", 1),
                      count = sim::env_or("DDP_SIM_GROUP_SEEDS", default_seeds);
  std::vector<std::uint64_t> seeds;
  for (std::uint64_t seed = first; seed < first + count; ++seed) seeds.push_back(seed);
  // Half the seeds heal over the quorum's communicators, half over routes.
  const auto failed = sim::run_seeds("group_sim", seeds, "seeds", [](std::uint64_t seed) {
    return run_seed(seed, false, transport_of((seed / 2) % 2));
  });
  INFO("failed seeds: " << failed.size() << " (" << sim::joined(failed) << "); replay with DDP_SIM_SEED=<seed> and "
                        << "DDP_SIM_ROUTES=(seed / 2) % 2");
  CHECK(failed.empty());
}
