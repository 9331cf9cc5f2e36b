// The Manager must never apply a wrong step (issue #24): joins and restarts that used to split
// the job in two, a healing source that dies after its first chunk, a replica that reports an
// impossible step. Threads over the local backend and an in-memory store.
//
// After every run: replicas that committed step s hold the same state hash; every generation has
// one membership; the quorums that commit a step all have the same members; the job went on
// committing while a majority was alive.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include <catch2/catch.hpp>
#include <ddp/bucketer.hpp>
#include <ddp/bucketing/fixed.hpp>
#include <ddp/detail/fnv1a.hpp>
#include <ddp/local.hpp>
#include <ddp/manager.hpp>
#include <ddp/stores/memory_store.hpp>

#include "../common/replicas.hpp"

using namespace std::chrono_literals;
using ddp::tensor_view;

namespace {

constexpr std::size_t dim = 6;

using replica_test::crash;  // a replica "dies": its thread unwinds, its heartbeat stops
using replica_test::gradient;

std::vector<double> initial_params(const std::string& id) { return replica_test::initial_params(id, dim); }

// A local communicator whose operations a test can intercept (to kill a healing source after
// its first chunk, or to make a replica report words of its choice).
class hooked_comm {
 public:
  using hook = std::function<void(const char* op, tensor_view in, int root)>;
  hooked_comm(ddp::local::communicator c, hook h) : c_(std::move(c)), h_(std::move(h)) {}
  [[nodiscard]] int rank() const { return c_.rank(); }
  [[nodiscard]] int size() const { return c_.size(); }
  ddp::work allreduce(std::span<const tensor_view> ts, ddp::reduce_op op) { return c_.allreduce(ts, op); }
  ddp::work broadcast(std::span<const tensor_view> ts, int root) {
    if (h_) h_("broadcast", ts.empty() ? tensor_view{} : ts[0], root);
    return c_.broadcast(ts, root);
  }
  ddp::work allgather(tensor_view in, tensor_view out) {
    if (h_) h_("allgather", in, -1);
    return c_.allgather(in, out);
  }
  ddp::work reduce_scatter(tensor_view in, tensor_view out, ddp::reduce_op op) {
    return c_.reduce_scatter(in, out, op);
  }
  ddp::work barrier() { return c_.barrier(); }
  void abort() noexcept { c_.abort(); }

 private:
  ddp::local::communicator c_;
  hook h_;
};

struct commit_entry {
  std::string id;
  std::uint64_t generation;
  std::vector<std::string> members;
  std::uint64_t hash;
};

struct run_hooks {
  std::function<void(std::int64_t step)> before_step;  // may throw crash or sleep
  hooked_comm::hook comm;                              // intercepts the quorum's communicator
  std::function<void(ddp::manager_options&)> options;
  std::uint64_t layout_salt = 0;  // a replica configured with another layout
};

// What every replica reports, shared between threads.
struct job {
  ddp::stores::memory_store store;
  ddp::local::fabric fabric{ddp::local::options{.timeout = 1000ms, .faults = {}}};
  ddp::manager_options base = replica_test::scenario_options();
  std::mutex mu;
  std::map<std::int64_t, std::vector<commit_entry>> commits;                // step -> who committed it
  std::map<std::uint64_t, std::set<std::vector<std::string>>> memberships;  // generation -> lists seen
  std::map<std::string, std::string> errors;                                // replica -> error text
  std::vector<std::string> history;
  std::atomic<std::int64_t> max_step{-1};

  job() {
    base.quorum_timeout = 8s;  // shorter and faster than the other scenarios; several heal chunks still
    base.heartbeat_timeout = 300ms;
    base.settle = 5ms;
    base.progress = {};
  }

  using hooks = run_hooks;

