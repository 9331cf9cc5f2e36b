#pragma once
// JoinContext behaviour, written once against communicator_ref and run over the local backend
// (threads) and MPI (processes). Seed 004's six cases are `train()` with different switches.

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ddp/bucketer.hpp>
#include <ddp/checked.hpp>
#include <ddp/join.hpp>

#include "../common/collective_suite.hpp"
#include "../common/counting_communicator.hpp"

namespace join_cases {

// A small linear model y = w . x + b, trained with plain SGD on synthetic data.
struct linear_model {
  static constexpr std::size_t dim = 4;
  std::vector<double> w = std::vector<double>(dim, 0.0);
  std::vector<double> b = std::vector<double>(1, 0.0);
  std::vector<double> gw = std::vector<double>(dim, 0.0);
  std::vector<double> gb = std::vector<double>(1, 0.0);

  // Batch t of rank r: one sample; the target comes from fixed true parameters.
  static std::vector<double> input(int r, int t) {
    std::vector<double> x(dim);
    for (std::size_t k = 0; k < dim; ++k) x[k] = std::sin(7.0 * r + 3.0 * t + static_cast<double>(k));
    return x;
  }
  static double target(const std::vector<double>& x) { return 2.0 * x[0] - x[1] + 0.5 * x[2] + 3.0 * x[3] + 1.0; }

