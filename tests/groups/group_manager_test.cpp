// The fault-tolerance protocol over replica groups (GroupManager), every rank a thread: groups of
// ranks train DDP-style over group_communicator(inner, GroupManager); a rank of a group is
// killed, its whole group leaves, the others go on committing; the group restarts, heals by
// shard and ends with the survivors' bits. And the same training over groups and over one
// replica per rank gives the same bits (ddp's reproducible reducer).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/bucketer.hpp>
#include <ddp/bucketing/fixed.hpp>
#include <ddp/data.hpp>
#include <ddp/groups.hpp>
#include <ddp/local.hpp>
#include <ddp/local_steps.hpp>
#include <ddp/reproducible.hpp>
#include <ddp/stores/memory_store.hpp>

#include "../common/replicas.hpp"

using namespace std::chrono_literals;

namespace {

constexpr std::size_t dim = 10;
constexpr double lr = 0.1, beta = 0.9;
const ddp::data::sampler_options sampling{.dataset_size = 500, .global_batch = 24, .micro_batch = 2, .seed = 7};

// How a group trains: DDP inside the group (every rank holds the whole model; a Bucketer or ddp's
// reproducible reducer over group_communicator), or HSDP-like (rank i holds part i of the model;
// a Bucketer over the GroupManager alone averages it across the groups).
// Or DiLoCo: DDP inside the group for the inner steps, fault_tolerant_diloco over the GroupManager
// for the outer ones.
enum class averaging { bucketer, reproducible, sharded, diloco };

struct rank_result {
  std::string group;
  int index = 0;
  int incarnation = 0;
  bool crashed = false;  // the rank that was killed
  std::string left;      // why a rank of a failed group stopped (empty: it did not)
  std::string error;     // anything else: a failure of the test
  std::vector<double> params, momentum;
  std::int64_t step = 0;
  std::vector<std::pair<std::int64_t, std::vector<std::string>>> commits;  // step, member groups
  std::map<std::int64_t, std::vector<std::uint64_t>> samples;              // step: the sample ids this rank used
  ddp::manager_stats stats;
};

struct job {
  ddp::stores::memory_store store;
  ddp::local::fabric fabric{ddp::local::options{.timeout = 3000ms, .faults = {}}};
  // A follower waits for its leader over the inner communicator (3 s above) for up to a quorum
  // or a step and its vote: the GroupManager refuses longer ones.
  ddp::manager_options base = [] {
    auto o = replica_test::scenario_options();
    o.quorum_timeout = 3000ms;
    o.step_timeout = 2000ms;
    return o;
  }();
  int k = 2;
  averaging avg = averaging::bucketer;
  std::atomic<int> commits_without_a_group{0};  // steps applied by a rank while a group was out

  // Rank `index`'s communicators across the groups: one per quorum and heal route, per index.
  ddp::communicator_factory cross_factory(int index) {
    return [this, index](const ddp::quorum_info& q) {
      return ddp::any_communicator(
          fabric.connect(replica_test::fabric_key(q) + "/index" + std::to_string(index), q.rank, q.size));
    };
  }