  // Trains until `done(step, members)` holds on a committed step (every member of a quorum sees
  // the same step and members, so they stop together) or the replica dies.
  void run(const std::string& id, const std::function<bool(std::int64_t, const std::vector<std::string>&)>& done,
           hooks h = {}) {
    std::vector<double> p = initial_params(id), g(dim, 0.0), mom(dim, 0.0);
    ddp::training_state state;
    state.add(p).add(mom);
    const auto opt_steps = state.add_scalar(0);
    auto opts = base;
    opts.replica_id = id;
    if (h.options) h.options(opts);
    ddp::Manager m(
        store,
        [this, h](const ddp::quorum_info& q) {
          auto c = fabric.connect(replica_test::fabric_key(q), q.rank, q.size);
          if (!h.comm) return ddp::any_communicator(std::move(c));
          return ddp::any_communicator(hooked_comm(std::move(c), h.comm));
        },
        state, opts);
    m.on_event([&](const ddp::manager_event& e) {
      std::lock_guard lk(mu);
      history.push_back(id + ": " + e.text);
      if (e.what == ddp::manager_event::kind::quorum) memberships[m.generation()].insert(m.members());
    });
    ddp::Bucketer<ddp::bucketing::fixed> grads(m, {}, {.check_layout = false});
    grads.add(p, g);
    grads.build();
    m.set_layout_fingerprint(grads.layout_fingerprint() + h.layout_salt);
    try {
      for (int guard = 0;; ++guard) {
        if (guard > 3000) throw std::runtime_error("no end after 3000 steps: the job never converged");
        m.start_quorum();
        std::this_thread::sleep_for(1ms);  // "compute": join requests arrive between steps
        const std::int64_t s = m.step();
        if (h.before_step) h.before_step(s);
        const auto fresh = gradient(id, s, p);
        std::copy(fresh.begin(), fresh.end(), g.begin());
        grads.mark_ready(0);
        grads.finalize();
        if (m.should_commit()) {
          for (std::size_t k = 0; k < dim; ++k) {
            mom[k] = 0.9 * mom[k] + g[k];
            p[k] -= 0.1 * mom[k];
          }
          ++state.scalar(opt_steps);
          std::uint64_t hash = ddp::detail::fnv1a(std::as_bytes(std::span(p)));
          hash = ddp::detail::fnv1a(std::as_bytes(std::span(mom)), hash);
          hash = ddp::detail::fnv1a_object(state.scalar(opt_steps), hash);
          {
            std::lock_guard lk(mu);
            commits[s].push_back({id, m.generation(), m.members(), hash});
          }
          std::int64_t seen = max_step.load();
          while (seen < s && !max_step.compare_exchange_weak(seen, s)) {
          }
          if (done(m.step(), m.members())) break;
        }
      }
    } catch (const crash&) {
      m.abort();
    } catch (const std::exception& e) {
      std::lock_guard lk(mu);
      errors[id] = e.what();
    }
  }

  std::string story() {
    std::lock_guard lk(mu);
    std::string s;
    for (const auto& [id, e] : errors) s += "error " + id + ": " + e + "\n";
    for (const auto& line : history) s += "  " + line + "\n";
    return s;
  }

  // The invariants of issue #24.
  void check_invariants() {
    INFO(story());
    std::lock_guard lk(mu);
    for (const auto& [gen, lists] : memberships) {
      INFO("generation " << gen);
      CHECK(lists.size() == 1);  // one membership per generation
    }
    for (const auto& [step, entries] : commits) {
      INFO("step " << step);
      for (const auto& e : entries) {
        CHECK(e.hash == entries.front().hash);        // one state per committed step
        CHECK(e.members == entries.front().members);  // one quorum per committed step
      }
    }
  }

  void wait_for_step(std::int64_t s) {
    for (int i = 0; i < 4000 && max_step.load() < s; ++i) std::this_thread::sleep_for(1ms);
  }
};

// The steps each run starts at, and where the random timings come from.
constexpr int runs = 4;

}  // namespace

TEST_CASE("Manager: two fresh replicas join three training ones together; one job, no split",
          "[local][manager][split]") {
  std::mt19937 rng(2401);
  for (int run = 0; run < runs; ++run) {
    job j;
    const auto step_ms = std::chrono::milliseconds(10 + rng() % 30);
    const std::int64_t join_at = 2 + static_cast<std::int64_t>(rng() % 3);
    INFO("run " << run << ": steps of " << step_ms.count() << " ms, joiners at step " << join_at);
    const auto done = [](std::int64_t s, const std::vector<std::string>& members) {
      return s >= 15 && members.size() == 5;
    };
    const job::hooks slow{
        .before_step = [step_ms](std::int64_t) { std::this_thread::sleep_for(step_ms); }, .comm = {}, .options = {}};
    std::vector<std::thread> ts;
    for (int r = 0; r < 3; ++r) ts.emplace_back([&, r] { j.run("r" + std::to_string(r), done, slow); });
    j.wait_for_step(join_at);
    for (int r = 3; r < 5; ++r) ts.emplace_back([&, r] { j.run("r" + std::to_string(r), done, slow); });
    for (auto& t : ts) t.join();
    INFO(j.story());
    CHECK(j.errors.empty());
    CHECK(j.max_step.load() >= 14);
    j.check_invariants();
  }
}

