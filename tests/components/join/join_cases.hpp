#pragma once
// JoinContext behaviour, written once against communicator_ref and run over the local backend
// (threads) and MPI (processes). The six uneven-input cases of docs/join.md (one rank with a batch
// more, with and without join, with a barrier in or after the loop) are `train()` with different
// switches.

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ddp/bucketer.hpp>
#include <ddp/buffer_reducer.hpp>
#include <ddp/checked.hpp>
#include <ddp/join.hpp>
#include <ddp/strategies/allreduce.hpp>

#include "../../common/collective_suite.hpp"
#include "../../common/counting_communicator.hpp"

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
  int base_batches = 3;  // rank r holds base_batches + r batches
  bool use_join = true;
  bool barrier_in_loop = false;  // cases 3 and 4
  bool barrier_after = false;    // cases 5 and 6
  bool explicit_build = true;    // false: the Bucketer builds itself at the first mark_ready
  ddp::join_options join{};
};

// One rank's training loop. Returns the final model.
inline linear_model train(ddp::communicator_ref comm, const train_options& o) {
  linear_model m;
  ddp::Bucketer grads(comm);
  grads.add(m.w, m.gw);
  grads.add(m.b, m.gb);
  if (o.explicit_build) grads.build();
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
  // A Bucketer built lazily (at its first mark_ready, after notify() told it the divisor) keeps
  // that divisor: rank 0 has no data, so round 0 already divides by fewer ranks than the world.
  for (bool divide_initial : {true, false}) {
    train_options o;
    o.base_batches = 0;
    o.explicit_build = false;
    o.join.hooks.divide_by_initial_world_size = divide_initial;
    const auto got = train(comm, o);
    expect_model_matches(comm, got, reference(comm.size(), o.base_batches, divide_initial),
                         std::string("join, lazy build, rank 0 without data, divide_by_initial_world_size=") +
                             (divide_initial ? "true" : "false"));
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

// ---- a Bucketer and a BufferReducer in one context --------------------------------------------

// How a loop is written: in which order the joinables are given to the context, where the buffers
// sync, and which iteration (if any) runs in the Bucketer's no_sync on every rank.
struct loop_shape {
  bool grads_first = true;           // JoinContext(o, grads, buffers), else (o, buffers, grads)
  bool sync_after_backward = false;  // buffers.sync() after finalize() instead of before forward
  int no_sync_at = -1;               // this iteration only accumulates gradients locally
  int base_batches = 3;              // rank r holds base_batches + r batches
  ddp::join_options join{};
};

inline std::string describe(const loop_shape& s) {
  return std::string(s.grads_first ? "JoinContext(o, grads, buffers)" : "JoinContext(o, buffers, grads)") +
         (s.sync_after_backward ? ", buffers.sync() after backward" : ", buffers.sync() before forward") +
         (s.no_sync_at >= 0 ? ", no_sync at iteration " + std::to_string(s.no_sync_at) : std::string()) +
         (s.join.hooks.divide_by_initial_world_size ? "" : ", divide by ranks training") + ", rank r holds " +
         std::to_string(s.base_batches) + " + r batches";
}

// Serial reference of `train_with_buffers`: rank r holds base_batches + r batches; in the no_sync
// iteration each rank only accumulates its gradient, which the next synchronised iteration adds to
// its own (a rank whose last iteration was no_sync never contributes its accumulated gradient).
inline linear_model reference_with_accumulation(int size, const loop_shape& shape) {
  const int base_batches = shape.base_batches;
  linear_model m;
  const int iterations = base_batches + size - 1;
  std::vector<std::vector<double>> acc(static_cast<std::size_t>(size), std::vector<double>(linear_model::dim + 1, 0.0));
  for (int t = 0; t < iterations; ++t) {
    std::vector<double> sum(linear_model::dim + 1, 0.0);
    int training = 0;
    for (int r = 0; r < size; ++r) {
      if (t >= base_batches + r) continue;
      ++training;
      linear_model probe = m;
      probe.compute_gradients(r, t);
      auto& a = acc[static_cast<std::size_t>(r)];
      for (std::size_t k = 0; k < linear_model::dim; ++k) a[k] += probe.gw[k];
      a[linear_model::dim] += probe.gb[0];
      if (t == shape.no_sync_at) continue;
      for (std::size_t k = 0; k <= linear_model::dim; ++k) sum[k] += std::exchange(a[k], 0.0);
    }
    if (t == shape.no_sync_at) continue;
    const double d = shape.join.hooks.divide_by_initial_world_size ? size : training;
    for (std::size_t k = 0; k < linear_model::dim; ++k) m.gw[k] = sum[k] / d;
    m.gb[0] = sum[linear_model::dim] / d;
    m.sgd(learning_rate);
  }
  return m;
}

// One rank's loop with a Bucketer (the model's gradients) and a BufferReducer (a statistic
// broadcast from rank 0, and a count summed over ranks) in ONE JoinContext, written as
// docs/migration-from-pytorch.md writes it: notify(), buffers.sync(), forward, backward marking the
// gradients in reverse, finalize(), step. Rank r holds base_batches + r batches. After each sync a training
// rank checks the buffers: the count is the number of ranks training (a joined rank adds zero),
// the statistic is rank 0's, or the authoritative rank's once rank 0 has joined.
inline linear_model train_with_buffers(ddp::communicator_ref comm, const loop_shape& shape) {
  const int base_batches = shape.base_batches;
  linear_model m;
  std::vector<double> acc(linear_model::dim + 1, 0.0);  // gradients accumulated in no_sync
  ddp::Bucketer grads(comm);
  grads.add(m.w, m.gw);
  grads.add(m.b, m.gb);
  grads.build();
  std::vector<double> stat(3, 0.0);
  std::vector<std::int64_t> count(2, 0);
  ddp::BufferReducer buffers(comm);  // default strategy: broadcast from rank 0
  buffers.add(stat);
  buffers.add(count, ddp::strategies::allreduce_sum{});
  buffers.build();
  const int rank = comm.rank();
  const int batches = base_batches + rank;

  auto sync_and_check = [&](const ddp::join_round& round, int t) {
    std::fill(stat.begin(), stat.end(), static_cast<double>(rank));
    std::fill(count.begin(), count.end(), std::int64_t{1});
    buffers.sync();
    const int root = round.training_rank(0) ? 0 : round.authoritative_rank;
    const std::string where = describe(shape) + ", iteration " + std::to_string(t);
    SUITE_EXPECT(count[0] == round.training && count[1] == round.training,
                 where << ": count " << count[0] << ", want " << round.training);
    SUITE_EXPECT(stat[0] == root && stat[2] == root, where << ": broadcast statistic " << stat[0] << ", want " << root);
  };
  auto loop = [&](auto& join) {
    for (int t = 0; t < batches; ++t) {
      std::optional<ddp::Bucketer<>::no_sync_scope> accumulate;
      if (t == shape.no_sync_at) accumulate.emplace(grads);
      const ddp::join_round& round = join.notify();
      if (!shape.sync_after_backward) sync_and_check(round, t);
      m.compute_gradients(rank, t);  // forward and backward
      for (std::size_t k = 0; k < linear_model::dim; ++k) m.gw[k] = (acc[k] += m.gw[k]);
      m.gb[0] = (acc[linear_model::dim] += m.gb[0]);
      grads.mark_ready(1);
      grads.mark_ready(0);
      grads.finalize();
      if (shape.sync_after_backward) sync_and_check(round, t);
      if (t == shape.no_sync_at) continue;  // accumulate: no step
      std::fill(acc.begin(), acc.end(), 0.0);
      m.sgd(learning_rate);
    }
    join.finish();
  };
  if (shape.grads_first) {
    ddp::JoinContext join(shape.join, grads, buffers);
    loop(join);
  } else {
    ddp::JoinContext join(shape.join, buffers, grads);
    loop(join);
  }
  SUITE_EXPECT(buffers.stats().communicating_syncs + buffers.stats().shadowed_syncs ==
                   static_cast<std::uint64_t>(base_batches + comm.size() - 1),
               describe(shape) << ": every rank took part in every round's sync: " << buffers.stats());
  return m;
}

// The documented loop, in both registration orders, with the buffers synced before forward (as
// the docs write it) and after backward: every rank finishes, the model equals the serial
// reference on every rank, and every round's buffers are right.
inline void bucketer_and_buffers(ddp::communicator_ref comm) {
  for (bool grads_first : {true, false}) {
    for (bool after : {false, true}) {
      for (bool divide_initial : {true, false}) {
        loop_shape shape;
        shape.grads_first = grads_first;
        shape.sync_after_backward = after;
        shape.join.hooks.divide_by_initial_world_size = divide_initial;
        const auto got = train_with_buffers(comm, shape);
        expect_model_matches(comm, got, reference_with_accumulation(comm.size(), shape), describe(shape));
      }
    }
  }
}

// The order learned from one iteration survives an iteration in which only the BufferReducer
// communicates: here the buffers sync after backward (the Bucketer issues first, against both the
// registration order and the "buffers before forward" default), and iteration 2, rank 0's last,
// runs in no_sync on every rank. Rank 0 then shadows round 3 in the order of round 1.
inline void order_learned_across_no_sync(ddp::communicator_ref comm) {
  for (bool grads_first : {false, true}) {
    loop_shape shape;
    shape.grads_first = grads_first;
    shape.sync_after_backward = true;
    shape.no_sync_at = 2;
    const auto got = train_with_buffers(comm, shape);
    expect_model_matches(comm, got, reference_with_accumulation(comm.size(), shape), describe(shape));
  }
}

// A rank with no data at all joins before any iteration has been observed: it shadows round 0 in
// the initial order, the registration order with the joinables' phase hints applied (the
// BufferReducer syncs before forward, the Bucketer's buckets launch during backward). So the
// documented loop works from round 0 in both registration orders.
inline void rank_without_data(ddp::communicator_ref comm) {
  for (bool grads_first : {true, false}) {
    loop_shape shape;
    shape.grads_first = grads_first;
    shape.base_batches = 0;  // rank 0 has no data
    const auto got = train_with_buffers(comm, shape);
    expect_model_matches(comm, got, reference_with_accumulation(comm.size(), shape), describe(shape));
  }
}

// A joinable that communicates (one allreduce per step) but never reports its issue order.
struct silent_counter {
  ddp::communicator_ref comm;
  std::vector<std::int64_t> value = std::vector<std::int64_t>(1, 0);
  void step() {
    value[0] = 1;
    comm.allreduce(value, ddp::reduce_op::sum).wait();
  }
  struct hook {
    silent_counter* s;
    void main_hook(const ddp::join_round&) {
      s->value[0] = 0;
      s->comm.allreduce(s->value, ddp::reduce_op::sum).wait();
    }
    void post_hook(const ddp::join_summary&) {}
  };
  hook join_hook(const ddp::join_hook_options&) { return {this}; }
  ddp::communicator_ref join_communicator() const { return comm; }
};

// What the context learns, read with shadow_order() (every rank trains alike): the initial guess
// (registration order, hinted joinables arranged by phase, an unhinted joinable in its place),
// the observed order after an iteration, and that order kept through an iteration in which the
// Bucketer is in no_sync; a joinable that never reports stays where it was given.
inline void learned_order(ddp::communicator_ref comm) {
  std::vector<float> g(4);
  ddp::Bucketer grads(comm);
  grads.add(g);
  grads.build();
  std::vector<float> stat(2);
  ddp::BufferReducer buffers(comm);
  buffers.add(stat);
  buffers.build();
  silent_counter silent{comm};
  using order = std::array<std::size_t, 3>;
  auto show = [](const order& o) {
    return std::to_string(o[0]) + ", " + std::to_string(o[1]) + ", " + std::to_string(o[2]);
  };
  auto iteration = [&](auto& join, bool sync_first, bool no_sync) {
    std::optional<ddp::Bucketer<>::no_sync_scope> scope;
    if (no_sync) scope.emplace(grads);
    join.notify();
    if (sync_first) buffers.sync();
    silent.step();
    grads.mark_ready(0);
    grads.finalize();
    if (!sync_first) buffers.sync();
  };
  {
    ddp::JoinContext join({}, grads, silent, buffers);  // 0: grads, 1: silent, 2: buffers
    SUITE_EXPECT(join.shadow_order() == (order{2, 1, 0}),
                 "initial guess: buffers (before forward) in grads' place "
                 "and grads (backward) in buffers', silent in place; got "
                     << show(join.shadow_order()));
    iteration(join, false, false);  // grads, silent, buffers
    SUITE_EXPECT(join.shadow_order() == (order{0, 1, 2}), "observed: " << show(join.shadow_order()));
    iteration(join, false, true);  // no_sync: silent, buffers only
    SUITE_EXPECT(join.shadow_order() == (order{0, 1, 2}), "kept through no_sync: " << show(join.shadow_order()));
    iteration(join, true, false);  // buffers, silent, grads
    SUITE_EXPECT(join.shadow_order() == (order{2, 1, 0}), "observed again: " << show(join.shadow_order()));
    join.finish();
  }
}

// Training ranks that issue their joinables in different orders: two BufferReducers whose
// collectives have the same shape, so that no backend can tell them apart; even ranks sync A then
// B, odd ranks B then A. From the next notify() on, every rank (a rank that already joined
// included, in finish()) gets a mismatch_error naming the order, at once.
inline void order_disagreement(ddp::communicator_ref comm) {
  if (comm.size() < 2) return;
  const int rank = comm.rank();
  std::vector<double> a(2, 1.0), b(2, 2.0);
  ddp::BufferReducer ra(comm, ddp::strategies::allreduce_sum{});
  ddp::BufferReducer rb(comm, ddp::strategies::allreduce_sum{});
  ra.add(a);
  rb.add(b);
  ra.build();
  rb.build();
  // With 3 ranks or more, rank 0 trains one iteration only, so it is in finish() when the
  // disagreement shows.
  const int batches = comm.size() >= 3 && rank == 0 ? 1 : 4;
  ddp::JoinContext join({}, ra, rb);
  std::string error;
  int at = -1;
  const auto start = std::chrono::steady_clock::now();
  try {
    for (int t = 0; t < batches; ++t) {
      at = t;
      join.notify();
      if (rank % 2 == 0) {
        ra.sync();
        rb.sync();
      } else {
        rb.sync();
        ra.sync();
      }
    }
    at = batches;
    join.finish();
  } catch (const ddp::mismatch_error& e) {
    error = e.what();
  }
  join.abandon();
  const auto took = std::chrono::steady_clock::now() - start;
  SUITE_EXPECT(!error.empty(), "ranks issuing joinables in different orders must get mismatch_error (rank "
                                   << rank << " finished without one)");
  SUITE_EXPECT(error.find("order") != std::string::npos, "the error names the order: " << error);
  SUITE_EXPECT(at == std::min(1, batches), "caught in the round after the first disagreeing iteration, at " << at);
  SUITE_EXPECT(took < std::chrono::seconds(10), "at once, not after the communicator's timeout");
}

inline void run_all(ddp::communicator_ref comm) {
  join_uneven_inputs(comm);
  bookkeeping_cost(comm);
  two_joinables_in_order(comm);
  early_termination_everywhere(comm);
  no_sync_disagreement(comm);
}

}  // namespace join_cases