  // One rank of group `gid` (incarnation `inc`): trains until `steps` commits are done and the
  // quorum has `want_groups` groups; throws replica_test::crash at `crash_at` (if >= 0).
  void run_rank(const std::string& gid, int inc, int index, std::int64_t crash_at, std::int64_t steps, int want_groups,
                rank_result& out) {
    if (avg == averaging::diloco) return run_diloco_rank(gid, inc, index, crash_at, steps, want_groups, out);
    out.group = gid;
    out.index = index;
    out.incarnation = inc;
    auto inner = fabric.connect("inner/" + gid + "/" + std::to_string(inc), index, k);
    // Replicated inside the group: every rank of an incarnation starts from the same values.
    // (The reproducible runs compare two jobs: one model for all.)
    std::string seed = avg == averaging::reproducible ? "model" : gid + "#" + std::to_string(inc);
    if (avg == averaging::sharded) seed += "/part" + std::to_string(index);
    std::vector<double> p = replica_test::initial_params(seed, dim), g(dim, 0.0), mom(dim, 0.0);
    ddp::training_state state;
    state.add(p).add(mom);
    ddp::data::global_batch_sampler sampler(sampling, state);  // its cursor heals with the state
    auto opts = base;
    opts.replica_id = gid;
    ddp::GroupManager<ddp::local::communicator> gm(
        inner, store, cross_factory(index), state,
        avg == averaging::sharded ? ddp::group_state::sharded : ddp::group_state::replicated, opts);
    ddp::group_communicator<ddp::communicator_ref, ddp::communicator_ref> comm(inner, gm);
    const ddp::communicator_ref bucket_comm = avg == averaging::sharded ? ddp::communicator_ref(gm) : comm;
    ddp::Bucketer<ddp::bucketing::fixed> grads(bucket_comm, {}, {.check_layout = false});
    grads.add(p, g);
    grads.build();
    constexpr std::size_t micro_batches = 8;
    ddp::ReproducibleReducer red(comm, micro_batches, {.check_layout = false});
    red.add(g);
    red.build();
    const std::string me = gid + "/" + std::to_string(index);
    try {
      while (gm.step() < steps || static_cast<int>(gm.members().size()) < want_groups) {
        if (gm.step() > steps + 2000) throw std::runtime_error("the quorum never grew back to its expected size");
        gm.start_quorum();
        std::this_thread::sleep_for(1ms);  // "compute": lets join requests arrive between steps
        const std::int64_t s = gm.step();
        if (crash_at >= 0 && s >= crash_at) throw replica_test::crash{};
        std::vector<std::uint64_t> used;  // this rank's part of the group's share of the global batch
        const ddp::item_range mine = sampler.share(gm, index, k);
        for (std::size_t mb = mine.first; mb < mine.last; ++mb) {
          const auto ids = sampler.micro_batch(mb);
          used.insert(used.end(), ids.begin(), ids.end());
        }
        if (avg != averaging::reproducible) {
          const auto fresh = replica_test::gradient(me, s, p);
          std::copy(fresh.begin(), fresh.end(), g.begin());
          grads.mark_ready(0);
          grads.finalize();
        } else {
          red.begin(static_cast<std::uint64_t>(s));
          for (const std::size_t i : red.pending()) {
            const auto fresh = replica_test::gradient("batch" + std::to_string(i), s, p);
            std::copy(fresh.begin(), fresh.end(), g.begin());
            red.accumulate(i);
          }
          red.finalize();
        }
        if (gm.should_commit()) {
          for (std::size_t j = 0; j < dim; ++j) {
            mom[j] = beta * mom[j] + g[j];
            p[j] -= lr * mom[j];
          }
          out.commits.emplace_back(s, gm.members());
          out.samples[s] = std::move(used);
          sampler.commit();
          if (static_cast<int>(gm.members().size()) < want_groups) ++commits_without_a_group;
        }
      }
    } catch (const replica_test::crash&) {
      out.crashed = true;
      gm.abort();  // the rank "dies": its communicators go away
      inner.abort();
    } catch (const ddp::error& e) {
      out.left = e.what();  // checked by the scenario: only the failed group's ranks may stop
      inner.abort();
    } catch (const std::exception& e) {
      out.error = e.what();
      inner.abort();
    }
    out.params = p;
    out.momentum = mom;
    out.step = gm.step();
    out.stats = gm.stats();
  }

