// fault_tolerant_diloco under the Manager's fault injection (the harness of tests/common/replicas.hpp):
// replicas as threads over the local backend and an in-memory store, crashing before, during and
// after an outer step, two in one outer step, replacements joining. Every live replica must end
// with the same bits, equal to a serial replay of the committed outer steps from the samples each
// contributor trained on, and (without reuse) every sample of every committed step was trained
// exactly once.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string_view>
#include <thread>

#include <catch2/catch.hpp>
#include <ddp/data/global_batch_sampler.hpp>
#include <ddp/local.hpp>
#include <ddp/local_steps.hpp>
#include <ddp/manager.hpp>
#include <ddp/partition.hpp>
#include <ddp/stores/memory_store.hpp>
#include <ddp/timeline.hpp>

#include "../common/replicas.hpp"

using namespace std::chrono_literals;

namespace {

constexpr std::size_t dim = 5;
constexpr int inner_steps = 4;                      // H
constexpr std::uint64_t dataset = 240, batch = 24;  // samples per outer step, over every replica
constexpr double inner_lr = 0.3;
const ddp::outer_sgd outer_opt{.lr = 0.7, .momentum = 0.9, .nesterov = true};

using replica_test::crash;
using replica_test::fault;

// Where a replica dies: in its inner steps, inside the exchange of outer gradients (its
// communicator aborts mid-collective), between the exchange and the commit vote, or right after
// an outer step committed.
enum class death { none, inner_steps, exchange, vote, after_commit };

std::vector<double> initial_params(const std::string& id) { return replica_test::initial_params(id, dim); }

// Sample j pulls the parameters towards its target: the gradient of 0.5 |p - t(j)|^2.
double target(std::uint64_t sample, std::size_t k) {
  return std::sin(0.37 * static_cast<double>(sample) + static_cast<double>(k));
}

// H inner SGD steps on a share of micro-batches (one sample each), split evenly over the steps.
void inner_train(std::vector<double>& p, const ddp::data::global_batch_sampler& sampler, ddp::item_range share) {
  const std::size_t n = share.last - share.first;
  for (int h = 0; h < inner_steps; ++h) {
    const ddp::item_range part = ddp::contiguous_share(n, inner_steps, h);
    if (part.first == part.last) continue;
    std::vector<double> g(dim, 0.0);
    for (std::size_t j = share.first + part.first; j < share.first + part.last; ++j) {
      const std::uint64_t sample = sampler.micro_batch(j).front();
      for (std::size_t k = 0; k < dim; ++k) g[k] += p[k] - target(sample, k);
    }
    const double inv = 1.0 / static_cast<double>(part.last - part.first);
    for (std::size_t k = 0; k < dim; ++k) p[k] -= inner_lr * g[k] * inv;
  }
}

// A replica's part in one committed outer step: its rank in the committing quorum, and the
// micro-batches its outer gradient came from (none if it brought no gradient).
struct contribution {
  int rank = 0, size = 0;
  bool brought = false;
  std::size_t first = 0, last = 0;
  std::int64_t cursor = 0;
};

struct replica_result {
  std::string id;
  bool crashed = false;
  std::string error;
  std::vector<double> params, anchor, momentum;
  std::int64_t step = 0, cursor = 0;
  int inner_steps_taken = 0;
  int exchanges = 0;  // "outer exchange" spans on its timeline
  std::map<std::int64_t, contribution> commits;
  std::vector<std::string> events;
  std::map<std::uint64_t, std::vector<std::string>> quorums;
};

// Forwards to a local communicator; when armed, aborts it inside the next exchange of outer
// gradients (an f64 allreduce) or before the next commit vote (an i64 max allreduce), and says so.
struct dying_communicator {
  ddp::local::communicator inner;
  std::shared_ptr<std::atomic<int>> armed;  // a death, as int
  std::shared_ptr<std::atomic<bool>> died;
  [[nodiscard]] int rank() const { return inner.rank(); }
  [[nodiscard]] int size() const { return inner.size(); }
  ddp::work allreduce(std::span<const ddp::tensor_view> ts, ddp::reduce_op op) {
    const auto d = static_cast<death>(armed->load());
    if (d == death::vote && op == ddp::reduce_op::max) die();
    ddp::work w = inner.allreduce(ts, op);
    if (d == death::exchange && !ts.empty() && ts[0].type == ddp::dtype::f64) {
      std::this_thread::sleep_for(2ms);  // let the peers enter the collective
      die();
    }
    return w;  // fails once aborted: the Manager captures it, and its event handler throws `crash`
  }
  ddp::work broadcast(std::span<const ddp::tensor_view> ts, int root) { return inner.broadcast(ts, root); }
  ddp::work allgather(ddp::tensor_view in, ddp::tensor_view out) { return inner.allgather(in, out); }
  ddp::work reduce_scatter(ddp::tensor_view in, ddp::tensor_view out, ddp::reduce_op op) {
    return inner.reduce_scatter(in, out, op);
  }
  ddp::work barrier() { return inner.barrier(); }
  void abort() noexcept { inner.abort(); }

