// fault_tolerant_diloco over real processes, gloo and the file store (issue #43): three replicas,
// each a Manager whose steps are DiLoCo's outer steps; one stops itself with SIGSTOP (alive, its
// sockets open, silent), in its inner steps or right before the exchange of outer gradients. The
// others must commit their next outer step within step_timeout plus one quorum re-form (plus the
// redone outer step's inner steps); after SIGCONT the stopped replica finds its outer step failed,
// rejoins, heals the anchor and the outer momentum, and trains on. Children record every commit
// ("c/<step>/<id>" = "<members> <hash of anchor and outer momentum>") and membership; the parent
// checks one state per committed outer step, one member list per generation.
#include <signal.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/gloo.hpp>
#include <ddp/local_steps.hpp>
#include <ddp/manager.hpp>
#include <ddp/stores/file_store.hpp>

#include "manager_trainer.hpp"
#include "process_group.hpp"

using namespace std::chrono_literals;
namespace st = ddp::stores;
using gloo_test::temp_dir;

namespace {

constexpr int inner_steps = 4;                    // H
constexpr auto inner_step_time = 15ms;            // "compute" of one inner step
constexpr std::int64_t stop_at = 4, end_at = 16;  // outer steps

// Where the stopped replica stops in outer step `stop_at`.
enum class stop_point { inner_steps, exchange };

// Forwards to a gloo communicator; `before_exchange()` runs before every f64 allreduce (the
// exchange of outer gradients: the words and the vote are i64).
class hooked_comm {
 public:
  hooked_comm(ddp::gloo::communicator c, std::function<void()> before_exchange)
      : c_(std::move(c)), before_(std::move(before_exchange)) {}
  [[nodiscard]] int rank() const { return c_.rank(); }
  [[nodiscard]] int size() const { return c_.size(); }
  ddp::work allreduce(std::span<const ddp::tensor_view> ts, ddp::reduce_op op) {
    if (before_ && !ts.empty() && ts[0].type == ddp::dtype::f64) before_();
    return c_.allreduce(ts, op);
  }
  ddp::work broadcast(std::span<const ddp::tensor_view> ts, int root) { return c_.broadcast(ts, root); }
  ddp::work allgather(ddp::tensor_view in, ddp::tensor_view out) { return c_.allgather(in, out); }
  ddp::work reduce_scatter(ddp::tensor_view in, ddp::tensor_view out, ddp::reduce_op op) {
    return c_.reduce_scatter(in, out, op);
  }
  ddp::work barrier() { return c_.barrier(); }
  void abort() noexcept { c_.abort(); }