  // run_rank for DiLoCo: 3 inner steps (DDP inside the group) per outer step.
  void run_diloco_rank(const std::string& gid, int inc, int index, std::int64_t crash_at, std::int64_t steps,
                       int want_groups, rank_result& out) {
    out.group = gid;
    out.index = index;
    out.incarnation = inc;
    auto inner = fabric.connect("inner/" + gid + "/" + std::to_string(inc), index, k);
    std::vector<double> p = replica_test::initial_params(gid + "#" + std::to_string(inc), dim), g(dim, 0.0);
    ddp::training_state state;
    state.add(p);
    auto opts = base;
    opts.replica_id = gid;
    ddp::GroupManager<ddp::local::communicator> gm(inner, store, cross_factory(index), state,
                                                   ddp::group_state::replicated, opts);
    ddp::group_communicator<ddp::communicator_ref, ddp::communicator_ref> comm(inner, gm);
    ddp::fault_tolerant_diloco<ddp::outer_sgd, ddp::GroupManager<ddp::local::communicator>> outer(
        gm, comm, state, {ddp::view(p)}, {.sync_every = 3});
    ddp::Bucketer<ddp::bucketing::fixed> grads(inner, {}, {.check_layout = false});  // the inner steps: DDP inside
    grads.add(p, g);
    grads.build();
    const std::string me = gid + "/" + std::to_string(index);
    try {
      while (gm.step() < steps || static_cast<int>(gm.members().size()) < want_groups) {
        if (gm.step() > steps + 2000) throw std::runtime_error("the quorum never grew back to its expected size");
        const int n = outer.begin();
        std::this_thread::sleep_for(1ms);
        const std::int64_t s = gm.step();
        if (crash_at >= 0 && s >= crash_at) throw replica_test::crash{};
        for (int h = 0; h < n; ++h) {
          const auto fresh = replica_test::gradient(me, s * 10 + h, p);
          std::copy(fresh.begin(), fresh.end(), g.begin());
          grads.mark_ready(0);
          grads.finalize();
          for (std::size_t j = 0; j < dim; ++j) p[j] -= lr * g[j];
        }
        if (outer.end()) {
          out.commits.emplace_back(s, gm.members());
          if (static_cast<int>(gm.members().size()) < want_groups) ++commits_without_a_group;
        }
      }
    } catch (const replica_test::crash&) {
      out.crashed = true;
      gm.abort();
      inner.abort();
    } catch (const ddp::error& e) {
      out.left = e.what();
      inner.abort();
    } catch (const std::exception& e) {
      out.error = e.what();
      inner.abort();
    }
    out.params = p;
    out.momentum.assign(dim, 0.0);
    out.step = gm.step();
    out.stats = gm.stats();
  }
};

// Runs `groups` groups "grp0", ... of `j.k` ranks each. Rank `crash_index` of group `crash_group`
// (if >= 0) is killed at step `crash_at`; once every rank of that group stopped, the group
// restarts (incarnation 1) and trains until the end.
std::vector<rank_result> run_groups(job& j, int groups, std::int64_t steps, int crash_group = -1, int crash_index = 0,
                                    std::int64_t crash_at = -1) {
  std::vector<rank_result> results(static_cast<std::size_t>(groups * j.k));
  if (crash_group >= 0) results.resize(results.size() + static_cast<std::size_t>(j.k));
  std::vector<std::thread> threads;
  std::vector<std::thread> failed_group;
  for (int gr = 0; gr < groups; ++gr) {
    for (int i = 0; i < j.k; ++i) {
      const std::int64_t at = gr == crash_group && i == crash_index ? crash_at : -1;
      auto& out = results[static_cast<std::size_t>(gr * j.k + i)];
      (gr == crash_group ? failed_group : threads).emplace_back([&j, gr, i, at, steps, groups, &out] {
        j.run_rank("grp" + std::to_string(gr), 0, i, at, steps, groups, out);
      });
    }
  }
  if (crash_group >= 0) {
    for (auto& t : failed_group) t.join();
    // The others commit without the group before it comes back.
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (j.commits_without_a_group < 2 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(5ms);
    }
    for (int i = 0; i < j.k; ++i) {
      auto& out = results[static_cast<std::size_t>(groups * j.k + i)];
      threads.emplace_back([&j, crash_group, i, steps, groups, &out] {
        j.run_rank("grp" + std::to_string(crash_group), 1, i, -1, steps, groups, out);
      });
    }
  }
  for (auto& t : threads) t.join();
  return results;
}

std::string history(const std::vector<rank_result>& rs) {
  std::string out;
  for (const auto& r : rs) {
    out += r.group + "#" + std::to_string(r.incarnation) + "/" + std::to_string(r.index) +
           (r.crashed ? " crashed" : "") + " step " + std::to_string(r.step) +
           (r.left.empty() ? "" : " left: " + r.left) + (r.error.empty() ? "" : " ERROR: " + r.error) + "\n";
  }
  return out;
}

// Every rank that did not stop holds the same step, parameters and momentum, bit for bit (with
// `per_index`, every rank of the same index), and every step was applied with the same member
// groups wherever it was applied.
void check_live_ranks_agree(const std::vector<rank_result>& rs, std::int64_t steps, bool per_index = false) {
  INFO(history(rs));
  const rank_result* first = nullptr;
  std::map<int, const rank_result*> first_of_index;
  std::map<std::int64_t, std::vector<std::string>> applied;
  for (const auto& r : rs) {
    REQUIRE(r.error.empty());
    for (const auto& [s, members] : r.commits) {
      auto [it, fresh] = applied.emplace(s, members);
      CHECK(it->second == members);
    }
    if (r.crashed || !r.left.empty()) continue;
    if (!first) first = &r;
    const rank_result* same = per_index ? first_of_index.emplace(r.index, &r).first->second : first;
    INFO(r.group << "#" << r.incarnation << "/" << r.index);
    CHECK(r.step >= steps);
    CHECK(r.step == first->step);
    CHECK(r.params == same->params);
    CHECK(r.momentum == same->momentum);
  }
  REQUIRE(first != nullptr);
  for (std::int64_t s = 0; s < first->step; ++s) CHECK(applied.count(s) == 1);
  // Exactly once: the ranks that applied a step used its global batch, each sample once (the
  // sampler counts the groups, and a group's ranks split its share).
  bool sampled = false;  // (DiLoCo runs take no samples here)
  for (const auto& r : rs) sampled = sampled || !r.samples.empty();
  for (std::int64_t s = 0; sampled && s < first->step; ++s) {
    std::vector<std::uint64_t> used;
    for (const auto& r : rs) {
      const auto it = r.samples.find(s);
      if (it != r.samples.end()) used.insert(used.end(), it->second.begin(), it->second.end());
    }
    std::int64_t cursor = s * static_cast<std::int64_t>(sampling.global_batch);
    auto want = ddp::data::global_batch_sampler(sampling, cursor).global_batch();
    std::sort(used.begin(), used.end());
    std::sort(want.begin(), want.end());
    INFO("step " << s);
    CHECK(used == want);
  }
}

}  // namespace