  // Gradient of 0.5 (w.x + b - y)^2 at the current parameters, for batch t of rank r.
  void compute_gradients(int r, int t) {
    const auto x = input(r, t);
    double pred = b[0];
    for (std::size_t k = 0; k < dim; ++k) pred += w[k] * x[k];
    const double err = pred - target(x);
    for (std::size_t k = 0; k < dim; ++k) gw[k] = err * x[k];
    gb[0] = err;
  }
  void sgd(double lr) {
    for (std::size_t k = 0; k < dim; ++k) w[k] -= lr * gw[k];
    b[0] -= lr * gb[0];
  }
};

constexpr double learning_rate = 0.1;

// Serial reference: every iteration, ranks with data left contribute their gradient; the sum is
// divided by the world size or by the ranks still training.
inline linear_model reference(int size, int base_batches, bool divide_by_initial_world_size) {
  linear_model m;
  const int iterations = base_batches + size - 1;
  for (int t = 0; t < iterations; ++t) {
    std::vector<double> sw(linear_model::dim, 0.0);
    double sb = 0.0;
    int training = 0;
    for (int r = 0; r < size; ++r) {
      if (t >= base_batches + r) continue;
      ++training;
      linear_model probe = m;
      probe.compute_gradients(r, t);
      for (std::size_t k = 0; k < linear_model::dim; ++k) sw[k] += probe.gw[k];
      sb += probe.gb[0];
    }
    const double d = divide_by_initial_world_size ? size : training;
    for (std::size_t k = 0; k < linear_model::dim; ++k) m.gw[k] = sw[k] / d;
    m.gb[0] = sb / d;
    m.sgd(learning_rate);
  }
  return m;
}

struct train_options {
  int base_batches = 3;            // rank r holds base_batches + r batches
  bool use_join = true;
  bool barrier_in_loop = false;    // seed 004 cases 3 and 4
  bool barrier_after = false;      // cases 5 and 6
  ddp::join_options join{};
};

// One rank's training loop. Returns the final model.
inline linear_model train(ddp::communicator_ref comm, const train_options& o) {
  linear_model m;
  ddp::Bucketer grads(comm);
  grads.add(m.w, m.gw);
  grads.add(m.b, m.gb);
  grads.build();
  const int batches = o.base_batches + comm.rank();
  auto step = [&](int t) {
    m.compute_gradients(comm.rank(), t);
    grads.mark_ready(1);
    grads.mark_ready(0);
    grads.finalize();
    m.sgd(learning_rate);
  };
  if (o.use_join) {
    ddp::JoinContext join(o.join, grads);
    for (int t = 0; t < batches; ++t) {
      join.notify();
      step(t);
      if (o.barrier_in_loop) comm.barrier().wait();
    }
    join.finish();
  } else {
    for (int t = 0; t < batches; ++t) {
      step(t);
      if (o.barrier_in_loop) comm.barrier().wait();
    }
  }
  if (o.barrier_after) comm.barrier().wait();
  return m;
}

inline void expect_model_matches(ddp::communicator_ref comm, const linear_model& got, const linear_model& want,
                                 const std::string& where) {
  for (std::size_t k = 0; k < linear_model::dim; ++k) {
    SUITE_EXPECT(std::abs(got.w[k] - want.w[k]) <= 1e-12 * std::max(1.0, std::abs(want.w[k])),
                 where << ": w[" << k << "] = " << got.w[k] << ", reference " << want.w[k]);
  }
  SUITE_EXPECT(std::abs(got.b[0] - want.b[0]) <= 1e-12 * std::max(1.0, std::abs(want.b[0])), where << ": b");
  suite::buffer params(ddp::dtype::f64, linear_model::dim + 1);
  for (std::size_t k = 0; k < linear_model::dim; ++k) params.set(k, got.w[k]);
  params.set(linear_model::dim, got.b[0]);
  suite::expect_same_bits_everywhere(comm, params, where + ": parameters identical on every rank");
}

// Cases 1 and 6: join around the loop (optionally a barrier after finish): identical models, equal
// to the serial reference, for both averaging rules.
inline void join_uneven_inputs(ddp::communicator_ref comm) {
  for (bool divide_initial : {true, false}) {
    for (bool barrier_after : {false, true}) {
      train_options o;
      o.join.hooks.divide_by_initial_world_size = divide_initial;
      o.barrier_after = barrier_after;
      const auto got = train(comm, o);
      expect_model_matches(comm, got, reference(comm.size(), o.base_batches, divide_initial),
                           std::string("join, divide_by_initial_world_size=") + (divide_initial ? "true" : "false") +
                               (barrier_after ? ", barrier after" : ""));
    }
  }
}

// Exactly one int64 bookkeeping allreduce per iteration for all joinables; none when disabled.
inline void bookkeeping_cost(ddp::communicator_ref comm) {
  for (bool enable : {true, false}) {
    testing_support::counting_communicator counting(comm);
    ddp::communicator_ref ref(counting);
    std::vector<float> g1(10), g2(10);
    ddp::Bucketer a(ref), b(ref);
    a.add(g1);
    b.add(g2);
    a.build();
    b.build();
    counting.reset();
    constexpr int iterations = 5;
    {
      ddp::JoinContext join({.enable = enable}, a, b);
      for (int t = 0; t < iterations; ++t) {
        join.notify();
        a.mark_ready(0);
        b.mark_ready(0);
        a.finalize();
        b.finalize();
      }
      SUITE_EXPECT(counting.count("allreduce", ddp::dtype::i64) == (enable ? iterations : 0),
                   "bookkeeping allreduces: " << counting.count("allreduce", ddp::dtype::i64));
      SUITE_EXPECT(counting.count("allreduce", ddp::dtype::f32) == 2 * iterations, "two buckets per iteration");
      SUITE_EXPECT(counting.total() == (enable ? 3u : 2u) * iterations, "nothing else: " << counting.total());
      join.finish();
    }
  }
}

// A user joinable: a toy sharded optimizer state. Each step every rank updates its own shard and
// allgathers all shards (ZeRO-like); a joined rank takes part in the allgather with its shard.
struct sharded_state {
  ddp::communicator_ref comm;
  std::vector<double> shard = std::vector<double>(3, 0.0);
  std::vector<double> full;
  std::vector<std::string>* log;
  explicit sharded_state(ddp::communicator_ref c, std::vector<std::string>* l)
      : comm(c), full(3 * static_cast<std::size_t>(c.size())), log(l) {}

  void step() {
    for (double& x : shard) x += 1.0;
    comm.allgather(ddp::view(shard), ddp::view(full)).wait();
  }

