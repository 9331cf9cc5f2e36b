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
#include <ddp/data/micro_batch_ledger.hpp>
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
  std::vector<std::size_t> micro;  // the micro-batches whose gradients it contributed
  std::size_t reused = 0;          // micro-batches reused from a failed attempt
  int participants = 0;            // the Manager's count for the step
  int participant_rank = 0;        // -1: a hot spare
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
  int late_heals = 0;  // times it received state after the job's first step committed
};

// A local communicator whose owner "dies" right after issuing an allgather when told to: the
// collective is in flight on the peers when the communicator goes away.
struct mortal_comm {
  ddp::local::communicator inner;
  std::shared_ptr<std::atomic<bool>> die;
  int rank() const { return inner.rank(); }
  int size() const { return inner.size(); }
  ddp::work allreduce(std::span<const ddp::tensor_view> t, ddp::reduce_op op) {
    ddp::work w = inner.allreduce(t, op);
    if (die->exchange(false)) inner.abort();
    return w;
  }
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
  // false: a ReproducibleReducer (reuse_after_failure); true: plain sums through a
  // micro_batch_ledger, averaged by the Manager's allreduce.
  bool ledger = false;
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
      if (e.what == ddp::manager_event::kind::healed && e.step > 0) ++out.late_heals;
    });
    ddp::ReproducibleReducer red(m, sampler.micro_batches(), {.check_layout = false, .reuse_after_failure = true});
    red.add(g);
    red.build();
    m.set_layout_fingerprint(red.layout_fingerprint());
    ddp::data::micro_batch_ledger kept(std::vector{ddp::view(g)}, sampler.micro_batches());
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
        std::vector<std::size_t> micro;  // what this replica contributes if the step commits
        std::size_t reused = 0;
        if (ledger) {
          for (std::size_t j : kept.begin(m, sampler.cursor())) {  // what no live member holds
            micro_gradient(sampler.micro_batch(j), p, g);
            kept.accumulate(j);
          }
          reused = kept.reused();
          micro = kept.held();
        } else {
          red.begin(sampler.cursor());  // same key = same global batch at the same parameters
          if (red.range() != share) throw std::runtime_error("the reducer and the sampler split differently");
          for (std::size_t j : red.pending()) {
            micro_gradient(sampler.micro_batch(j), p, g);
            red.accumulate(j);
          }
          for (std::size_t j = share.first; j < share.last; ++j) micro.push_back(j);
        }
        if (hit && f.where == fault_point::stall) std::this_thread::sleep_for(stall);
        if (hit && f.where == fault_point::during_collective) die->store(true);
        if (ledger) {
          kept.reduce(m).wait();  // through the Manager: errors are captured, not thrown
        } else {
          red.finalize();  // allgathers through the Manager: errors are captured, not thrown
          reused = red.last_step().reused;
        }
        if (hit && f.where == fault_point::during_collective) throw crash{};
        if (hit && f.where == fault_point::after_collective) throw crash{};
        const std::uint64_t cursor = sampler.cursor();
        if (m.should_commit()) {
          for (std::size_t k = 0; k < dim; ++k) {
            mom[k] = beta * mom[k] + g[k];
            p[k] -= lr * mom[k];
          }
          sampler.commit();
          out.commits.push_back(
              {id, s, cursor, m.rank(), m.members(), micro, reused, m.participants(), m.participant_rank()});
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
// must hold, bit for bit (with `ledger`, the gradient is the plain mean of the micro-batch
// gradients, whose rounding depends on the split: up to rounding).
std::vector<double> replay(std::int64_t steps, const std::string& first_rank0, bool ledger) {
  std::vector<double> p = initial_params(first_rank0), mom(dim, 0.0), g(dim);
  std::int64_t cursor = 0;
  ddp::data::global_batch_sampler sampler(sampling(), cursor);
  ddp::local::world w(1);
  auto c = w.rank(0);
  ddp::ReproducibleReducer red(c, sampler.micro_batches());
  red.add(g);
  for (std::int64_t s = 0; s < steps; ++s) {
    if (ledger) {
      std::vector<double> sum(dim, 0.0);
      for (std::size_t j = 0; j < sampler.micro_batches(); ++j) {
        micro_gradient(sampler.micro_batch(j), p, g);
        for (std::size_t k = 0; k < dim; ++k) sum[k] += g[k];
      }
      for (std::size_t k = 0; k < dim; ++k) g[k] = sum[k] / static_cast<double>(sampler.micro_batches());
    } else {
      red.begin();
      for (std::size_t j : red.pending()) {
        micro_gradient(sampler.micro_batch(j), p, g);
        red.accumulate(j);
      }
      red.finalize();
    }
    for (std::size_t k = 0; k < dim; ++k) {
      mom[k] = beta * mom[k] + g[k];
      p[k] -= lr * mom[k];
    }
    sampler.commit();
  }
  return p;
}

// How the replicas reduce, and how many of them contribute.
struct mode {
  bool ledger = false;  // cluster::ledger
  int active = 0;       // manager_options::active_replicas (0: every member; the others are hot spares)
};

struct outcome {
  std::vector<replica_result> results;
  mode how;
};

outcome run_scenario(int replicas, std::int64_t steps, const std::map<int, fault>& faults,
                     const std::vector<std::string>& joiners, std::chrono::milliseconds stall = 0ms,
                     std::chrono::milliseconds collective_timeout = 1000ms, mode how = {}) {
  return {
      replica_test::run_scenario<cluster, replica_result>(replicas, steps, faults, joiners, stall, collective_timeout,
                                                          [how](cluster& c) {
                                                            c.ledger = how.ledger;
                                                            c.base.active_replicas = how.active;
                                                          }),
      how};
}

// Totals over the runs of one scenario, printed at the end.
struct tally {
  int runs = 0;
  std::int64_t committed_steps = 0, samples_committed = 0, epochs_completed = 0, failed_attempts = 0,
               samples_given_back = 0, reused_micro_batches = 0;
  std::set<std::size_t> sizes;
  std::set<int> participants;   // per committed step
  double max_replay_error = 0;  // ledger mode: largest |parameter - replay's|
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
    std::vector<int> contributions(reference.micro_batches(), 0);  // by micro-batch
    std::set<int> ranks, slots;
    for (const auto* c : recs) {
      CHECK(c->members == members);
      CHECK(c->cursor == static_cast<std::uint64_t>(s) * global_batch);
      CHECK(members[static_cast<std::size_t>(c->rank)] == c->replica);
      ranks.insert(c->rank);
      for (std::size_t j : c->micro) ++contributions.at(j);
      t.reused_micro_batches += static_cast<std::int64_t>(c->reused);
      // At most `active` members contribute (all of them without spares); a spare contributes nothing.
      const int want = o.how.active > 0 ? std::min<int>(o.how.active, static_cast<int>(members.size()))
                                        : static_cast<int>(members.size());
      CHECK(c->participants == want);
      if (c->participant_rank < 0) CHECK(c->micro.empty());
      if (c->participant_rank >= 0) slots.insert(c->participant_rank);
      t.participants.insert(c->participants);
    }
    REQUIRE(ranks.size() == members.size());
    CHECK(static_cast<int>(slots.size()) == recs.front()->participants);
    // Every micro-batch of the step contributed once: the step trained on its global batch, B samples.
    for (std::size_t j = 0; j < contributions.size(); ++j) {
      INFO("micro-batch " << j);
      CHECK(contributions[j] == 1);
    }
    dummy_cursor = s * static_cast<std::int64_t>(global_batch);
    std::vector<std::uint64_t> batch;
    for (std::size_t j = 0; j < contributions.size(); ++j) {
      if (contributions[j] == 0) continue;
      const auto mb = reference.micro_batch(j);
      batch.insert(batch.end(), mb.begin(), mb.end());
    }
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
  // Bit-identical to each other, and to the fault-free one-replica replay (ledger mode: up to
  // the rounding of a sum whose order follows the split).
  std::map<std::uint64_t, std::vector<std::string>> quorums;
  for (const auto& r : o.results) quorums.insert(r.quorums.begin(), r.quorums.end());
  REQUIRE_FALSE(quorums.empty());
  const auto want = replay(total, quorums.begin()->second.front(), o.how.ledger);
  for (const auto* r : live) {
    INFO("replica " << r->id);
    CHECK(r->step == total);
    CHECK(r->params == live.front()->params);
    CHECK(r->momentum == live.front()->momentum);
    if (o.how.ledger) {
      for (std::size_t k = 0; k < dim; ++k) {
        CHECK(std::abs(r->params[k] - want[k]) < 1e-12);
        t.max_replay_error = std::max(t.max_replay_error, std::abs(r->params[k] - want[k]));
      }
    } else {
      CHECK(r->params == want);
    }
  }
  ++t.runs;
  t.committed_steps += total;
  t.samples_committed += static_cast<std::int64_t>(stream.size());
  t.epochs_completed += static_cast<std::int64_t>(epochs);
}

void report(const char* scenario, const tally& t) {
  std::string sizes, participants;
  for (auto s : t.sizes) sizes += (sizes.empty() ? "" : ",") + std::to_string(s);
  for (auto s : t.participants) participants += (participants.empty() ? "" : ",") + std::to_string(s);
  std::printf(
      "exactly-once | %-44s | runs %2d | committed steps %4lld | samples %5lld (B=%llu constant) | complete epochs "
      "%3lld, "
      "every sample once | quorum sizes {%s} | participants {%s} | failed step attempts %3lld, samples given back "
      "%4lld | micro-batches reused %3lld | max |p - replay| %.1e\n",
      scenario, t.runs, static_cast<long long>(t.committed_steps), static_cast<long long>(t.samples_committed),
      static_cast<unsigned long long>(global_batch), static_cast<long long>(t.epochs_completed), sizes.c_str(),
      participants.c_str(), static_cast<long long>(t.failed_attempts), static_cast<long long>(t.samples_given_back),
      static_cast<long long>(t.reused_micro_batches), t.max_replay_error);
  std::fflush(stdout);
}

constexpr int runs = 20;
constexpr std::int64_t epoch_steps = static_cast<std::int64_t>(dataset / global_batch);

tally crash_with_replacement(fault_point where, const char* name, unsigned seed, mode how = {}, int run_count = runs) {
  std::mt19937 rng(seed);
  tally t;
  for (int run = 0; run < run_count; ++run) {
    const int victim = static_cast<int>(rng() % 3);
    const std::int64_t at = 1 + static_cast<std::int64_t>(rng() % 5);
    INFO("run " << run << ": replica r" << victim << " crashes at step " << at);
    const auto o = run_scenario(3, epoch_steps, {{victim, {where, at}}}, {"r9"}, 0ms, 1000ms, how);
    check_exactly_once(o, epoch_steps, 3, t);
  }
  report(name, t);
  return t;
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

// The stall is twice the collective timeout: the peers' polled collectives time out (issue #43: a
// tested work enforces its own timeout), the step fails, they re-form without the stalled replica,
// and it rejoins and heals. Every sample is still trained exactly once.
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
  // A Manager-like group splits over its participants; a member that contributes zeros (a hot
  // spare, participant rank -1) gets nothing.
  struct group {
    int slot = 0;
    int rank() const { return 2; }
    int size() const { return 3; }
    int participants() const { return 2; }
    int participant_rank() const { return slot; }
  };
  CHECK(s.share(group{0}) == s.share(0, 2));
  CHECK(s.share(group{1}) == s.share(1, 2));
  CHECK(s.share(group{-1}).empty());
}

// Reuse without the reproducible reducer (data::micro_batch_ledger): a retry computes only the
// micro-batches no live replica holds; the sums are averaged over the M micro-batches.
TEST_CASE("exactly-once: reused gradients through a micro_batch_ledger when a replica crashes",
          "[data][manager][fault][reuse]") {
  const mode ledger{.ledger = true};
  const tally during =
      crash_with_replacement(fault_point::during_collective, "ledger: crash during the collective", 606, ledger, 10);
  CHECK(during.reused_micro_batches > 0);  // the survivors kept theirs: only the dead one's were recomputed
  const tally before =
      crash_with_replacement(fault_point::before_collective, "ledger: crash before the collective", 707, ledger, 10);
  CHECK(before.reused_micro_batches > 0);
}

// Hot spares (manager_options::active_replicas): 3 replicas, 2 contribute, the third applies
// every step with zeros. An active replica crashes inside its collective: the spare takes its
// place in the next quorum without receiving any state, every committed step has 2 participants
// (so the global batch is split over 2 as before), and the replacement that joins becomes the
// new spare.
TEST_CASE("exactly-once: a hot spare replaces a crashed replica without healing", "[data][manager][fault][spares]") {
  std::mt19937 rng(808);
  tally t;
  for (int run = 0; run < 10; ++run) {
    const int victim = static_cast<int>(rng() % 2);  // r0, r1 contribute at the start; r2 is the spare
    const std::int64_t at = 1 + static_cast<std::int64_t>(rng() % 5);
    const auto where = static_cast<fault_point>(1 + rng() % 3);
    INFO("run " << run << ": replica r" << victim << " crashes at step " << at << ", point "
                << static_cast<int>(where));
    const auto o =
        run_scenario(3, epoch_steps, {{victim, {where, at}}}, {"r9"}, 0ms, 1000ms, {.ledger = true, .active = 2});
    check_exactly_once(o, epoch_steps, 3, t);
    for (const auto& r : o.results) {
      INFO(r.id);
      if (r.id == "r2") {
        CHECK(r.late_heals == 0);  // it took over warm
        // It contributed after the crash (it replaced the dead replica) and not before.
        bool before = false, after = false;
        for (const auto& c : r.commits) (c.step < at ? before : after) |= c.participant_rank >= 0;
        CHECK_FALSE(before);
        CHECK(after);
      }
      if (r.id == "r9") {  // the replacement healed and became the spare
        CHECK(r.late_heals == 1);
        for (const auto& c : r.commits) CHECK(c.participant_rank == -1);
      }
    }
  }
  CHECK(t.participants == std::set<int>{2});
  report("hot spare (3 replicas, 2 active) + replacement", t);
  // Every replica must use the same rules: one with other rules is refused by name.
}

// The ledger over 2 thread ranks without faults: the split, the reduction, a new key, duplicates
// dropped, and its errors. (What the threads see is recorded and checked afterwards: Catch's
// assertions are not thread-safe.)
TEST_CASE("micro_batch_ledger: split, mean over M, new keys, duplicate holders, errors", "[data][unit]") {
  constexpr std::size_t m = 5;
  struct seen {
    std::vector<double> grad = std::vector<double>(3, 0.0);
    std::vector<std::size_t> first, again, fresh, together;
    std::size_t reused_again = 0, reused_fresh = 0, held_alone = 0, held_together = 0;
    std::string unassigned, twice;
  };
  std::vector<seen> out(2);
  const auto grad_of = [](std::size_t j, std::size_t k) { return static_cast<double>(10 * j + k); };
  const auto error_of = [](auto&& f) {
    try {
      f();
    } catch (const ddp::usage_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  ddp::local::run(2, [&](ddp::local::communicator& c) {
    seen& o = out[static_cast<std::size_t>(c.rank())];
    ddp::data::micro_batch_ledger kept(std::vector{ddp::view(o.grad)}, m);
    const auto compute = [&](std::size_t j) {
      for (std::size_t k = 0; k < o.grad.size(); ++k) o.grad[k] = grad_of(j, k);
      kept.accumulate(j);
    };
    for (std::size_t j : kept.begin(c, 7)) compute(j);
    o.first = kept.held();
    kept.reduce(c).wait();
    std::vector<double> reduced = o.grad;
    o.again = kept.begin(c, 7);  // same key: everything is held
    o.reused_again = kept.reused();
    o.fresh = kept.begin(c, 8);  // a new key drops what was kept
    o.reused_fresh = kept.reused();
    o.unassigned = error_of([&] { kept.accumulate((o.fresh.back() + 1) % m); });
    for (std::size_t j : o.fresh) compute(j);
    o.twice = error_of([&] { kept.accumulate(o.fresh.front()); });
    o.grad = reduced;
    // Two holders of every micro-batch: each computed all 5 alone first.
    std::vector<double> g(3, 1.0);
    ddp::data::micro_batch_ledger dup(std::vector{ddp::view(g)}, m);
    ddp::local::world solo(1);
    auto alone = solo.rank(0);
    for (std::size_t j : dup.begin(alone, 9)) dup.accumulate(j);
    o.held_alone = dup.held().size();
    o.together = dup.begin(c, 9);
    o.held_together = dup.held().size();
  });
  CHECK(out[0].first == std::vector<std::size_t>{0, 1, 2});
  CHECK(out[1].first == std::vector<std::size_t>{3, 4});
  for (std::size_t k = 0; k < 3; ++k) {
    double mean = 0;
    for (std::size_t j = 0; j < m; ++j) mean += grad_of(j, k);
    mean /= m;
    CHECK(out[0].grad[k] == out[1].grad[k]);
    CHECK(std::abs(out[0].grad[k] - mean) < 1e-12);
  }
  for (const seen& o : out) {
    CHECK(o.again.empty());
    CHECK(o.reused_again == o.first.size());
    CHECK(o.fresh == o.first);
    CHECK(o.reused_fresh == 0);
    CHECK_THAT(o.unassigned, Catch::Contains("not one begin() assigned"));
    CHECK_THAT(o.twice, Catch::Contains("added already"));
    CHECK(o.held_alone == m);
    CHECK(o.held_together == 0);  // dropped: the step starts over
  }
  CHECK(out[0].together == std::vector<std::size_t>{0, 1, 2});
  CHECK(out[1].together == std::vector<std::size_t>{3, 4});
  std::vector<std::int64_t> ints(4);
  CHECK_THROWS_WITH(ddp::data::micro_batch_ledger(std::vector{ddp::view(ints)}, 2), Catch::Contains("f32 or f64"));
  std::vector<float> f(4);
  CHECK_THROWS_WITH(ddp::data::micro_batch_ledger(std::vector{ddp::view(f)}, 0), Catch::Contains("micro_batches"));
}