TEST_CASE("GroupManager: groups train to the same bits on every rank", "[local][groups][manager]") {
  for (const int k : {1, 2, 3}) {
    job j;
    j.k = k;
    const auto rs = run_groups(j, 2, 6);
    INFO("k = " << k);
    check_live_ranks_agree(rs, 6);
    for (const auto& r : rs) CHECK(r.left.empty());
  }
}

TEST_CASE("GroupManager: a killed rank takes its group out; it restarts and heals by shard",
          "[local][groups][manager]") {
  const auto transport = GENERATE(ddp::heal_transport::quorum_broadcast, ddp::heal_transport::source_routes);
  for (const int crash_index : {1, 0}) {  // a follower, then a leader
    job j;
    j.base.heal_over = transport;
    const auto rs = run_groups(j, 3, 8, /*crash_group=*/1, crash_index, /*crash_at=*/3);
    INFO("killed index " << crash_index << ", heal over "
                         << (transport == ddp::heal_transport::source_routes ? "routes" : "the quorum"));
    INFO(history(rs));
    check_live_ranks_agree(rs, 8);
    // The killed rank's group-mate stopped (shared fate); no other rank did.
    for (const auto& r : rs) {
      const bool first_incarnation_of_failed = r.group == "grp1" && r.incarnation == 0;
      CHECK(first_incarnation_of_failed == (r.crashed || !r.left.empty()));
    }
    // The restarted group healed: its leader received the state, and it took part in later steps.
    const auto& restarted_leader = rs[3 * 2];
    CHECK(restarted_leader.incarnation == 1);
    CHECK(restarted_leader.stats.heals >= 1);
    CHECK_FALSE(restarted_leader.commits.empty());
    // The survivors committed steps without grp1 while it was away.
    bool without = false;
    for (const auto& [s, members] : rs[0].commits) without = without || members.size() == 2;
    CHECK(without);
  }
}

TEST_CASE("GroupManager: groups and one replica per rank give the same bits", "[local][groups][manager]") {
  job grouped;
  grouped.k = 2;
  grouped.avg = averaging::reproducible;
  const auto a = run_groups(grouped, 2, 5);
  job flat;
  flat.k = 1;
  flat.avg = averaging::reproducible;
  const auto b = run_groups(flat, 4, 5);
  check_live_ranks_agree(a, 5);
  check_live_ranks_agree(b, 5);
  CHECK(a.front().step == b.front().step);
  CHECK(a.front().params == b.front().params);
  CHECK(a.front().momentum == b.front().momentum);
}

TEST_CASE("GroupManager: sharded state (each rank its part) heals part by part", "[local][groups][manager]") {
  job j;
  j.avg = averaging::sharded;
  j.base.heal_over = ddp::heal_transport::source_routes;
  const auto rs = run_groups(j, 3, 8, /*crash_group=*/1, /*crash_index=*/1, /*crash_at=*/3);
  check_live_ranks_agree(rs, 8, /*per_index=*/true);
  // The parts differ: rank 0 and rank 1 of a group hold different parameters.
  CHECK(rs[0].params != rs[1].params);
  CHECK(rs[3 * 2].stats.heals >= 1);
}

TEST_CASE("GroupManager: DiLoCo over groups; a killed rank's group restarts and heals",
          "[local][groups][manager][diloco]") {
  job j;
  j.avg = averaging::diloco;
  const auto rs = run_groups(j, 3, 6, /*crash_group=*/2, /*crash_index=*/1, /*crash_at=*/2);
  check_live_ranks_agree(rs, 6);
  CHECK(rs[3 * 2].stats.heals >= 1);
  CHECK(rs[3 * 2 + 1].stats.heals >= 1);  // a follower knows its group healed (its DiLoCo restarts from the anchor)
}
