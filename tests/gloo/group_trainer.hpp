#pragma once
// A trainer process of a replica group for the GroupManager tests over gloo processes
// (tests/gloo, tests/hosts): one rank of a group of k, replicated DDP-style inside the group over
// group_communicator(inner gloo, GroupManager), its gradients averaged by a Bucketer or (with
// group_trainer_options::reproducible) by a ReproducibleReducer over micro-batches. Records as
// manager_trainer.hpp does, under the id "<group>.<index>": each commit ("c/<step>/<id>" =
// "<member groups> <state hash>") and, on the leader, each quorum's member list; check_records()
// asserts one state per step over every rank of every group.
#include <chrono>
#include <cmath>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <ddp/bucketer.hpp>
#include <ddp/bucketing/fixed.hpp>
#include <ddp/gloo.hpp>
#include <ddp/groups.hpp>
#include <ddp/reproducible.hpp>
#include <ddp/stores/file_store.hpp>
#include <ddp/stores/prefix_store.hpp>

#include "manager_trainer.hpp"
#include "process_group.hpp"

namespace gloo_test {

/// Which rank of which group, and which start of it (a restarted group is a new incarnation:
/// fresh state, a new inner communicator).
struct group_rank {
  std::string group;
  int index = 0;
  int group_size = 2;
  int incarnation = 0;
  [[nodiscard]] std::string id() const { return group + "." + std::to_string(index); }
};

/// What only a group's trainer has.
struct group_trainer_options {
  /// Gradients averaged by a `ReproducibleReducer` over `micro_batches` micro-batches per step
  /// (each rank computes its share of them), not by a Bucketer: the same bits at every number of
  /// groups, and the reducer's polled loop (issue #43 saw a hung peer there).
  bool reproducible = false;
  std::size_t micro_batches = 12;
  /// The inner communicator's timeout: how long a rank waits for a group-mate that stopped (0:
  /// `quorum_timeout` + 10 s). GroupManager refuses one below max(quorum_timeout, step_timeout +
  /// heartbeat_timeout).
  std::chrono::milliseconds inner_timeout{0};
};

/// Micro-batch `i`'s gradient of the reproducible trainer at step `s` (the same on every rank
/// that computes it): the gradient of 0.5 |p - t(s, i)|^2.
inline void micro_batch_gradient(const std::vector<double>& p, std::int64_t s, std::size_t i, std::vector<double>& g) {
  for (std::size_t k = 0; k < p.size(); ++k) {
    g[k] = p[k] - std::sin(0.3 * static_cast<double>(s) + static_cast<double>(k) + 0.1 * static_cast<double>(i));
  }
}

/// One rank of a group over `store` (the GroupManager's and the inner communicator's). Waits
/// until the job committed `start_after` steps; trains until `done(step, member groups)`;
/// `at_step(step)` runs at the start of every step (a test kills the process there).
template <class Store>
void train_group_rank(Store& store, const trainer_setup& setup, const group_rank& me, std::int64_t start_after,
                      const std::function<bool(std::int64_t, const std::vector<std::string>&)>& done,
                      const std::function<void(std::int64_t)>& at_step = {}, const group_trainer_options& extra = {}) {
  ddp::stores::file_store records(setup.records);
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (records.add("progress", 0) < start_after) {
    CHILD_CHECK(std::chrono::steady_clock::now() < deadline, "the job never reached step " << start_after);
    std::this_thread::sleep_for(5ms);
  }
  // The followers wait for the leader's quorum over the inner communicator: its timeout covers it.
  ddp::stores::prefix_store<Store> inner_ns(store, "inner/" + me.group + "/" + std::to_string(me.incarnation) + "/");
  ddp::gloo::options inner_options = setup.gloo;
  inner_options.timeout = extra.inner_timeout.count() > 0 ? extra.inner_timeout : setup.quorum_timeout + 10s;
  ddp::gloo::communicator inner(ddp::store_ref(inner_ns), me.index, me.group_size, inner_options);

  std::vector<double> p(dim), g(dim, 0.0), mom(dim, 0.0);
  const auto seed = std::hash<std::string>{}(me.group + "#" + std::to_string(me.incarnation));
  for (std::size_t k = 0; k < dim; ++k) p[k] = static_cast<double>(seed % 13) + 0.1 * static_cast<double>(k);
  ddp::training_state state;
  state.add(p).add(mom);
  ddp::manager_options opts;
  opts.replica_id = me.group;
  opts.min_replicas = setup.min_replicas;
  opts.heartbeat_interval = 20ms;
  opts.heartbeat_timeout = 600ms;
  opts.step_timeout = setup.step_timeout;  // a hung peer costs the others one step of at most this
  opts.settle = 20ms;
  opts.quorum_timeout = setup.quorum_timeout;
  opts.heal_chunk_bytes = 128;
  opts.progress = {};
  opts.heal_over = setup.heal_over;
  ddp::GroupManager<ddp::gloo::communicator> gm(
      inner, store,
      [&](const ddp::quorum_info& q) {
        return ddp::any_communicator(ddp::gloo::communicator(q.store, q.rank, q.size, setup.gloo));
      },
      state, ddp::group_state::replicated, opts);
  gm.on_event([&](const ddp::manager_event& e) {
    if (e.what != ddp::manager_event::kind::quorum) return;
    std::string members;
    for (const auto& x : gm.members()) members += x + ",";
    records.set("q/" + std::to_string(gm.generation()) + "/" + me.group, ddp::as_bytes(members));
  });
  ddp::group_communicator<ddp::communicator_ref, ddp::communicator_ref> comm(inner, gm);
  ddp::Bucketer<ddp::bucketing::fixed> grads(comm, {}, {.check_layout = false});
  grads.add(p, g);
  grads.build();
  ddp::ReproducibleReducer red(comm, extra.micro_batches, {.check_layout = false});
  red.add(g);
  red.build();
  for (int guard = 0;; ++guard) {
    CHILD_CHECK(guard < 2000, "no end after 2000 steps");
    gm.start_quorum();
    std::this_thread::sleep_for(2ms);
    const std::int64_t s = gm.step();
    if (at_step) at_step(s);
    if (extra.reproducible) {  // this rank's micro-batches; the mean over all of them, the same bits everywhere
      red.begin(static_cast<std::uint64_t>(s));
      for (const std::size_t i : red.pending()) {
        micro_batch_gradient(p, s, i, g);
        red.accumulate(i);
      }
      red.finalize();
    } else {
      for (std::size_t k = 0; k < dim; ++k) {
        g[k] = p[k] - std::sin(0.3 * static_cast<double>(s) + static_cast<double>(k) + me.index);
      }
      grads.mark_ready(0);
      grads.finalize();
    }
    if (!gm.should_commit()) continue;
    apply_step(p, mom, g);
    record_commit(records, s, me.id(), gm.members(), p, mom);
    record_progress(records, gm.step());
    if (done(gm.step(), gm.members())) return;
  }
}

}  // namespace gloo_test
