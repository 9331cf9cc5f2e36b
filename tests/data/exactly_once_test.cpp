// Exactly-once data under membership change: replicas (threads) train under a fault-tolerance
// Manager over the local backend, take their share of each step's global batch from a
// global_batch_sampler, and reduce their micro-batch gradients with a ReproducibleReducer that
// reuses what survivors computed for a failed step. Faults are injected as in
// tests/manager/manager_local_test.cpp: a replica crashes before, during or after its gradient
// collective (a replacement joins), two crash in one step, one stalls for twice the collective
// timeout (and, hidden, two join a running job). Every run records the sample ids of every
// committed step and checks:
//   - each committed step's shares are disjoint and together are exactly that step's global
//     batch (B samples, whatever the quorum's size);
//   - over the committed steps, every sample of every completed epoch appears exactly once, and
//     no sample twice in the epoch in progress;
//   - every live replica ends with parameters bit-identical to each other and to a fault-free
//     one-replica replay of the committed steps (the reproducible reduction makes the bits
//     independent of the quorum sizes, which also proves that reused gradients were sound).
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <utility>

#include <catch2/catch.hpp>
#include <ddp/data/global_batch_sampler.hpp>
#include <ddp/local.hpp>
#include <ddp/manager.hpp>
#include <ddp/reproducible.hpp>
#include <ddp/stores/memory_store.hpp>

#include "../common/replicas.hpp"

using namespace std::chrono_literals;

namespace {

constexpr std::size_t dim = 5;
constexpr double lr = 0.1, beta = 0.9;
constexpr std::uint64_t dataset = 96, global_batch = 12, micro = 2;  // 6 micro-batches, 8 steps per epoch

// The per-sample loss 0.5 |p - target(x)|^2: its gradient is p - target(x).
double target(std::uint64_t x, std::size_t k) {
  return std::sin(0.37 * static_cast<double>(x) + static_cast<double>(k));
}

// Micro-batch gradient: the mean over its samples, in sample order.
void micro_gradient(const std::vector<std::uint64_t>& xs, const std::vector<double>& p, std::vector<double>& g) {
  for (std::size_t k = 0; k < dim; ++k) {
    double s = 0;
    for (auto x : xs) s += p[k] - target(x, k);
    g[k] = s / static_cast<double>(xs.size());
  }
}

std::vector<double> initial_params(const std::string& id) { return replica_test::initial_params(id, dim); }

ddp::data::sampler_options sampling() {
  return {.dataset_size = dataset, .global_batch = global_batch, .micro_batch = micro, .seed = 2026, .shuffle = true};
}

using replica_test::crash;
using replica_test::fault;
using replica_test::fault_point;

// What one replica recorded for one committed step.
struct commit_record {
  std::string replica;
  std::int64_t step = 0;
  std::uint64_t cursor = 0;
  int rank = 0;
  std::vector<std::string> members;
  std::vector<std::uint64_t> samples;  // its share, in order
  std::size_t reused = 0;              // micro-batches reused from a failed attempt
};

struct replica_result {
  std::string id;
  bool crashed = false;
  std::string error;
  std::vector<double> params, momentum;
  std::int64_t step = 0;
  std::vector<commit_record> commits;
  std::set<std::pair<std::uint64_t, std::int64_t>> discarded;  // (quorum generation, step) that did not commit
  std::vector<std::string> events;
  std::map<std::uint64_t, std::vector<std::string>> quorums;
};

// A local communicator whose owner "dies" right after issuing an allgather when told to: the
// collective is in flight on the peers when the communicator goes away.
struct mortal_comm {
  ddp::local::communicator inner;
  std::shared_ptr<std::atomic<bool>> die;
  int rank() const { return inner.rank(); }
  int size() const { return inner.size(); }
  ddp::work allreduce(std::span<const ddp::tensor_view> t, ddp::reduce_op op) { return inner.allreduce(t, op); }
  ddp::work broadcast(std::span<const ddp::tensor_view> t, int root) { return inner.broadcast(t, root); }
  ddp::work allgather(ddp::tensor_view a, ddp::tensor_view b) {
    ddp::work w = inner.allgather(a, b);
    if (die->exchange(false)) inner.abort();
    return w;
  }
  ddp::work reduce_scatter(ddp::tensor_view a, ddp::tensor_view b, ddp::reduce_op op) {
    return inner.reduce_scatter(a, b, op);
  }
  ddp::work barrier() { return inner.barrier(); }
  void abort() noexcept { inner.abort(); }
};

struct cluster {
  ddp::stores::memory_store store;
  ddp::local::fabric fabric;
  ddp::manager_options base = replica_test::scenario_options();
  explicit cluster(std::chrono::milliseconds collective_timeout)
      : fabric(ddp::local::options{.timeout = collective_timeout, .faults = {}}) {}