 private:
  void die() noexcept {
    armed->store(0);
    died->store(true);
    inner.abort();
  }
};

struct cluster {
  ddp::stores::memory_store store;
  ddp::local::fabric fabric;
  bool reuse = false;
  std::map<std::string, death> deaths;  // replica id -> how it dies, at step `death_step`
  std::int64_t death_step = 2;
  explicit cluster(std::chrono::milliseconds timeout) : fabric(ddp::local::options{.timeout = timeout, .faults = {}}) {}

  void run_replica(const std::string& id, fault, std::int64_t steps, int want_members, replica_result& out,
                   std::chrono::milliseconds) {
    out.id = id;
    const death dies = deaths.count(id) ? deaths.at(id) : death::none;
    std::vector<double> p = initial_params(id);
    ddp::training_state state;
    ddp::data::global_batch_sampler sampler(
        {.dataset_size = dataset, .global_batch = batch, .micro_batch = 1, .seed = 5}, state);
    auto opts = replica_test::scenario_options();
    opts.replica_id = id;
    auto armed = std::make_shared<std::atomic<int>>(0);
    auto died = std::make_shared<std::atomic<bool>>(false);
    ddp::Manager m(
        store,
        [&](const ddp::quorum_info& q) {
          return ddp::any_communicator(
              dying_communicator{fabric.connect("g" + std::to_string(q.generation), q.rank, q.size), armed, died});
        },
        state, opts);
    m.on_event([&](const ddp::manager_event& e) {
      out.events.push_back(e.text);
      if (e.what == ddp::manager_event::kind::quorum) out.quorums[m.generation()] = m.members();
      if (died->load()) throw crash{};  // the error of its own abort: the replica is gone
    });
    ddp::fault_tolerant_diloco<> outer(m, state, {ddp::view(p)},
                                       {.sync_every = inner_steps, .outer = outer_opt, .reuse_outer_gradients = reuse});
    ddp::timeline::recorder rec;
    outer.set_recorder(&rec);
    try {
      while (m.step() < steps || static_cast<int>(m.members().size()) < want_members) {
        if (m.step() > steps + 2000) throw std::runtime_error("the quorum never grew back to its expected size");
        const int n = outer.begin();
        const std::int64_t s = m.step();
        const bool hit = dies != death::none && s == death_step;
        std::this_thread::sleep_for(1ms);  // "compute": lets join requests arrive
        const ddp::item_range share = n > 0 ? sampler.share(m) : ddp::item_range{0, 0};
        if (n > 0) {
          if (hit && dies == death::inner_steps) throw crash{};
          inner_train(p, sampler, share);
          out.inner_steps_taken += n;
        }
        if (hit && (dies == death::exchange || dies == death::vote)) armed->store(static_cast<int>(dies));
        const bool committed = outer.end();
        if (committed) {
          out.commits[s] = {m.rank(),    m.size(),   outer.contributes(),
                            share.first, share.last, static_cast<std::int64_t>(sampler.cursor())};
          sampler.commit();
          if (hit && dies == death::after_commit) throw crash{};
        }
      }
    } catch (const crash&) {
      out.crashed = true;
      m.abort();
    } catch (const std::exception& e) {
      out.error = e.what();
    }
    out.params = p;
    const auto st = outer.state();
    out.anchor.assign(static_cast<const double*>(st[0].data), static_cast<const double*>(st[0].data) + dim);
    out.momentum.assign(static_cast<const double*>(st[1].data), static_cast<const double*>(st[1].data) + dim);
    out.step = m.step();
    out.cursor = sampler.cursor();
    for (const auto& e : rec.events()) out.exchanges += std::string_view(e.name) == "outer exchange" ? 1 : 0;
  }
};

// The committed outer steps replayed serially: each contributor's H inner steps from the anchor
// on its micro-batches, the outer gradients averaged by ddp's rule (each times 1/n, summed in
// rank order, as the local backend reduces), one outer Nesterov step.
std::vector<double> replay(const std::map<std::int64_t, std::map<int, contribution>>& steps,
                           const std::string& first_rank0) {
  std::vector<double> anchor = initial_params(first_rank0), mom(dim, 0.0);
  ddp::training_state scratch;
  ddp::data::global_batch_sampler sampler({.dataset_size = dataset, .global_batch = batch, .micro_batch = 1, .seed = 5},
                                          scratch);
  for (const auto& [s, by_rank] : steps) {
    int brought = 0;
    for (const auto& [r, c] : by_rank) brought += c.brought ? 1 : 0;
    const double factor = 1.0 / static_cast<double>(std::max(brought, 1));
    std::vector<double> avg(dim, 0.0);
    bool first = true;
    for (const auto& [r, c] : by_rank) {
      std::vector<double> g(dim, 0.0);
      if (c.brought) {
        std::vector<double> p = anchor;
        inner_train(p, sampler, {c.first, c.last});
        for (std::size_t k = 0; k < dim; ++k) g[k] = anchor[k] - p[k];
      }
      for (std::size_t k = 0; k < dim; ++k) avg[k] = first ? g[k] * factor : avg[k] + g[k] * factor;
      first = false;
    }
    for (std::size_t k = 0; k < dim; ++k) {
      mom[k] = outer_opt.momentum * mom[k] + avg[k];
      anchor[k] -= outer_opt.lr * (avg[k] + outer_opt.momentum * mom[k]);
    }
    sampler.commit();
  }
  return anchor;
}

struct scenario {
  int replicas = 3;
  std::int64_t steps = 6;
  std::map<std::string, death> deaths{};
  std::vector<std::string> joiners{};
  bool reuse = false;
};

struct cluster_with_plan : cluster {
  static inline const scenario* plan = nullptr;  // set by run(); read by the constructor
  explicit cluster_with_plan(std::chrono::milliseconds t) : cluster(t) {
    deaths = plan->deaths;
    reuse = plan->reuse;
  }
};

std::vector<replica_result> run(const scenario& sc) {
  cluster_with_plan::plan = &sc;
  std::map<int, fault> faults;  // the harness counts crashing replicas from these
  for (const auto& [id, d] : sc.deaths)
    faults[std::stoi(id.substr(1))] = {replica_test::fault_point::before_collective, 0};
  return replica_test::run_scenario<cluster_with_plan, replica_result>(sc.replicas, sc.steps, faults, sc.joiners, 0ms,
                                                                       1000ms);
}

// Every check a scenario must pass; returns the contributions by step for further checks.
std::map<std::int64_t, std::map<int, contribution>> check(const std::vector<replica_result>& results,
                                                          const scenario& sc, std::size_t expected_live) {
  INFO(replica_test::history(results));
  std::vector<const replica_result*> live;
  for (const auto& r : results) {
    INFO(r.id << ": " << r.error);
    REQUIRE(r.error.empty());
    if (!r.crashed) live.push_back(&r);
  }
  REQUIRE(live.size() == expected_live);
  // One set of contributions per committed step: no rank claimed twice, the same quorum size.
  std::map<std::int64_t, std::map<int, contribution>> steps;
  for (const auto& r : results) {
    for (const auto& [s, c] : r.commits) {
      auto& by_rank = steps[s];
      INFO("step " << s << " rank " << c.rank << " of " << c.size << " (" << r.id << ")");
      CHECK(by_rank.count(c.rank) == 0);
      by_rank[c.rank] = c;
      CHECK(c.cursor == s * static_cast<std::int64_t>(batch));
    }
  }
  const std::int64_t total = live.front()->step;
  REQUIRE(total >= sc.steps);
  REQUIRE(static_cast<std::int64_t>(steps.size()) == total);
  for (const auto& [s, by_rank] : steps) {
    INFO("step " << s);
    const int size = by_rank.begin()->second.size;
    for (const auto& [r, c] : by_rank) CHECK(c.size == size);
    // Every member of the committing quorum recorded it (a replica dying after a commit records it first).
    CHECK(static_cast<int>(by_rank.size()) == size);
    if (!sc.reuse) {
      // Exactly once: the contributors' micro-batches tile [0, M) without overlap.
      std::vector<int> covered(batch, 0);
      for (const auto& [r, c] : by_rank) {
        CHECK(c.brought);
        for (std::size_t j = c.first; j < c.last; ++j) ++covered[j];
      }
      CHECK(std::count(covered.begin(), covered.end(), 1) == static_cast<long>(batch));
    }
  }
  std::map<std::uint64_t, std::vector<std::string>> quorums;
  for (const auto& r : results) quorums.insert(r.quorums.begin(), r.quorums.end());
  const auto want = replay(steps, quorums.begin()->second.front());
  for (const auto* r : live) {
    INFO("replica " << r->id);
    CHECK(r->step == total);
    CHECK(r->cursor == total * static_cast<std::int64_t>(batch));
    CHECK(r->params == live.front()->params);
    CHECK(r->momentum == live.front()->momentum);
    CHECK(r->anchor == r->params);
    CHECK(r->params == want);
  }
  return steps;
}

}  // namespace

