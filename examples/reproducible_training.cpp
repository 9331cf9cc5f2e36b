// Reproducible training: the same parameters, bit for bit, whatever the number of ranks.
//
//   mpiexec -n 3 ./reproducible_training      or      ./reproducible_training --threads 3
//
// A linear model is trained by SGD on a global batch of 8 micro-batches per step; each rank
// computes its contiguous share of the micro-batches and hands their gradients to a
// ReproducibleReducer, which adds them in a fixed tree over the global micro-batch indices. At
// the end, rank 0 trains the same model alone (one rank, in this process) and compares: the bits
// are identical. The default path (each rank sums its micro-batches, the Bucketer averages over
// ranks) is run too: its bits depend on the number of ranks.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <ddp/ddp.hpp>
#include <ddp/local.hpp>
#include <ddp/mpi.hpp>
#include <ddp/reproducible.hpp>

namespace {

constexpr std::size_t features = 16, micro_batches = 8, samples_per_micro = 4;
constexpr int steps = 30;
constexpr float lr = 0.1f;

// Gradient of the mean squared error of micro-batch `i` of step `s`: depends only on (s, i) and
// the weights, never on the rank that computes it.
void micro_gradient(int s, std::size_t i, const std::vector<float>& w, std::vector<float>& g) {
  std::fill(g.begin(), g.end(), 0.0f);
  for (std::size_t k = 0; k < samples_per_micro; ++k) {
    const float t = static_cast<float>(s * 1000 + static_cast<int>(i * samples_per_micro + k));
    float x[features], pred = 0.0f, y = 0.0f;
    for (std::size_t f = 0; f < features; ++f) {
      x[f] = std::sin(0.7f * t + static_cast<float>(f));
      pred += w[f] * x[f];
      y += 0.5f * static_cast<float>(f % 3) * x[f];
    }
    const float err = (pred - y) / static_cast<float>(samples_per_micro);
    for (std::size_t f = 0; f < features; ++f) g[f] += err * x[f];
  }
}

std::uint64_t fingerprint(const std::vector<float>& w) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  const auto* b = reinterpret_cast<const unsigned char*>(w.data());
  for (std::size_t i = 0; i < w.size() * sizeof(float); ++i) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

std::vector<float> train_reproducible(ddp::communicator_ref comm) {
  std::vector<float> w(features, 0.0f), g(features);
  ddp::ReproducibleReducer red(comm, micro_batches);
  red.add(g);
  red.build();
  for (int s = 0; s < steps; ++s) {
    red.begin();
    for (std::size_t i : red.pending()) {  // this rank's micro-batches, by global index
      micro_gradient(s, i, w, g);
      red.accumulate(i);
    }
    red.finalize();  // g = mean over all 8 micro-batches, the same bits at any world size
    for (std::size_t f = 0; f < features; ++f) w[f] -= lr * g[f];
  }
  return w;
}

std::vector<float> train_default(ddp::communicator_ref comm) {
  std::vector<float> w(features, 0.0f), g(features), sum(features);
  ddp::Bucketer grads(comm);
  grads.add(sum);
  grads.build();
  const ddp::item_range mine = ddp::contiguous_share(micro_batches, comm.size(), comm.rank());
  for (int s = 0; s < steps; ++s) {
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (std::size_t i = mine.first; i < mine.last; ++i) {
      micro_gradient(s, i, w, g);
      for (std::size_t f = 0; f < features; ++f) sum[f] += g[f];
    }
    for (auto& x : sum) x *= static_cast<float>(comm.size()) / static_cast<float>(micro_batches);
    grads.mark_ready(0);
    grads.finalize();  // the average over ranks of the scaled sums: the mean, rounded per DP
    for (std::size_t f = 0; f < features; ++f) w[f] -= lr * sum[f];
  }
  return w;
}

void run(ddp::communicator_ref comm) {
  const auto w = train_reproducible(comm);
  const auto d = train_default(comm);
  if (comm.rank() != 0) return;
  std::vector<float> w1, d1;
  ddp::local::run(1, [&](ddp::local::communicator& alone) {  // the same training on one rank
    w1 = train_reproducible(alone);
    d1 = train_default(alone);
  });
  const bool same = w == w1;
  std::printf("DP=%d reproducible: %016llx, DP=1: %016llx: identical at any world size: %s\n", comm.size(),
              static_cast<unsigned long long>(fingerprint(w)), static_cast<unsigned long long>(fingerprint(w1)),
              same ? "yes" : "NO");
  std::printf("DP=%d default Bucketer path: %016llx, DP=1: %016llx (%s)\n", comm.size(),
              static_cast<unsigned long long>(fingerprint(d)), static_cast<unsigned long long>(fingerprint(d1)),
              d == d1 ? "the same bits" : "different bits");
  if (!same) throw std::runtime_error("the reproducible reduction gave different bits");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc > 2 && std::strcmp(argv[1], "--threads") == 0) {
      ddp::local::run(std::atoi(argv[2]), [](ddp::local::communicator& c) { run(c); });
      return 0;
    }
    ddp::mpi::environment env(&argc, &argv);
    auto comm = ddp::mpi::communicator::world();
    run(comm);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "reproducible_training: %s\n", e.what());
    return 1;
  }
}