  void run_replica(const std::string& id, fault f, std::int64_t steps, int want_members, replica_result& out,
                   std::chrono::milliseconds stall = 0ms) {
    out.id = id;
    std::vector<double> p = initial_params(id), g(dim, 0.0), mom(dim, 0.0);
    ddp::training_state state;
    state.add(p).add(mom);
    ddp::data::global_batch_sampler sampler(sampling(), state);  // its cursor heals with p and mom
    auto die = std::make_shared<std::atomic<bool>>(false);
    auto opts = base;
    opts.replica_id = id;
    ddp::Manager m(
        store,
        [this, die](const ddp::quorum_info& q) {
          return ddp::any_communicator(
              mortal_comm{fabric.connect("g" + std::to_string(q.generation), q.rank, q.size), die});
        },
        state, opts);
    m.on_event([&](const ddp::manager_event& e) {
      out.events.push_back(e.text);
      if (e.what == ddp::manager_event::kind::quorum) out.quorums[m.generation()] = m.members();
    });
    ddp::ReproducibleReducer red(m, sampler.micro_batches(), {.check_layout = false, .reuse_after_failure = true});
    red.add(g);
    red.build();
    m.set_layout_fingerprint(red.layout_fingerprint());
    bool fired = false;
    try {
      while (m.step() < steps || static_cast<int>(m.members().size()) < want_members) {
        if (m.step() > steps + 2000) throw std::runtime_error("the quorum never grew back to its expected size");
        m.start_quorum();
        std::this_thread::sleep_for(1ms);  // lets join requests arrive between steps
        const std::int64_t s = m.step();
        if (sampler.steps() != static_cast<std::uint64_t>(s)) {
          throw std::runtime_error("sampler cursor " + std::to_string(sampler.cursor()) + " disagrees with step " +
                                   std::to_string(s) + " (healing did not carry it)");
        }
        const bool hit = f.where != fault_point::none && s >= f.at_step && !fired;
        fired = fired || hit;
        if (hit && f.where == fault_point::before_collective) throw crash{};
        const ddp::item_range share = sampler.share(m);
        red.begin(sampler.cursor());  // same key = same global batch at the same parameters
        if (red.range() != share) throw std::runtime_error("the reducer and the sampler split differently");
        for (std::size_t j : red.pending()) {
          micro_gradient(sampler.micro_batch(j), p, g);
          red.accumulate(j);
        }
        if (hit && f.where == fault_point::stall) std::this_thread::sleep_for(stall);
        if (hit && f.where == fault_point::during_collective) die->store(true);
        red.finalize();  // allgathers through the Manager: errors are captured, not thrown
        if (hit && f.where == fault_point::during_collective) throw crash{};
        if (hit && f.where == fault_point::after_collective) throw crash{};
        const std::vector<std::uint64_t> mine = sampler.samples(m.rank(), m.size());
        const std::uint64_t cursor = sampler.cursor();
        if (m.should_commit()) {
          for (std::size_t k = 0; k < dim; ++k) {
            mom[k] = beta * mom[k] + g[k];
            p[k] -= lr * mom[k];
          }
          sampler.commit();
          out.commits.push_back({id, s, cursor, m.rank(), m.members(), mine, red.last_step().reused});
        } else {
          out.discarded.insert({m.generation(), s});
        }
      }
    } catch (const crash&) {
      out.crashed = true;
      m.abort();
    } catch (const std::exception& e) {
      out.error = e.what();
    }
    out.params = p;
    out.momentum = mom;
    out.step = m.step();
  }
};

// A fault-free run with one replica over the committed steps: the parameters every live replica
// must hold, bit for bit.
std::vector<double> replay(std::int64_t steps, const std::string& first_rank0) {
  std::vector<double> p = initial_params(first_rank0), mom(dim, 0.0), g(dim);
  std::int64_t cursor = 0;
  ddp::data::global_batch_sampler sampler(sampling(), cursor);
  ddp::local::world w(1);
  auto c = w.rank(0);
  ddp::ReproducibleReducer red(c, sampler.micro_batches());
  red.add(g);
  for (std::int64_t s = 0; s < steps; ++s) {
    red.begin();
    for (std::size_t j : red.pending()) {
      micro_gradient(sampler.micro_batch(j), p, g);
      red.accumulate(j);
    }
    red.finalize();
    for (std::size_t k = 0; k < dim; ++k) {
      mom[k] = beta * mom[k] + g[k];
      p[k] -= lr * mom[k];
    }
    sampler.commit();
  }
  return p;
}

struct outcome {
  std::vector<replica_result> results;
};

outcome run_scenario(int replicas, std::int64_t steps, const std::map<int, fault>& faults,
                     const std::vector<std::string>& joiners, std::chrono::milliseconds stall = 0ms,
                     std::chrono::milliseconds collective_timeout = 1000ms) {
  return {
      replica_test::run_scenario<cluster, replica_result>(replicas, steps, faults, joiners, stall, collective_timeout)};
}

// Totals over the runs of one scenario, printed at the end.
struct tally {
  int runs = 0;
  std::int64_t committed_steps = 0, samples_committed = 0, epochs_completed = 0, failed_attempts = 0,
               samples_given_back = 0, reused_micro_batches = 0;
  std::set<std::size_t> sizes;
};

// The exactly-once checks (see the file comment); adds the run's counts to `t`.
void check_exactly_once(const outcome& o, std::int64_t steps, std::size_t expected_live, tally& t) {
  INFO(replica_test::history(o.results));
  std::vector<const replica_result*> live;
  for (const auto& r : o.results) {
    INFO(r.id << ": " << r.error);
    REQUIRE(r.error.empty());
    if (!r.crashed) live.push_back(&r);
  }
  REQUIRE(live.size() == expected_live);
  // Every commit record of every replica (crashed ones included: they committed before dying).
  std::map<std::int64_t, std::vector<const commit_record*>> by_step;
  std::set<std::pair<std::uint64_t, std::int64_t>> failed;  // step attempts that did not commit
  for (const auto& r : o.results) {
    for (const auto& c : r.commits) by_step[c.step].push_back(&c);
    failed.insert(r.discarded.begin(), r.discarded.end());
  }
  // A failed attempt gives its whole global batch back: the retry re-splits the same B samples.
  t.failed_attempts += static_cast<std::int64_t>(failed.size());
  t.samples_given_back += static_cast<std::int64_t>(failed.size() * global_batch);
  std::int64_t total = 0;
  for (const auto* r : live) total = std::max(total, r->step);
  REQUIRE(total >= steps);
  REQUIRE(static_cast<std::int64_t>(by_step.size()) == total);  // steps 0..total-1, no gaps

  std::int64_t dummy_cursor = 0;
  ddp::data::global_batch_sampler reference(sampling(), dummy_cursor);
  std::vector<std::uint64_t> stream;  // committed samples, step after step
  for (std::int64_t s = 0; s < total; ++s) {
    INFO("step " << s);
    REQUIRE(by_step.count(s) == 1);
    const auto& recs = by_step[s];
    const auto& members = recs.front()->members;
    // Every member of the step's quorum committed it, each once, with its own rank.
    REQUIRE(recs.size() == members.size());
    std::vector<std::vector<std::uint64_t>> by_rank(members.size());
    std::set<int> ranks;
    for (const auto* c : recs) {
      CHECK(c->members == members);
      CHECK(c->cursor == static_cast<std::uint64_t>(s) * global_batch);
      CHECK(members[static_cast<std::size_t>(c->rank)] == c->replica);
      ranks.insert(c->rank);
      by_rank[static_cast<std::size_t>(c->rank)] = c->samples;
      t.reused_micro_batches += static_cast<std::int64_t>(c->reused);
    }
    REQUIRE(ranks.size() == members.size());
    // The shares, in rank order, are exactly the step's global batch: B samples.
    std::vector<std::uint64_t> batch;
    for (const auto& share : by_rank) batch.insert(batch.end(), share.begin(), share.end());
    dummy_cursor = s * static_cast<std::int64_t>(global_batch);
    CHECK(batch.size() == global_batch);
    CHECK(batch == reference.global_batch());
    stream.insert(stream.end(), batch.begin(), batch.end());
    t.sizes.insert(members.size());
  }
  // Every completed epoch holds every sample exactly once; the epoch in progress none twice.
  const std::size_t epochs = stream.size() / dataset;
  for (std::size_t e = 0; e <= epochs; ++e) {
    std::map<std::uint64_t, int> seen;
    const std::size_t end = std::min(stream.size(), (e + 1) * dataset);
    for (std::size_t i = e * dataset; i < end; ++i) ++seen[stream[i]];
    for (const auto& [id, n] : seen) {
      INFO("epoch " << e << " sample " << id);
      CHECK(n == 1);
      CHECK(id < dataset);
    }
    if (e < epochs) CHECK(seen.size() == dataset);
  }
  // Bit-identical to each other and to the fault-free one-replica replay.
  std::map<std::uint64_t, std::vector<std::string>> quorums;
  for (const auto& r : o.results) quorums.insert(r.quorums.begin(), r.quorums.end());
  REQUIRE_FALSE(quorums.empty());
  const auto want = replay(total, quorums.begin()->second.front());
  for (const auto* r : live) {
    INFO("replica " << r->id);
    CHECK(r->step == total);
    CHECK(r->params == live.front()->params);
    CHECK(r->momentum == live.front()->momentum);
    CHECK(r->params == want);
  }
  ++t.runs;
  t.committed_steps += total;
  t.samples_committed += static_cast<std::int64_t>(stream.size());
  t.epochs_completed += static_cast<std::int64_t>(epochs);
}

void report(const char* scenario, const tally& t) {
  std::string sizes;
  for (auto s : t.sizes) sizes += (sizes.empty() ? "" : ",") + std::to_string(s);
  std::printf(
      "exactly-once | %-44s | runs %2d | committed steps %4lld | samples %5lld (B=%llu constant) | complete epochs "
      "%3lld, "
      "every sample once | quorum sizes {%s} | failed step attempts %3lld, samples given back %4lld | "
      "micro-batches reused %3lld\n",
      scenario, t.runs, static_cast<long long>(t.committed_steps), static_cast<long long>(t.samples_committed),
      static_cast<unsigned long long>(global_batch), static_cast<long long>(t.epochs_completed), sizes.c_str(),
      static_cast<long long>(t.failed_attempts), static_cast<long long>(t.samples_given_back),
      static_cast<long long>(t.reused_micro_batches));
  std::fflush(stdout);
}

constexpr int runs = 20;
constexpr std::int64_t epoch_steps = static_cast<std::int64_t>(dataset / global_batch);

void crash_with_replacement(fault_point where, const char* name, unsigned seed) {
  std::mt19937 rng(seed);
  tally t;
  for (int run = 0; run < runs; ++run) {
    const int victim = static_cast<int>(rng() % 3);
    const std::int64_t at = 1 + static_cast<std::int64_t>(rng() % 5);
    INFO("run " << run << ": replica r" << victim << " crashes at step " << at);
    const auto o = run_scenario(3, epoch_steps, {{victim, {where, at}}}, {"r9"});
    check_exactly_once(o, epoch_steps, 3, t);
  }
  report(name, t);
}

}  // namespace