TEST_CASE("fault_tolerant_diloco: fault-free over 3 replicas equals the serial replay, samples exactly once",
          "[local][diloco][manager]") {
  const scenario sc{.replicas = 3, .steps = 5};
  const auto results = run(sc);
  const auto steps = check(results, sc, 3);
  for (const auto& r : results) {
    CHECK(r.inner_steps_taken == inner_steps * 5);
    CHECK(r.exchanges == 5);  // one exchange per outer step, on the timeline
  }
}

TEST_CASE("fault_tolerant_diloco: a replica dies before, during or after an outer step; a replacement heals",
          "[local][diloco][manager][fault]") {
  const death where = GENERATE(death::inner_steps, death::exchange, death::vote, death::after_commit);
  const int victim = GENERATE(0, 2);
  INFO("r" << victim << " dies at point " << static_cast<int>(where));
  const scenario sc{.replicas = 3, .steps = 6, .deaths = {{"r" + std::to_string(victim), where}}, .joiners = {"r9"}};
  const auto results = run(sc);
  check(results, sc, 3);
  bool healed = false;
  for (const auto& e : results.back().events) healed = healed || e.find("healed to step") != std::string::npos;
  CHECK(healed);
}

TEST_CASE("fault_tolerant_diloco: two replicas die in one outer step", "[local][diloco][manager][fault]") {
  const death where = GENERATE(death::inner_steps, death::exchange, death::vote);
  const scenario sc{.replicas = 4, .steps = 5, .deaths = {{"r1", where}, {"r3", where}}};
  check(run(sc), sc, 2);
}

TEST_CASE("fault_tolerant_diloco: with reuse, a death costs only the dead replica's inner steps",
          "[local][diloco][manager][fault]") {
  const death where = GENERATE(death::inner_steps, death::exchange);
  const scenario sc{.replicas = 3, .steps = 5, .deaths = {{"r1", where}}, .reuse = true};
  const auto results = run(sc);
  const auto steps = check(results, sc, 2);
  // The survivors took H inner steps per outer step and no more: none was redone.
  for (const auto& r : results) {
    if (!r.crashed) CHECK(r.inner_steps_taken == inner_steps * static_cast<int>(r.step));
  }
  // The outer step the victim died in committed with the survivors' two gradients; the others with three.
  for (const auto& [s, by_rank] : steps) {
    int brought = 0;
    for (const auto& [r, c] : by_rank) brought += c.brought ? 1 : 0;
    CHECK(brought == (s < 2 ? 3 : 2));
  }
}
