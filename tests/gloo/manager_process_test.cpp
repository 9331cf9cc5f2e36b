// The Manager over real processes, gloo and the file store (issue #24): two fresh replicas
// joining three that train must not split the job; a healing source SIGKILLed after its first
// chunk must not leave a torn state in use. Children record every commit and membership in the
// store; the parent checks: one state per committed step, one member list per committed step and
// per generation, and the job reached its last step.
#include <signal.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <sstream>
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

using namespace std::chrono_literals;
namespace st = ddp::stores;
using gloo_test::temp_dir;

namespace {

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

std::string text_of(const std::optional<ddp::store_value>& v) { return v ? ddp::to_text(*v) : std::string(); }

// One trainer process. Waits until the job committed `start_after` steps, trains until `done`,
// records "c/<step>/<id>" = "<members> <hash>" and "q/<generation>/<id>" = members.
void train(const std::filesystem::path& dir, const std::string& id, std::int64_t start_after,
           const std::function<bool(std::int64_t, const std::vector<std::string>&)>& done, int min_replicas,
           std::chrono::milliseconds quorum_timeout, std::function<void(int)> on_broadcast = {}) {
  st::file_store store(dir);
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (store.add("progress", 0) < start_after) {
    CHILD_CHECK(std::chrono::steady_clock::now() < deadline, "the job never reached step " << start_after);
    std::this_thread::sleep_for(5ms);
  }
  std::vector<double> p(dim), g(dim, 0.0), mom(dim, 0.0);
  for (std::size_t k = 0; k < dim; ++k) p[k] = static_cast<double>(std::hash<std::string>{}(id) % 13) + 0.1 * k;
  ddp::training_state state;
  state.add(p).add(mom);
  ddp::manager_options opts;
  opts.replica_id = id;
  opts.min_replicas = min_replicas;
  opts.heartbeat_interval = 20ms;
  opts.heartbeat_timeout = 600ms;
  opts.settle = 20ms;
  opts.quorum_timeout = quorum_timeout;
  opts.heal_chunk_bytes = 128;
  opts.progress = {};
  ddp::gloo::options go;
  go.timeout = 2s;
  go.connect_timeout = 3s;
  ddp::Manager m(
      store,
      [&](const ddp::quorum_info& q) {
        return ddp::any_communicator(killable_comm(ddp::gloo::communicator(q.store, q.rank, q.size, go), on_broadcast));
      },
      state, opts);
  m.on_event([&](const ddp::manager_event& e) {
    if (e.what != ddp::manager_event::kind::quorum) return;
    std::string members;
    for (const auto& x : m.members()) members += x + ",";
    store.set("q/" + std::to_string(m.generation()) + "/" + id, ddp::as_bytes(members));
  });
  ddp::Bucketer<ddp::bucketing::fixed> grads(m, {}, {.check_layout = false});
  grads.add(p, g);
  grads.build();
  m.set_layout_fingerprint(grads.layout_fingerprint());
  for (int guard = 0;; ++guard) {
    CHILD_CHECK(guard < 2000, "no end after 2000 steps");
    m.start_quorum();
    std::this_thread::sleep_for(2ms);
    const std::int64_t s = m.step();
    for (std::size_t k = 0; k < dim; ++k) g[k] = p[k] - std::sin(0.3 * static_cast<double>(s) + static_cast<double>(k));
    grads.mark_ready(0);
    grads.finalize();
    if (!m.should_commit()) continue;
    for (std::size_t k = 0; k < dim; ++k) {
      mom[k] = 0.9 * mom[k] + g[k];
      p[k] -= 0.1 * mom[k];
    }
    std::uint64_t h = ddp::detail::fnv1a(std::as_bytes(std::span(p)));
    h = ddp::detail::fnv1a(std::as_bytes(std::span(mom)), h);
    std::string members;
    for (const auto& x : m.members()) members += x + ",";
    store.set("c/" + std::to_string(s) + "/" + id, ddp::as_bytes(members + " " + std::to_string(h)));
    const auto seen = store.add("progress", 0);
    if (m.step() > seen) store.add("progress", m.step() - seen);  // a lower bound is all waiters need
    if (done(m.step(), m.members())) return;
  }
}

// The invariants, read back from the store.
void check_store(const std::filesystem::path& dir, const std::vector<std::string>& ids, std::int64_t steps,
                 std::uint64_t generations) {
  st::file_store store(dir);
  for (std::int64_t s = 0; s < steps; ++s) {
    std::set<std::string> values;
    for (const auto& id : ids) {
      const auto v = text_of(store.get("c/" + std::to_string(s) + "/" + id));
      if (!v.empty()) values.insert(v);
    }
    INFO("step " << s);
    CHECK(values.size() <= 1);  // same members and same state hash on every replica committing it
  }
  for (std::uint64_t g = 1; g <= generations; ++g) {
    std::set<std::string> lists;
    for (const auto& id : ids) {
      const auto v = text_of(store.get("q/" + std::to_string(g) + "/" + id));
      if (!v.empty()) lists.insert(v);
    }
    INFO("generation " << g);
    CHECK(lists.size() <= 1);
  }
}

}  // namespace

TEST_CASE("Manager over gloo processes: two fresh replicas join three training ones; one job",
          "[gloo][manager][file]") {
  for (int run = 0; run < 2; ++run) {
    INFO("run " << run);
    temp_dir dir("manager-join");
    const std::vector<std::string> ids{"r0", "r1", "r2", "r3", "r4"};
    gloo_test::process_group group(5, [&](int rank, const gloo_test::reporter&) {
      train(
          dir.path(), ids[static_cast<std::size_t>(rank)], rank < 3 ? 0 : 3 + run,
          [](std::int64_t s, const std::vector<std::string>& members) { return s >= 25 && members.size() == 5; }, 2,
          15s);
    });
    const auto outs = group.wait_all(40s);
    INFO(gloo_test::describe_all(outs));
    for (const auto& o : outs) CHECK(o.ok());
    check_store(dir.path(), ids, 25, 60);
  }
}

TEST_CASE("Manager over gloo processes: a healing source SIGKILLed after its first chunk", "[gloo][manager][file]") {
  temp_dir dir("manager-heal");
  // "a" and "c" train; "b" joins fresh. a kills itself (SIGKILL) on its second healing
  // broadcast as a source. b must heal from c, bit-identical, and never use the torn bytes.
  const std::vector<std::string> ids{"a", "b", "c"};
  const auto done = [](std::int64_t s, const std::vector<std::string>& members) {
    return s >= 20 && members == std::vector<std::string>{"b", "c"};
  };
  gloo_test::process_group group(3, [&](int rank, const gloo_test::reporter&) {
    if (rank == 0) {
      int sent = 0;
      train(dir.path(), "a", 0, done, 2, 15s, [&](int root) {
        if (root == 0 && st::file_store(dir.path()).get("b-started") && ++sent == 2) ::raise(SIGKILL);
      });
    } else if (rank == 1) {
      st::file_store s(dir.path());
      while (s.add("progress", 0) < 5) std::this_thread::sleep_for(5ms);
      s.set("b-started", ddp::as_bytes(std::string_view("1")));
      train(dir.path(), "b", 5, done, 2, 15s);
    } else {
      train(dir.path(), "c", 0, done, 2, 15s);
    }
  });
  const auto outs = group.wait_all(40s);
  INFO(gloo_test::describe_all(outs));
  CHECK((!outs[0].exited && outs[0].signal == SIGKILL));
  CHECK(outs[1].ok());
  CHECK(outs[2].ok());
  check_store(dir.path(), ids, 20, 60);
}
