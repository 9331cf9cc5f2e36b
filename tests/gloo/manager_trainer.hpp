#pragma once
// A trainer process for the Manager tests over gloo processes (tests/gloo, tests/hosts): trains
// a small model through the Manager and records, in a file store of records shared by every
// process, each commit ("c/<step>/<id>" = "<members> <state hash>") and each quorum's member list
// ("q/<generation>/<id>"); check_records() then asserts one state and one member list per step
// and per generation. The Manager's own store is the caller's (a file store, or Redis on a host).
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/bucketer.hpp>
#include <ddp/bucketing/fixed.hpp>
#include <ddp/detail/fnv1a.hpp>
#include <ddp/gloo.hpp>
#include <ddp/manager.hpp>
#include <ddp/stores/file_store.hpp>

#include "process_group.hpp"

namespace gloo_test {

using namespace std::chrono_literals;

constexpr std::size_t dim = 64;

// Forwards to a gloo communicator; `on_broadcast(root)` runs before every broadcast.
class killable_comm {
 public:
  killable_comm(ddp::gloo::communicator c, std::function<void(int)> on_broadcast)
      : c_(std::move(c)), on_(std::move(on_broadcast)) {}
  [[nodiscard]] int rank() const { return c_.rank(); }
  [[nodiscard]] int size() const { return c_.size(); }
  ddp::work allreduce(std::span<const ddp::tensor_view> ts, ddp::reduce_op op) { return c_.allreduce(ts, op); }
  ddp::work broadcast(std::span<const ddp::tensor_view> ts, int root) {
    if (on_) on_(root);
    return c_.broadcast(ts, root);
  }
  ddp::work allgather(ddp::tensor_view in, ddp::tensor_view out) { return c_.allgather(in, out); }
  ddp::work reduce_scatter(ddp::tensor_view in, ddp::tensor_view out, ddp::reduce_op op) {
    return c_.reduce_scatter(in, out, op);
  }
  ddp::work barrier() { return c_.barrier(); }
  void abort() noexcept { c_.abort(); }

