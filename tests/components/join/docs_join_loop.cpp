// The join loops of the documentation, as a program run over MPI processes (2 to 4 ranks, rank r
// holding 3 + 2r batches: uneven inputs).
//
// The code between `// example-begin NAME` and `// example-end NAME` is quoted verbatim by the
// docs (the ctest docs_join_loop.snippets checks it), so clang-format leaves this file alone:
//   migration        docs/migration-from-pytorch.md, "The same loop, twice"
//   buffer-reducer   docs/buffer-reducer.md, "Join (uneven inputs)"
// Each loop also runs with the joinables given to the JoinContext the other way round
// (`NAME-swapped`: the same text with `grads, buffers)` turned into `buffers, grads)`, also
// checked), since both orders must work as written.
//
// Every loop must finish on every rank with a model equal to a serial reference and identical on
// every rank; a joined rank must have shadowed every sync of the ranks still training. Exit code
// 0 on success, 3 on an error (printed), never a hang: the communicator's timeout is 20 s.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>
// clang-format off

#include <ddp/ddp.hpp>
#include <ddp/mpi.hpp>

namespace {

// A trainer's model as the docs assume it: parameters, gradients and buffers as lists of tensors,
// forward(x, y), and backward(ready) that calls ready(i) as gradient i becomes final (in reverse).
// y = w . x + b with a squared loss; the buffer is a running mean of the inputs (like BatchNorm's
// running statistics: updated by forward, not used for training).
struct toy_net {
  static constexpr std::size_t dim = 4;
  std::vector<std::vector<double>> params{std::vector<double>(dim, 0.0), std::vector<double>(1, 0.0)};
  std::vector<std::vector<double>> grads{std::vector<double>(dim, 0.0), std::vector<double>(1, 0.0)};
  std::vector<std::vector<double>> buffers{std::vector<double>(dim, 0.0)};
  std::vector<double> x_;
  double err_ = 0;