TEST_CASE("exactly-once: fault-free, 3 replicas, two epochs", "[data][manager]") {
  tally t;
  const auto o = run_scenario(3, 2 * epoch_steps, {}, {});
  check_exactly_once(o, 2 * epoch_steps, 3, t);
  CHECK(t.failed_attempts == 0);
  report("fault-free (1 run, 2 epochs)", t);
}

TEST_CASE("exactly-once: a replica crashes before its gradient collective; a replacement joins",
          "[data][manager][fault]") {
  crash_with_replacement(fault_point::before_collective, "crash before the collective + replacement", 101);
}

TEST_CASE("exactly-once: a replica crashes during its gradient collective; a replacement joins",
          "[data][manager][fault]") {
  crash_with_replacement(fault_point::during_collective, "crash during the collective + replacement", 202);
}

TEST_CASE("exactly-once: a replica crashes after its gradient collective; a replacement joins",
          "[data][manager][fault]") {
  crash_with_replacement(fault_point::after_collective, "crash after the collective + replacement", 303);
}

TEST_CASE("exactly-once: two replicas crash in the same step", "[data][manager][fault]") {
  std::mt19937 rng(404);
  tally t;
  for (int run = 0; run < runs; ++run) {
    const std::int64_t at = 1 + static_cast<std::int64_t>(rng() % 5);
    const auto where = static_cast<fault_point>(1 + rng() % 3);
    INFO("run " << run << " at step " << at << ", point " << static_cast<int>(where));
    const auto o = run_scenario(4, epoch_steps, {{1, {where, at}}, {3, {where, at}}}, {});
    check_exactly_once(o, epoch_steps, 2, t);
  }
  report("two crash in one step (4 -> 2 replicas)", t);
}