 private:
  ddp::gloo::communicator c_;
  std::function<void()> before_;
};

std::vector<double> copy_of(const ddp::tensor_view& t) {
  const auto* d = static_cast<const double*>(t.data);
  return {d, d + t.count};
}

// One DiLoCo replica over `store` (the Manager's and the records'); `stops` says whether (and
// where) it stops itself in outer step `stop_at`. Trains until `done(step, members)`.
void train_diloco(const gloo_test::trainer_setup& setup, const std::string& id, bool stops, stop_point where,
                  const std::function<bool(std::int64_t, const std::vector<std::string>&)>& done) {
  st::file_store store(setup.records);
  st::file_store records(setup.records);
  std::vector<double> p(gloo_test::dim);
  for (std::size_t k = 0; k < p.size(); ++k) {
    p[k] = static_cast<double>(std::hash<std::string>{}(id) % 13) + 0.1 * static_cast<double>(k);
  }
  ddp::training_state state;
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
  const ddp::Manager* manager = nullptr;
  bool stopped = false;
  const auto stop_here = [&](stop_point point) {
    if (!stops || stopped || point != where || manager == nullptr || manager->step() != stop_at) return;
    stopped = true;
    ::raise(SIGSTOP);  // until SIGCONT; no store lock is held here
  };
  ddp::Manager m(
      store,
      [&](const ddp::quorum_info& q) {
        return ddp::any_communicator(hooked_comm(ddp::gloo::communicator(q.store, q.rank, q.size, setup.gloo),
                                                 [&] { stop_here(stop_point::exchange); }));
      },
      state, opts);
  manager = &m;
  m.on_event([&](const ddp::manager_event& e) {
    if (e.what != ddp::manager_event::kind::quorum) return;
    std::string members;
    for (const auto& x : m.members()) members += x + ",";
    records.set("q/" + std::to_string(m.generation()) + "/" + id, ddp::as_bytes(members));
  });
  ddp::fault_tolerant_diloco<> outer(
      m, state, {ddp::view(p)},
      {.sync_every = inner_steps, .outer = ddp::outer_sgd{.lr = 0.7, .momentum = 0.9, .nesterov = true}});
  for (int guard = 0;; ++guard) {
    CHILD_CHECK(guard < 1000, "no end after 1000 outer steps");
    const int n = outer.begin();
    const std::int64_t s = m.step();
    for (int h = 0; h < n; ++h) {  // inner SGD on this rank's data of outer step s
      std::this_thread::sleep_for(inner_step_time);
      if (h == 1) stop_here(stop_point::inner_steps);
      for (std::size_t k = 0; k < p.size(); ++k) {
        const double t = std::sin(0.37 * static_cast<double>(s * inner_steps + h) + static_cast<double>(k) + m.rank());
        p[k] -= 0.3 * (p[k] - t);
      }
    }
    if (!outer.end()) continue;
    const auto kept = outer.state();  // the anchor (= the parameters now), the outer momentum
    gloo_test::record_commit(records, s, id, m.members(), copy_of(kept[0]), copy_of(kept[1]));
    if (done(m.step(), m.members())) return;
  }
}

void check_replica_stopped(stop_point where) {
  using clock_type = std::chrono::steady_clock;
  const auto ms = [](clock_type::duration d) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
  };
  temp_dir dir("diloco-hang");
  const std::vector<std::string> ids{"a", "b", "c"};
  constexpr auto step_timeout = 1500ms;
  gloo_test::trainer_setup setup{.records = dir.path(), .min_replicas = 2, .quorum_timeout = 20s};
  setup.gloo.timeout = 60s;  // gloo's own: a backstop the step's deadline must beat
  setup.step_timeout = step_timeout;
  const auto done = [](std::int64_t s, const std::vector<std::string>& members) {
    return s >= end_at && members.size() == 3;
  };
  gloo_test::process_group group(3, [&](int rank, const gloo_test::reporter&) {
    train_diloco(setup, ids[static_cast<std::size_t>(rank)], rank == 2, where, done);
  });
  st::file_store records(dir.path());
  // From the commit records (every replica records its own).
  const auto committed = [&](std::int64_t s) { return !gloo_test::commit_of(records, s, ids).empty(); };
  REQUIRE(group.wait_stopped(2, 30s));
  const auto stopped = clock_type::now();
  const std::int64_t at_stop = gloo_test::first_uncommitted(records, ids);
  // The outer step c stopped in fails at its deadline; the quorum re-forms without c and redoes it.
  const auto until = clock_type::now() + 30s;
  while (!committed(stop_at) && clock_type::now() < until) std::this_thread::sleep_for(1ms);
  const bool moved_on = committed(stop_at);
  const auto stall = clock_type::now() - stopped;
  group.kill(2, SIGCONT);
  // c rejoins, heals and commits.
  const auto resumed = clock_type::now();
  std::int64_t back = -1;
  for (const auto give_up = resumed + 30s; back < 0 && clock_type::now() < give_up;) {
    back = gloo_test::first_commit_of(records, "c", stop_at, ids);
    if (back < 0) std::this_thread::sleep_for(2ms);
  }
  const auto rejoin = clock_type::now() - resumed;
  const auto outs = group.wait_all(60s);
  INFO(gloo_test::describe_all(outs));
  INFO("stall to the next commit after SIGSTOP: " << ms(stall) << " ms");
  CHECK(at_stop <= stop_at);
  CHECK(moved_on);
  // The rest of the others' inner steps, one step's deadline, one re-form (heartbeat_timeout
  // 600 ms, settle), the redone outer step: generous for a busy machine, far below gloo's minute.
  CHECK(stall < step_timeout + 8s);
  CHECK(back > stop_at);
  for (const auto& o : outs) CHECK(o.ok());
  const std::int64_t steps = gloo_test::first_uncommitted(records, ids);
  CHECK(steps >= end_at);
  gloo_test::check_records(dir.path(), ids, steps, 200);
  // The others committed the outer step c stopped in without c.
  const auto without = gloo_test::commit_of(records, stop_at, ids);
  CHECK_FALSE(without.empty());
  CHECK(without.find("c,") == std::string::npos);
  // c ended in the full quorum with the others' anchor and momentum: it healed.
  const std::string last = "c/" + std::to_string(steps - 1) + "/";
  CHECK_FALSE(gloo_test::text_of(records.get(last + "c")).empty());
  CHECK(gloo_test::text_of(records.get(last + "c")) == gloo_test::text_of(records.get(last + "a")));
  WARN("diloco hang (" << (where == stop_point::exchange ? "before the exchange" : "in its inner steps")
                       << "): the others' next commit " << ms(stall) << " ms after SIGSTOP; resumed, c committed step "
                       << back << " " << ms(rejoin) << " ms after SIGCONT");
}

}  // namespace

TEST_CASE(
    "fault_tolerant_diloco over gloo processes: a replica stopped by SIGSTOP in its inner steps costs the "
    "others one outer step; resumed, it heals",
    "[gloo][diloco][manager][file][hang]") {
  check_replica_stopped(stop_point::inner_steps);
}

TEST_CASE(
    "fault_tolerant_diloco over gloo processes: a replica stopped by SIGSTOP before the exchange of outer "
    "gradients costs the others one outer step; resumed, it heals",
    "[gloo][diloco][manager][file][hang]") {
  check_replica_stopped(stop_point::exchange);
}