  void forward(const std::vector<double>& x, double y) {
    x_ = x;
    double pred = params[1][0];
    for (std::size_t k = 0; k < dim; ++k) pred += params[0][k] * x[k];
    err_ = pred - y;
    for (std::size_t k = 0; k < dim; ++k) buffers[0][k] = 0.9 * buffers[0][k] + 0.1 * x[k];
  }
  template <class Ready>
  void backward(Ready&& ready) {
    grads[1][0] = err_;
    ready(std::size_t{1});
    for (std::size_t k = 0; k < dim; ++k) grads[0][k] = err_ * x_[k];
    ready(std::size_t{0});
  }
};

struct sgd {
  toy_net* net;
  double lr = 0.1;
  void step() {
    for (std::size_t p = 0; p < net->params.size(); ++p) {
      for (std::size_t k = 0; k < net->params[p].size(); ++k) net->params[p][k] -= lr * net->grads[p][k];
    }
  }
};

using shard_type = std::vector<std::pair<std::vector<double>, double>>;

int batches_of(int rank) { return 3 + 2 * rank; }

std::pair<std::vector<double>, double> sample(int rank, int t) {
  std::vector<double> x(toy_net::dim);
  for (std::size_t k = 0; k < x.size(); ++k) x[k] = std::sin(7.0 * rank + 3.0 * t + static_cast<double>(k));
  return {x, 2.0 * x[0] - x[1] + 0.5 * x[2] + 3.0 * x[3] + 1.0};
}

shard_type shard_of(int rank) {
  shard_type shard;
  for (int t = 0; t < batches_of(rank); ++t) shard.push_back(sample(rank, t));
  return shard;
}

// Serial reference: in iteration t every rank with data left contributes its gradient; the sum is
// divided by the world size, or by the ranks still training.
toy_net reference(int size, bool divide_by_initial_world_size) {
  toy_net net;
  sgd opt{&net};
  const int iterations = batches_of(size - 1);
  for (int t = 0; t < iterations; ++t) {
    std::vector<std::vector<double>> sum{std::vector<double>(toy_net::dim, 0.0), std::vector<double>(1, 0.0)};
    int training = 0;
    for (int r = 0; r < size; ++r) {
      if (t >= batches_of(r)) continue;
      ++training;
      toy_net probe = net;
      const auto [x, y] = sample(r, t);
      probe.forward(x, y);
      probe.backward([](std::size_t) {});
      for (std::size_t p = 0; p < sum.size(); ++p) {
        for (std::size_t k = 0; k < sum[p].size(); ++k) sum[p][k] += probe.grads[p][k];
      }
    }
    const double d = divide_by_initial_world_size ? size : training;
    for (std::size_t p = 0; p < sum.size(); ++p) {
      for (std::size_t k = 0; k < sum[p].size(); ++k) net.grads[p][k] = sum[p][k] / d;
    }
    opt.step();
  }
  return net;
}

void check(ddp::communicator_ref comm, const char* loop, const toy_net& net, bool divide_by_initial_world_size,
           const ddp::buffer_reducer_stats& stats) {
  const toy_net want = reference(comm.size(), divide_by_initial_world_size);
  std::vector<double> mine;
  for (std::size_t p = 0; p < net.params.size(); ++p) {
    for (std::size_t k = 0; k < net.params[p].size(); ++k) {
      const double got = net.params[p][k];
      const double ref = want.params[p][k];
      if (!(std::abs(got - ref) <= 1e-12 * std::max(1.0, std::abs(ref)))) {
        throw std::runtime_error(std::string(loop) + ": parameter " + std::to_string(p) + "[" + std::to_string(k) +
                                 "] = " + std::to_string(got) + ", serial reference " + std::to_string(ref));
      }
      mine.push_back(got);
    }
  }
  std::vector<double> all(mine.size() * static_cast<std::size_t>(comm.size()));
  comm.allgather(ddp::view(mine), ddp::view(all)).wait();
  for (std::size_t i = 0; i < all.size(); ++i) {
    if (all[i] != mine[i % mine.size()]) {
      throw std::runtime_error(std::string(loop) + ": parameters differ across ranks");
    }
  }
  const auto rounds = static_cast<std::uint64_t>(batches_of(comm.size() - 1));
  if (stats.communicating_syncs + stats.shadowed_syncs != rounds) {
    throw std::runtime_error(std::string(loop) + ": " + std::to_string(stats.communicating_syncs) + " syncs and " +
                             std::to_string(stats.shadowed_syncs) + " shadowed syncs, want " +
                             std::to_string(rounds) + " in all");
  }
  std::printf("rank %d: %s: finished after %d batches of its own and %llu shadowed syncs; parameters equal the "
              "serial reference and are identical on every rank\n",
              comm.rank(), loop, batches_of(comm.rank()), static_cast<unsigned long long>(stats.shadowed_syncs));
  std::fflush(stdout);
}

void migration(ddp::communicator_ref comm) {
  toy_net net;
  sgd opt{&net};
  const shard_type shard = shard_of(comm.rank());
  // example-begin migration
  ddp::Bucketer grads(comm, ddp::bucketing::size_capped{.cap_bytes = 25 << 20});
  for (std::size_t i = 0; i < net.params.size(); ++i) grads.add(net.params[i], net.grads[i]);
  grads.build();
  ddp::BufferReducer buffers(comm);                 // broadcast_buffers=True
  for (auto& b : net.buffers) buffers.add(b);
  ddp::JoinContext join({}, grads, buffers);
  for (auto& [x, y] : shard) {
    join.notify();
    buffers.sync();
    net.forward(x, y);
    net.backward([&](std::size_t i) { grads.mark_ready(i); });
    grads.finalize();
    opt.step();
  }
  join.finish();
  // example-end migration
  check(comm, "migration-from-pytorch.md loop, JoinContext(..., grads, buffers)", net, true, buffers.stats());
}

void migration_swapped(ddp::communicator_ref comm) {
  toy_net net;
  sgd opt{&net};
  const shard_type shard = shard_of(comm.rank());
  // example-begin migration-swapped
  ddp::Bucketer grads(comm, ddp::bucketing::size_capped{.cap_bytes = 25 << 20});
  for (std::size_t i = 0; i < net.params.size(); ++i) grads.add(net.params[i], net.grads[i]);
  grads.build();
  ddp::BufferReducer buffers(comm);                 // broadcast_buffers=True
  for (auto& b : net.buffers) buffers.add(b);
  ddp::JoinContext join({}, buffers, grads);
  for (auto& [x, y] : shard) {
    join.notify();
    buffers.sync();
    net.forward(x, y);
    net.backward([&](std::size_t i) { grads.mark_ready(i); });
    grads.finalize();
    opt.step();
  }
  join.finish();
  // example-end migration-swapped
  check(comm, "migration-from-pytorch.md loop, JoinContext(..., buffers, grads)", net, true, buffers.stats());
}

void buffer_reducer(ddp::communicator_ref comm) {
  toy_net net;
  sgd opt{&net};
  const shard_type shard = shard_of(comm.rank());
  ddp::Bucketer grads(comm);
  for (std::size_t i = 0; i < net.params.size(); ++i) grads.add(net.params[i], net.grads[i]);
  grads.build();
  ddp::BufferReducer buffers(comm);
  for (auto& b : net.buffers) buffers.add(b);
  // example-begin buffer-reducer
  ddp::JoinContext join({.hooks = {.divide_by_initial_world_size = false}}, grads, buffers);
  for (auto& [x, y] : shard) {
    join.notify();          // asks buffers.join_will_communicate(), then buffers.join_notified(round)
    buffers.sync();         // uses that round
    net.forward(x, y);
    net.backward([&](std::size_t i) { grads.mark_ready(i); });
    grads.finalize();
    opt.step();
  }
  join.finish();            // shadows the others' syncs through the hook, then runs post hooks
  // example-end buffer-reducer
  check(comm, "buffer-reducer.md loop, JoinContext(..., grads, buffers)", net, false, buffers.stats());
}

void buffer_reducer_swapped(ddp::communicator_ref comm) {
  toy_net net;
  sgd opt{&net};
  const shard_type shard = shard_of(comm.rank());
  ddp::Bucketer grads(comm);
  for (std::size_t i = 0; i < net.params.size(); ++i) grads.add(net.params[i], net.grads[i]);
  grads.build();
  ddp::BufferReducer buffers(comm);
  for (auto& b : net.buffers) buffers.add(b);
  // example-begin buffer-reducer-swapped
  ddp::JoinContext join({.hooks = {.divide_by_initial_world_size = false}}, buffers, grads);
  for (auto& [x, y] : shard) {
    join.notify();          // asks buffers.join_will_communicate(), then buffers.join_notified(round)
    buffers.sync();         // uses that round
    net.forward(x, y);
    net.backward([&](std::size_t i) { grads.mark_ready(i); });
    grads.finalize();
    opt.step();
  }
  join.finish();            // shadows the others' syncs through the hook, then runs post hooks
  // example-end buffer-reducer-swapped
  check(comm, "buffer-reducer.md loop, JoinContext(..., buffers, grads)", net, false, buffers.stats());
}

}  // namespace

int main(int argc, char** argv) {
  // The environment sets MPI_ERRORS_RETURN on MPI_COMM_WORLD, so a mismatched collective
  // (MPI_ERR_TRUNCATE from Open MPI's NBC engine) comes back as an exception, not a job abort.
  ddp::mpi::environment env(&argc, &argv);
  auto comm = ddp::mpi::communicator::world({.timeout = std::chrono::seconds(20)});
  try {
    migration(comm);
    migration_swapped(comm);
    buffer_reducer(comm);
    buffer_reducer_swapped(comm);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: docs_join_loop: %s\n", comm.rank(), e.what());
    std::fflush(stderr);
    std::_Exit(3);  // without MPI_Finalize: a peer may be stuck in a collective that never matches
  }
}
