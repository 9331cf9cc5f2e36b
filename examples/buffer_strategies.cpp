// Per-buffer synchronisation strategies: each rank counts the positive and negative
// examples it saw, and every rank must use the global counts (sum); BatchNorm-like running
// statistics follow rank 0 (broadcast); an exponential moving average of the loss is averaged;
// a best-loss tracker takes the minimum. Buffers sharing a strategy and dtype are synced with one
// collective, whatever their number.
//
//   mpiexec -n 2 ./buffer_strategies      or      ./buffer_strategies --threads 3
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include <ddp/buffer_reducer.hpp>
#include <ddp/local.hpp>
#include <ddp/mpi.hpp>
#include <ddp/strategies/allreduce.hpp>
#include <ddp/strategies/broadcast.hpp>

namespace {

void run(ddp::communicator_ref comm) {
  const int rank = comm.rank();
  std::vector<std::int64_t> seen{0, 0};  // positives, negatives seen by this rank
  std::vector<float> bn_mean(64, 0.0f), bn_var(64, 1.0f);
  std::vector<double> loss_ema{0.0};
  std::vector<double> best_loss{1e30};

  ddp::BufferReducer buffers(comm);  // default strategy: broadcast from rank 0
  buffers.add(seen, ddp::strategies::allreduce_sum{});
  buffers.add(bn_mean);
  buffers.add(bn_var);
  buffers.add(loss_ema, ddp::strategies::allreduce_mean{});
  buffers.add(best_loss, ddp::strategies::allreduce_min{});
  buffers.build();

  std::mt19937 rng(100u + static_cast<unsigned>(rank));
  std::bernoulli_distribution positive(0.3 + 0.1 * rank);
  std::int64_t my_pos = 0, my_neg = 0;
  for (int step = 0; step < 5; ++step) {
    for (int i = 0; i < 100; ++i) {  // this rank's batch
      const bool p = positive(rng);
      (p ? seen[0] : seen[1]) += 1;
      (p ? my_pos : my_neg) += 1;
    }
    for (auto& m : bn_mean) m += 0.01f * static_cast<float>(rank + 1);  // ranks drift apart...
    const double loss = 1.0 / (step + 1 + rank);
    loss_ema[0] = 0.9 * loss_ema[0] + 0.1 * loss;
    best_loss[0] = std::min(best_loss[0], loss);
    buffers.sync();  // ...and are brought back
    if (rank == 0) {
      std::printf("step %d: global examples %lld positive / %lld negative, loss ema %.5f, best loss %.5f\n", step,
                  static_cast<long long>(seen[0]), static_cast<long long>(seen[1]), loss_ema[0], best_loss[0]);
    }
    // Counts are global now: continue counting from them (every rank holds the same totals).
  }
  const auto& st = buffers.stats();
  std::printf(
      "rank %d: counted %lld/%lld itself; holds global %lld/%lld; bn_mean[0] = %.3f; %zu collectives per sync "
      "for 5 buffers\n",
      rank, static_cast<long long>(my_pos), static_cast<long long>(my_neg), static_cast<long long>(seen[0]),
      static_cast<long long>(seen[1]), static_cast<double>(bn_mean[0]), st.collectives_per_sync);
  // Every rank must hold identical buffers.
  std::vector<std::int64_t> mine{seen[0], seen[1]}, all(2 * static_cast<std::size_t>(comm.size()));
  comm.allgather(ddp::view(mine), ddp::view(all)).wait();
  bool same = true;
  for (std::size_t i = 0; i < all.size(); ++i) same = same && all[i] == mine[i % 2];
  if (rank == 0) std::printf("buffers identical on all %d ranks: %s\n", comm.size(), same ? "yes" : "NO");
  if (!same) throw std::runtime_error("buffers differ across ranks");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc > 2 && std::strcmp(argv[1], "--threads") == 0) {
      ddp::local::run(std::atoi(argv[2]), [](ddp::local::communicator& c) { run(c); });
      return 0;
    }
    ddp::mpi::environment env(&argc, &argv);
    auto comm = ddp::world(env);  // shared memory inside a node, MPI between nodes
    run(comm);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "buffer_strategies: %s\n", e.what());
    return 1;
  }
}