// The stall is twice the collective timeout, but the peers wait instead of failing the step: the
// Manager hands polling loops (Bucketer and reducer alike) a 24-hour deadline. The scenario shows
// that a slow replica changes nothing.
TEST_CASE("exactly-once: a replica stalls for twice the collective timeout", "[data][manager][fault]") {
  std::mt19937 rng(505);
  tally t;
  for (int run = 0; run < runs; ++run) {
    const int victim = static_cast<int>(rng() % 3);
    const std::int64_t at = 1 + static_cast<std::int64_t>(rng() % 4);
    INFO("run " << run << ": r" << victim << " stalls at step " << at);
    const auto o = run_scenario(3, epoch_steps, {{victim, {fault_point::stall, at}}}, {}, 400ms, 200ms);
    check_exactly_once(o, epoch_steps, 3, t);
  }
  report("a replica stalls (2x the collective timeout)", t);
}

// Two replicas join a running job of two. This once failed because of the Manager, not the
// sampler: joiners and members re-forming together could split into two quorums that committed the
// same steps with different samples (issue #24; docs/fault-tolerance.md, the quorum rule). The
// exactly-once checks saw a step committed by more replicas than its quorum had ("4 == 2").
TEST_CASE("exactly-once: two replicas join a running job", "[data][manager][manager-split-brain]") {
  tally t;
  for (int run = 0; run < runs; ++run) {
    INFO("run " << run);
    const auto o = run_scenario(2, epoch_steps, {}, {"r7", "r8"});
    check_exactly_once(o, epoch_steps, 4, t);
  }
  report("two join a running job (2 -> 4 replicas)", t);
}