TEST_CASE("Manager: two of five crash in one step and restart together while two others are slow",
          "[local][manager][split]") {
  std::mt19937 rng(2402);
  for (int run = 0; run < runs; ++run) {
    job j;
    const std::int64_t at = 2 + static_cast<std::int64_t>(rng() % 3);
    const auto slow_ms = std::chrono::milliseconds(30 + rng() % 50);
    INFO("run " << run << ": r1 and r2 crash at step " << at << ", r3 and r4 slow by " << slow_ms.count() << " ms");
    const auto done = [](std::int64_t s, const std::vector<std::string>& members) {
      return s >= 14 && members.size() == 5;
    };
    std::vector<std::thread> ts;
    std::atomic<int> crashed{0};
    for (int r = 0; r < 5; ++r) {
      ts.emplace_back([&, r] {
        const std::string id = "r" + std::to_string(r);
        job::hooks h;
        if (r == 1 || r == 2) {
          h.before_step = [&, at](std::int64_t s) {
            if (s == at) {
              ++crashed;
              throw crash{};
            }
          };
        } else if (r >= 3) {
          h.before_step = [&, at, slow_ms](std::int64_t s) {
            if (s >= at && s <= at + 2) std::this_thread::sleep_for(slow_ms);
          };
        }
        j.run(id, done, h);
        if (r == 1 || r == 2) j.run(id, done);  // restarted: the same id, fresh state
      });
    }
    for (auto& t : ts) t.join();
    INFO(j.story());
    CHECK(crashed.load() == 2);
    CHECK(j.errors.empty());
    CHECK(j.max_step.load() >= 13);
    j.check_invariants();
  }
}

TEST_CASE("Manager: a healing source killed after its first chunk; the torn state is never used",
          "[local][manager][heal]") {
  for (int run = 0; run < runs; ++run) {
    INFO("run " << run);
    job j;
    j.base.min_replicas = 1;
    j.base.quorum_timeout = 700ms;
    // "a" trains alone, "b" joins fresh; a dies after sending its first healing chunk. b holds
    // half a's bytes and half its own: it must neither commit nor serve them.
    std::atomic<bool> b_started{false};
    std::atomic<int> a_sent{0};
    std::thread a([&] {
      job::hooks h;
      h.comm = [&](const char* op, tensor_view, int root) {
        // Broadcasts in a quorum with b are healing chunks (a alone broadcasts nothing).
        if (std::strcmp(op, "broadcast") == 0 && root == 0 && b_started.load() && a_sent++ == 1 + run % 2)
          throw crash{};
      };
      h.before_step = [](std::int64_t) { std::this_thread::sleep_for(1ms); };
      j.run(
          "a", [](std::int64_t, const std::vector<std::string>&) { return false; }, h);
    });
    j.wait_for_step(6);
    b_started = true;
    std::thread b([&] { j.run("b", [](std::int64_t s, const std::vector<std::string>&) { return s >= 10; }); });
    a.join();
    b.join();
    INFO(j.story());
    j.check_invariants();
    // b's only way on was a's state, which died with a: b gives up rather than train on it.
    std::lock_guard lk(j.mu);
    for (const auto& [step, entries] : j.commits) {
      for (const auto& e : entries) CHECK(e.id == "a");
    }
    CHECK(j.errors.count("b") == 1);
  }
}

TEST_CASE("Manager: a source killed mid-heal; the receiver heals from the other source", "[local][manager][heal]") {
  for (int run = 0; run < 2 * runs; ++run) {
    // Over the quorum's communicator, and over one route per source (a's route dies with it).
    const auto over = run / 2 % 2 == 0 ? ddp::heal_transport::quorum_broadcast : ddp::heal_transport::source_routes;
    INFO("run " << run << (over == ddp::heal_transport::source_routes ? ", source routes" : ", quorum broadcast"));
    job j;
    j.base.heal_over = over;
    std::atomic<bool> joiner_started{false};
    std::atomic<int> sent{0};
    const auto done = [](std::int64_t s, const std::vector<std::string>& members) {
      return s >= 12 && members == std::vector<std::string>{"b", "c"};
    };
    std::thread a([&] {
      job::hooks h;
      h.comm = [&](const char* op, tensor_view, int root) {
        if (std::strcmp(op, "broadcast") == 0 && joiner_started.load() && sent++ == run % 2) {
          (void)root;
          throw crash{};
        }
      };
      j.run("a", done, h);
    });
    std::thread c([&] { j.run("c", done); });
    j.wait_for_step(5);
    joiner_started = true;
    std::thread b([&] { j.run("b", done); });
    a.join();
    b.join();
    c.join();
    INFO(j.story());
    CHECK(j.errors.empty());
    CHECK(j.max_step.load() >= 11);
    CHECK(sent.load() > run % 2);                                     // a was killed while sending
    CHECK(j.story().find("b: healed to step") != std::string::npos);  // b healed in the end
    j.check_invariants();
  }
}

