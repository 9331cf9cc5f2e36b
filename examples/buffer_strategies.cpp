// Per-buffer synchronisation strategies: each rank counts the positive and negative examples it
// saw, and every rank must use the global counts (a sum of each sync's new counts, added to a
// running total); BatchNorm-like running statistics follow rank 0 (broadcast); an exponential
// moving average of the loss is averaged; a best-loss tracker takes the minimum. Buffers sharing a
// strategy and dtype are synced with one collective, whatever their number.
//
// A counter is summed as a delta: the buffer holds the counts since the last sync, and after each
// sync every rank adds the sum to its total and zeroes the buffer. Summing the running total
// itself would add every rank's copy of the earlier totals again at every sync.
//
//   mpiexec -n 2 ./buffer_strategies      or      ./buffer_strategies --threads 3
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include <ddp/buffer_reducer.hpp>
#include <ddp/local.hpp>
#include <ddp/mpi.hpp>
#include <ddp/strategies/allreduce.hpp>
#include <ddp/strategies/broadcast.hpp>

namespace {

constexpr int steps = 5, batch = 100;

/// FNV-1a over the bytes of the buffers: equal hashes, equal bits.
template <class... V>
std::int64_t bits_hash(const V&... v) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  const auto add = [&](const auto& vec) {
    const auto* p = reinterpret_cast<const unsigned char*>(vec.data());
    for (std::size_t i = 0; i < vec.size() * sizeof(vec[0]); ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  };
  (add(v), ...);
  return static_cast<std::int64_t>(h);
}

void run(ddp::communicator_ref comm) {
  const int rank = comm.rank();
  std::vector<std::int64_t> new_seen{0, 0};  // positives, negatives seen since the last sync: summed
  std::vector<std::int64_t> seen{0, 0};      // global totals, not registered: every rank adds the same sums
  std::vector<float> bn_mean(64, 0.0f), bn_var(64, 1.0f);
  std::vector<double> loss_ema{0.0};
  std::vector<double> best_loss{1e30};

  ddp::BufferReducer buffers(comm);  // default strategy: broadcast from rank 0
  buffers.add(new_seen, ddp::strategies::allreduce_sum{});
  buffers.add(bn_mean);
  buffers.add(bn_var);
  buffers.add(loss_ema, ddp::strategies::allreduce_mean{});
  buffers.add(best_loss, ddp::strategies::allreduce_min{});
  buffers.build();

  std::mt19937 rng(100u + static_cast<unsigned>(rank));
  std::bernoulli_distribution positive(0.3 + 0.1 * rank);
  std::vector<std::int64_t> mine{0, 0};  // what this rank counted itself, for the check below
  for (int step = 0; step < steps; ++step) {
    for (int i = 0; i < batch; ++i) {  // this rank's batch
      const auto k = positive(rng) ? 0u : 1u;
      new_seen[k] += 1;
      mine[k] += 1;
    }
    for (auto& m : bn_mean) m += 0.01f * static_cast<float>(rank + 1);  // ranks drift apart...
    const double loss = 1.0 / (step + 1 + rank);
    loss_ema[0] = 0.9 * loss_ema[0] + 0.1 * loss;
    best_loss[0] = std::min(best_loss[0], loss);
    const bool communicates = buffers.will_communicate();  // always, without a period
    buffers.sync();                                        // ...and are brought back
    if (communicates) {  // new_seen holds every rank's new counts now: add them once, start again
      for (std::size_t k = 0; k < seen.size(); ++k) seen[k] += new_seen[k];
      std::fill(new_seen.begin(), new_seen.end(), 0);
    }
    if (rank == 0) {
      std::printf("step %d: global examples %lld positive / %lld negative, loss ema %.5f, best loss %.5f\n", step,
                  static_cast<long long>(seen[0]), static_cast<long long>(seen[1]), loss_ema[0], best_loss[0]);
    }
  }
  const auto& st = buffers.stats();
  std::printf(
      "rank %d: counted %lld/%lld itself; holds global %lld/%lld; bn_mean[0] = %.3f; %zu collectives per sync "
      "for 5 buffers\n",
      rank, static_cast<long long>(mine[0]), static_cast<long long>(mine[1]), static_cast<long long>(seen[0]),
      static_cast<long long>(seen[1]), static_cast<double>(bn_mean[0]), st.collectives_per_sync);

  // The check: the global counts are what the ranks counted, summed (gathered apart from the
  // reducer), and every example was counted once: ranks x steps x batch in all. Every rank holds
  // the same bits in every buffer and in the totals.
  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<std::int64_t> counted(2 * n), hash{bits_hash(seen, bn_mean, bn_var, loss_ema, best_loss)}, hashes(n);
  comm.allgather(ddp::view(mine), ddp::view(counted)).wait();
  comm.allgather(ddp::view(hash), ddp::view(hashes)).wait();
  std::int64_t pos = 0, neg = 0;
  bool same = true;
  for (std::size_t r = 0; r < n; ++r) {
    pos += counted[2 * r];
    neg += counted[2 * r + 1];
    same = same && hashes[r] == hash[0];
  }
  const std::int64_t expected = static_cast<std::int64_t>(comm.size()) * steps * batch;
  const bool right = seen[0] == pos && seen[1] == neg && seen[0] + seen[1] == expected;
  if (rank == 0) {
    std::printf("global examples: %lld = %d ranks x %d steps x %d samples: %s\n",
                static_cast<long long>(seen[0] + seen[1]), comm.size(), steps, batch, right ? "yes" : "NO");
    std::printf("buffers identical on all %d ranks: %s\n", comm.size(), same ? "yes" : "NO");
  }
  if (!right) throw std::runtime_error("global counts differ from what the ranks counted");
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
    auto comm = ddp::world(env);  // shared memory inside a node, TCP between nodes
    run(comm);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "buffer_strategies: %s\n", e.what());
    return 1;
  }
}