TEST_CASE("global_batch_sampler: permutation, shares, epochs straddled, errors", "[data][unit]") {
  for (std::uint64_t n : {1u, 2u, 3u, 10u, 97u, 1000u}) {
    const ddp::data::permutation p(n, 99);
    std::set<std::uint64_t> img;
    for (std::uint64_t i = 0; i < n; ++i) img.insert(p(i));
    CHECK(img.size() == n);
    CHECK(*img.rbegin() == n - 1);
  }
  CHECK(ddp::data::permutation(1000, 1)(5) != ddp::data::permutation(1000, 2)(5));  // keyed
  std::int64_t cursor = 0;
  ddp::data::global_batch_sampler s(
      {.dataset_size = 10, .global_batch = 4, .micro_batch = 2, .seed = 1, .shuffle = false}, cursor);
  CHECK(s.micro_batches() == 2);
  CHECK(s.global_batch() == std::vector<std::uint64_t>{0, 1, 2, 3});
  CHECK(s.samples(0, 2) == std::vector<std::uint64_t>{0, 1});
  CHECK(s.samples(2, 3).empty());  // more replicas than micro-batches
  s.commit();
  s.commit();
  CHECK(cursor == 8);
  CHECK(s.global_batch() == std::vector<std::uint64_t>{8, 9, 0, 1});  // straddles epochs 0 and 1
  CHECK(s.epoch() == 0);
  CHECK_THROWS_AS(s.micro_batch(2), ddp::usage_error);
  std::int64_t c2 = 0;
  CHECK_THROWS_AS(ddp::data::global_batch_sampler({.dataset_size = 10, .global_batch = 5, .micro_batch = 2}, c2),
                  ddp::usage_error);
  CHECK_THROWS_AS(ddp::data::global_batch_sampler({.dataset_size = 0, .global_batch = 4}, c2), ddp::usage_error);
  // A Manager-like group with a non-participating member is refused.
  struct group {
    int rank() const { return 0; }
    int size() const { return 3; }
    int participants() const { return 2; }
  };
  CHECK_THROWS_WITH(s.share(group{}), Catch::Contains("healed_replicas_participate"));
}