TEST_CASE("Manager: a replica reporting an impossible step is named and left out", "[local][manager][heal]") {
  for (int run = 0; run < runs; ++run) {
    INFO("run " << run);
    job j;
    std::atomic<bool> lie{false};
    const auto done = [](std::int64_t s, const std::vector<std::string>& members) {
      return s >= 12 && members == std::vector<std::string>{"r0", "r2", "r3"};
    };
    std::vector<std::thread> ts;
    for (int r = 0; r < 3; ++r) {
      ts.emplace_back([&, r] {
        job::hooks h;
        if (r == 1) {
          // The first allgather of a quorum is the exchange of (step, ...) words: r1 claims the
          // largest step there is once the job is running.
          h.comm = [&](const char* op, tensor_view in, int) {
            if (std::strcmp(op, "allgather") == 0 && lie.load() && in.type == ddp::dtype::i64 && in.count >= 4) {
              static_cast<std::int64_t*>(in.data)[0] = std::numeric_limits<std::int64_t>::max();
            }
          };
        }
        j.run("r" + std::to_string(r), done, h);
      });
    }
    j.wait_for_step(3);
    lie = true;
    ts.emplace_back([&] { j.run("r3", done); });  // a join makes everyone re-form
    for (auto& t : ts) t.join();
    INFO(j.story());
    j.check_invariants();
    CHECK(j.max_step.load() >= 11);
    CHECK(j.max_step.load() < 100000);  // no step taken from the lie (nor ++INT64_MAX)
    REQUIRE(j.errors.count("r1") == 1);
    CHECK(j.errors["r1"].find("r1") != std::string::npos);
    CHECK(j.errors.size() == 1);
  }
}

// Replica "x", started with `h` once 3 replicas train, is refused with an error containing
// `told`; the others go on.
void check_refused_joiner(const run_hooks& h, const std::string& told) {
  for (int run = 0; run < runs; ++run) {
    INFO("run " << run);
    job j;
    std::atomic<bool> x_out{false};
    const auto done = [&](std::int64_t s, const std::vector<std::string>& members) {
      return s >= 10 && members.size() == 3 && x_out.load();
    };
    std::vector<std::thread> ts;
    for (int r = 0; r < 3; ++r) ts.emplace_back([&, r] { j.run("r" + std::to_string(r), done); });
    j.wait_for_step(2);
    ts.emplace_back([&] {
      j.run("x", done, h);
      x_out = true;
    });
    for (auto& t : ts) t.join();
    INFO(j.story());
    j.check_invariants();
    CHECK(j.max_step.load() >= 9);
    REQUIRE(j.errors.count("x") == 1);
    CHECK(j.errors["x"].find(told) != std::string::npos);
    CHECK(j.errors.size() == 1);
  }
}

TEST_CASE("Manager: a replica with another layout is told so and left out; the others go on",
          "[local][manager][split]") {
  run_hooks h;
  h.layout_salt = 1;
  check_refused_joiner(h, "replica x registered a different gradient layout");
}

// Members that disagree on who contributes would divide by different counts.
TEST_CASE("Manager: a replica with other participation rules is told so and left out; the others go on",
          "[local][manager][split][spares]") {
  run_hooks h;
  h.options = [](ddp::manager_options& o) { o.active_replicas = 2; };
  check_refused_joiner(h,
                       "replica x runs with active_replicas = 2, healed_replicas_participate = true, heal_over = "
                       "quorum_broadcast, replica r0 with active_replicas = 0");
}