  struct hook {
    sharded_state* s;
    void main_hook(const ddp::join_round&) {
      s->log->push_back("state main");
      s->comm.allgather(ddp::view(s->shard), ddp::view(s->full)).wait();
    }
    void post_hook(const ddp::join_summary& sum) {
      s->log->push_back("state post last=" + std::to_string(sum.is_last_joiner));
    }
  };
  hook join_hook(const ddp::join_hook_options&) { return {this}; }
  ddp::communicator_ref join_communicator() const { return comm; }
};

// A Bucketer wrapper that logs its hooks, to observe ordering.
struct logged_bucketer_hook {
  ddp::Bucketer<>::join_hook_type inner;
  std::vector<std::string>* log;
  void main_hook(const ddp::join_round& r) {
    log->push_back("grads main");
    inner.main_hook(r);
  }
  void post_hook(const ddp::join_summary& s) {
    log->push_back("grads post");
    inner.post_hook(s);
  }
};
struct logged_bucketer {
  ddp::Bucketer<>& b;
  std::vector<std::string>* log;
  logged_bucketer_hook join_hook(const ddp::join_hook_options& o) { return {b.join_hook(o), log}; }
  ddp::communicator_ref join_communicator() const { return b.join_communicator(); }
  bool join_will_communicate() const { return b.join_will_communicate(); }
  void join_notified(const ddp::join_round& r) { b.join_notified(r); }
};

inline void two_joinables_in_order(ddp::communicator_ref comm) {
  std::vector<std::string> log;
  std::vector<float> g(8);
  ddp::Bucketer<> grads(comm);
  grads.add(g);
  logged_bucketer lb{grads, &log};
  sharded_state state(comm, &log);
  const int batches = 2 + comm.rank();
  {
    ddp::JoinContext join({}, lb, state);
    for (int t = 0; t < batches; ++t) {
      join.notify();
      std::fill(g.begin(), g.end(), 1.0f);
      grads.mark_ready(0);
      grads.finalize();
      state.step();
    }
    const auto summary = join.finish();
    SUITE_EXPECT(summary.authoritative_rank == comm.size() - 1, "last rank to join is the highest");
    SUITE_EXPECT(summary.is_last_joiner == (comm.rank() == comm.size() - 1), "is_last_joiner");
  }
  const int shadowed = comm.size() - 1 - comm.rank();
  std::vector<std::string> want;
  for (int k = 0; k < shadowed; ++k) {
    want.push_back("grads main");
    want.push_back("state main");
  }
  want.push_back("grads post");
  want.push_back("state post last=" + std::to_string(comm.rank() == comm.size() - 1));
  SUITE_EXPECT(log == want, "hooks run in joinable order; " << log.size() << " entries, want " << want.size());
  // Every rank's shard advanced once per own batch; the gathered state is the same everywhere.
  for (int r = 0; r < comm.size(); ++r) {
    SUITE_EXPECT(state.full[3 * static_cast<std::size_t>(r)] == 2.0 + r, "shard of rank " << r);
  }
}

// Every rank throws early_termination in the same iteration.
inline void early_termination_everywhere(ddp::communicator_ref comm) {
  train_options o;
  o.join.throw_on_early_termination = true;
  std::int64_t at = -1;
  try {
    (void)train(comm, o);
  } catch (const ddp::early_termination& e) {
    at = static_cast<std::int64_t>(e.iteration());
  }
  if (comm.size() == 1) {
    SUITE_EXPECT(at == -1, "a single rank never terminates early");
    return;
  }
  SUITE_EXPECT(at == o.base_batches, "every rank stops at the iteration rank 0 ran out, got " << at);
  std::vector<std::int64_t> mine{at}, all(static_cast<std::size_t>(comm.size()));
  comm.allgather(ddp::view(mine), ddp::view(all)).wait();
  for (auto a : all) SUITE_EXPECT(a == at, "same iteration on every rank");
}

// no_sync on some training ranks only is caught by the bookkeeping.
inline void no_sync_disagreement(ddp::communicator_ref comm) {
  if (comm.size() < 2) return;
  std::vector<float> g(4);
  ddp::Bucketer grads(comm);
  grads.add(g);
  grads.build();
  ddp::JoinContext join({}, grads);
  bool caught = false;
  try {
    std::optional<ddp::Bucketer<>::no_sync_scope> scope;
    if (comm.rank() == 0) scope.emplace(grads);
    join.notify();
  } catch (const ddp::mismatch_error& e) {
    caught = std::string(e.what()).find("no_sync") != std::string::npos;
  }
  SUITE_EXPECT(caught, "mismatched no_sync must raise mismatch_error on every rank");
  join.abandon();
}

inline void run_all(ddp::communicator_ref comm) {
  join_uneven_inputs(comm);
  bookkeeping_cost(comm);
  two_joinables_in_order(comm);
  early_termination_everywhere(comm);
  no_sync_disagreement(comm);
}

}  // namespace join_cases