 private:
  ddp::gloo::communicator c_;
  std::function<void(int)> on_;
};

inline std::string text_of(const std::optional<ddp::store_value>& v) { return v ? ddp::to_text(*v) : std::string(); }

/// A committed step of the trainers' model: momentum SGD.
inline void apply_step(std::vector<double>& p, std::vector<double>& mom, const std::vector<double>& g) {
  for (std::size_t k = 0; k < p.size(); ++k) {
    mom[k] = 0.9 * mom[k] + g[k];
    p[k] -= 0.1 * mom[k];
  }
}

/// Records that `id` committed step `s` with `members`: "c/<s>/<id>" = "<members> <state hash>".
inline void record_commit(ddp::stores::file_store& records, std::int64_t s, const std::string& id,
                          const std::vector<std::string>& members, const std::vector<double>& p,
                          const std::vector<double>& mom) {
  std::uint64_t h = ddp::detail::fnv1a(std::as_bytes(std::span(p)));
  h = ddp::detail::fnv1a(std::as_bytes(std::span(mom)), h);
  std::string list;
  for (const auto& x : members) list += x + ",";
  records.set("c/" + std::to_string(s) + "/" + id, ddp::as_bytes(list + " " + std::to_string(h)));
}

/// Raises "progress" to `steps` (a lower bound is all waiters need).
inline void record_progress(ddp::stores::file_store& records, std::int64_t steps) {
  const auto seen = records.add("progress", 0);
  if (steps > seen) records.add("progress", steps - seen);
}

/// What the first of `ids` that committed step `s` recorded ("<members> <state hash>"), or "".
inline std::string commit_of(ddp::stores::file_store& records, std::int64_t s, const std::vector<std::string>& ids) {
  for (const auto& id : ids) {
    if (auto v = records.get("c/" + std::to_string(s) + "/" + id)) return ddp::to_text(*v);
  }
  return {};
}

/// The first step from `from` on that none of `ids` committed: with every replica among `ids`,
/// the steps the job committed so far. Exact, where "progress" is not (two replicas raising it at
/// once may push it past the steps committed).
inline std::int64_t first_uncommitted(ddp::stores::file_store& records, const std::vector<std::string>& ids,
                                      std::int64_t from = 0) {
  while (!commit_of(records, from, ids).empty()) ++from;
  return from;
}

/// The first step from `from` on that `id` committed, up to the first that none of `ids` did;
/// -1 if none.
inline std::int64_t first_commit_of(ddp::stores::file_store& records, const std::string& id, std::int64_t from,
                                    const std::vector<std::string>& ids) {
  const std::int64_t head = first_uncommitted(records, ids, from);
  for (std::int64_t s = from; s <= head; ++s) {
    if (records.get("c/" + std::to_string(s) + "/" + id)) return s;
  }
  return -1;
}

/// How a trainer runs.
struct trainer_setup {
  std::filesystem::path records;  ///< file store of the records (and "progress": steps committed)
  ddp::gloo::options gloo = [] {
    ddp::gloo::options go;
    go.timeout = 2s;
    go.connect_timeout = 3s;
    return go;
  }();
  int min_replicas = 2;
  std::chrono::milliseconds quorum_timeout = 15s;
  std::chrono::milliseconds step_timeout = 5s;  ///< manager_options::step_timeout
  std::function<void(int)> on_broadcast{};      ///< runs before every broadcast of the Manager's communicator
  std::function<void(std::int64_t)> on_step{};  ///< runs after each start_quorum(), with the step
  std::function<void(const ddp::quorum_info&)> on_connect{};  ///< runs as the factory starts, before gloo connects
  int active_replicas = 0;  ///< hot spares (manager_options::active_replicas); each commit records its participant rank
  ddp::heal_transport heal_over = ddp::heal_transport::quorum_broadcast;  ///< manager_options::heal_over
};

/// One trainer process over `store` (the Manager's). Waits until the job committed `start_after`
/// steps, trains until `done(step, members)`.
template <class Store>
void train(Store& store, const trainer_setup& setup, const std::string& id, std::int64_t start_after,
           const std::function<bool(std::int64_t, const std::vector<std::string>&)>& done) {
  ddp::stores::file_store records(setup.records);
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (records.add("progress", 0) < start_after) {
    CHILD_CHECK(std::chrono::steady_clock::now() < deadline, "the job never reached step " << start_after);
    std::this_thread::sleep_for(5ms);
  }
  std::vector<double> p(dim), g(dim, 0.0), mom(dim, 0.0);
  for (std::size_t k = 0; k < dim; ++k) p[k] = static_cast<double>(std::hash<std::string>{}(id) % 13) + 0.1 * k;
  ddp::training_state state;
  state.add(p).add(mom);
  ddp::manager_options opts;
  opts.replica_id = id;
  opts.min_replicas = setup.min_replicas;
  opts.heartbeat_interval = 20ms;
  opts.heartbeat_timeout = 600ms;
  opts.step_timeout = setup.step_timeout;
  opts.settle = 20ms;
  opts.quorum_timeout = setup.quorum_timeout;
  opts.heal_chunk_bytes = 128;
  opts.progress = {};
  opts.active_replicas = setup.active_replicas;
  opts.heal_over = setup.heal_over;
  ddp::Manager m(
      store,
      [&](const ddp::quorum_info& q) {
        if (setup.on_connect) setup.on_connect(q);
        ddp::gloo::options go = setup.gloo;
        go.connect_timeout = q.connect_time_left(go.connect_timeout);  // as gloo::manager_factory does
        return ddp::any_communicator(
            killable_comm(ddp::gloo::communicator(q.store, q.rank, q.size, go), setup.on_broadcast));
      },
      state, opts);
  m.on_event([&](const ddp::manager_event& e) {
    if (e.what != ddp::manager_event::kind::quorum) return;
    std::string members;
    for (const auto& x : m.members()) members += x + ",";
    records.set("q/" + std::to_string(m.generation()) + "/" + id, ddp::as_bytes(members));
  });
  ddp::Bucketer<ddp::bucketing::fixed> grads(m, {}, {.check_layout = false});
  if (setup.active_replicas > 0) grads.register_comm_hook(m.comm_hook());  // spares count as zeros
  grads.add(p, g);
  grads.build();
  m.set_layout_fingerprint(grads.layout_fingerprint());
  for (int guard = 0;; ++guard) {
    CHILD_CHECK(guard < 2000, "no end after 2000 steps");
    m.start_quorum();
    std::this_thread::sleep_for(2ms);
    const std::int64_t s = m.step();
    if (setup.on_step) setup.on_step(s);
    for (std::size_t k = 0; k < dim; ++k) g[k] = p[k] - std::sin(0.3 * static_cast<double>(s) + static_cast<double>(k));
    grads.mark_ready(0);
    grads.finalize();
    if (!m.should_commit()) continue;
    apply_step(p, mom, g);
    record_commit(records, s, id, m.members(), p, mom);
    if (setup.active_replicas > 0) {  // who contributed, and this replica's heals so far
      records.set("p/" + std::to_string(s) + "/" + id,
                  ddp::as_bytes(std::to_string(m.participant_rank()) + " " + std::to_string(m.participants()) + " " +
                                std::to_string(m.stats().heals)));
    }
    record_progress(records, m.step());
    if (done(m.step(), m.members())) return;
  }
}

/// The invariants, read back from the records: one (members, state hash) per committed step
/// below `steps`, one member list per generation up to `generations`.
inline void check_records(const std::filesystem::path& dir, const std::vector<std::string>& ids, std::int64_t steps,
                          std::uint64_t generations) {
  ddp::stores::file_store records(dir);
  for (std::int64_t s = 0; s < steps; ++s) {
    std::set<std::string> values;
    for (const auto& id : ids) {
      const auto v = text_of(records.get("c/" + std::to_string(s) + "/" + id));
      if (!v.empty()) values.insert(v);
    }
    INFO("step " << s);
    CHECK(values.size() <= 1);  // same members and same state hash on every replica committing it
  }
  for (std::uint64_t g = 1; g <= generations; ++g) {
    std::set<std::string> lists;
    for (const auto& id : ids) {
      const auto v = text_of(records.get("q/" + std::to_string(g) + "/" + id));
      if (!v.empty()) lists.insert(v);
    }
    INFO("generation " << g);
    CHECK(lists.size() <= 1);
  }
}

}  // namespace gloo_test