// Members that heal over different communicators would wait for each other's broadcasts.
TEST_CASE("Manager: a replica that heals over other communicators is told so and left out; the others go on",
          "[local][manager][split]") {
  run_hooks h;
  h.options = [](ddp::manager_options& o) { o.heal_over = ddp::heal_transport::source_routes; };
  check_refused_joiner(h,
                       "replica x runs with active_replicas = 0, healed_replicas_participate = true, heal_over = "
                       "source_routes, replica r0 with active_replicas = 0, healed_replicas_participate = true, "
                       "heal_over = quorum_broadcast");
}

TEST_CASE("enroll_any: a group whose first arrival left still closes, without it", "[local][manager][store]") {
  namespace st = ddp::stores;
  st::memory_store s;
  // The first arrival gives up before anyone else comes (a replica that timed out).
  CHECK_THROWS_AS(st::enroll_any(s, "early", {.min_members = 2, .settle = 0ms, .timeout = 20ms}), ddp::timeout_error);
  std::vector<st::membership> got(2);
  std::thread a([&] { got[0] = st::enroll_any(s, "b", {.min_members = 2, .settle = 0ms, .timeout = 5s}); });
  std::thread b([&] { got[1] = st::enroll_any(s, "c", {.min_members = 2, .settle = 0ms, .timeout = 5s}); });
  a.join();
  b.join();
  CHECK(got[0].members == std::vector<std::string>{"b", "c"});
  CHECK(got[1].members == got[0].members);
  CHECK(got[0].rank == 0);
  CHECK(got[1].rank == 1);
}

TEST_CASE("enroll_any: concurrent arrivals agree on one membership; the admissible rule holds",
          "[local][manager][store]") {
  namespace st = ddp::stores;
  for (int run = 0; run < 20; ++run) {
    INFO("run " << run);
    st::memory_store s;
    std::mutex mu;
    std::set<std::vector<std::string>> lists;
    int left_out = 0;
    std::vector<std::thread> ts;
    for (int r = 0; r < 6; ++r) {
      ts.emplace_back([&, r] {
        st::group_options g{.min_members = 2, .settle = 0ms, .timeout = 5s};
        // As the Manager's rule: at least two of p0..p2 (the "previous quorum").
        g.admissible = [](const std::vector<std::string>& ids) {
          return std::count_if(ids.begin(), ids.end(), [](const std::string& id) { return id < "p3"; }) >= 2;
        };
        try {
          const auto m = st::enroll_any(s, "p" + std::to_string(r), g);
          std::lock_guard lk(mu);
          lists.insert(m.members);
        } catch (const ddp::communication_error&) {  // closed without it
          std::lock_guard lk(mu);
          ++left_out;
        }
      });
    }
    for (auto& t : ts) t.join();
    REQUIRE(lists.size() == 1);
    const auto& l = *lists.begin();
    CHECK(static_cast<int>(l.size()) + left_out == 6);
    CHECK(std::count_if(l.begin(), l.end(), [](const std::string& id) { return id < "p3"; }) >= 2);
  }
}

TEST_CASE("Manager: the only up-to-date replica reporting a step no quorum reached is named",
          "[local][manager][heal]") {
  job j;
  j.base.min_replicas = 1;
  j.base.quorum_timeout = 700ms;
  // x trains alone, then claims step 10^9 when y joins: nobody can contradict it but the store's
  // step limit. y must not take that step (nor x's state): it waits for a holder and gives up.
  std::atomic<bool> lie{false};
  std::thread x([&] {
    job::hooks h;
    h.comm = [&](const char* op, tensor_view in, int) {
      if (std::strcmp(op, "allgather") == 0 && lie.load() && in.type == ddp::dtype::i64 && in.count >= 4) {
        static_cast<std::int64_t*>(in.data)[0] = 1'000'000'000;
      }
    };
    j.run(
        "x", [](std::int64_t, const std::vector<std::string>&) { return false; }, h);
  });
  j.wait_for_step(3);
  lie = true;
  std::thread y([&] { j.run("y", [](std::int64_t s, const std::vector<std::string>&) { return s >= 10; }); });
  x.join();
  y.join();
  INFO(j.story());
  j.check_invariants();
  CHECK(j.max_step.load() < 100000);
  REQUIRE(j.errors.count("x") == 1);
  CHECK(j.errors["x"].find("replica x reported step 1000000000, ahead of every committed quorum") != std::string::npos);
  std::lock_guard lk(j.mu);
  for (const auto& [step, entries] : j.commits) {
    for (const auto& e : entries) CHECK(e.id == "x");
  }
}
