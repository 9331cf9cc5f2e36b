// Data-parallel linear regression with Eigen matrices, through <ddp/eigen.hpp>.
//
//   mpiexec -n 2 ./eigen_regression        (MPI processes)
//   ./eigen_regression --threads 2         (the same, as threads of one process)
//   ./eigen_regression --reference 2       (one process, no ddp: every rank's gradient, averaged by hand)
//
// The parameters are an Eigen::MatrixXf W and an Eigen::VectorXf b, the gradients too: with
// <ddp/eigen.hpp> they are ddp tensors, registered with a Bucketer as they are. Each rank fits
// y = W x + b on its own samples with Eigen's matrix products; the Bucketer averages the gradients.
// At the end every rank prints a fingerprint of W and b; --reference prints the same one (the test
// example.eigen_regression.bit_identical compares them; docs/eigen.md).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

#include <Eigen/Core>

#include <ddp/bucketer.hpp>
#include <ddp/eigen.hpp>
#include <ddp/local.hpp>
#include <ddp/mpi.hpp>

namespace {

constexpr Eigen::Index in = 16, out = 4, per_rank = 32;
constexpr int epochs = 5, steps_per_epoch = 25;
constexpr float lr = 0.1f;

struct model {
  Eigen::MatrixXf W = Eigen::MatrixXf::Zero(out, in), gW = Eigen::MatrixXf::Zero(out, in);
  Eigen::VectorXf b = Eigen::VectorXf::Zero(out), gb = Eigen::VectorXf::Zero(out);

  // Gradients of the mean squared error over the columns of X; returns the loss.
  float gradients(const Eigen::MatrixXf& X, const Eigen::MatrixXf& Y) {
    const Eigen::MatrixXf E = ((W * X).colwise() + b - Y) / static_cast<float>(X.cols());
    gW = E * X.transpose();
    gb = E.rowwise().sum();
    return 0.5f * E.squaredNorm() * static_cast<float>(X.cols());
  }
  void sgd() {
    W -= lr * gW;
    b -= lr * gb;
  }
  [[nodiscard]] std::uint64_t fingerprint() const {
    std::uint64_t h = 0xcbf29ce484222325ull;
    auto mix = [&](const float* p, Eigen::Index n) {
      const auto* bytes = reinterpret_cast<const unsigned char*>(p);
      for (std::size_t i = 0; i < static_cast<std::size_t>(n) * sizeof(float); ++i)
        h = (h ^ bytes[i]) * 0x100000001b3ull;
    };
    mix(W.data(), W.size());
    mix(b.data(), b.size());
    return h;
  }
};

// The task: a fixed W*, b*; rank r's samples at step s are a deterministic function of (s, r).
void samples(int step, int rank, Eigen::MatrixXf& X, Eigen::MatrixXf& Y) {
  X.resize(in, per_rank);
  std::uint64_t state = 0x9e3779b97f4a7c15ull * static_cast<std::uint64_t>(step * 1009 + rank + 1);
  for (Eigen::Index i = 0; i < X.size(); ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    X.data()[i] = static_cast<float>(state >> 40) / 8388608.0f - 1.0f;  // [-1, 1)
  }
  Eigen::MatrixXf W_true(out, in);
  for (Eigen::Index o = 0; o < out; ++o) {
    for (Eigen::Index i = 0; i < in; ++i) W_true(o, i) = static_cast<float>((o * 5 + i * 3) % 7) / 7.0f - 0.4f;
  }
  Y = (W_true * X).array() + 0.25f;
}

void train(ddp::communicator_ref comm) {
  const int rank = comm.rank(), size = comm.size();
  model m;
  ddp::Bucketer grads(comm);
  grads.add(m.W, m.gW);  // Eigen matrices are ddp tensors: no conversion, no copy of the model
  grads.add(m.b, m.gb);
  grads.build();
  Eigen::MatrixXf X, Y;
  int step = 0;
  for (int epoch = 1; epoch <= epochs; ++epoch) {
    std::vector<double> loss{0.0};
    for (int s = 0; s < steps_per_epoch; ++s, ++step) {
      samples(step, rank, X, Y);
      loss[0] += m.gradients(X, Y);
      grads.mark_ready(1);  // the bias gradient, then the weights'
      grads.mark_ready(0);
      grads.finalize();  // averaged over ranks, in place in gW and gb
      m.sgd();
    }
    comm.allreduce(loss, ddp::reduce_op::sum).wait();
    if (rank == 0) std::printf("epoch %d  loss %.6f\n", epoch, loss[0] / (steps_per_epoch * per_rank * size));
  }
  std::vector<std::int64_t> mine{static_cast<std::int64_t>(m.fingerprint())}, all(static_cast<std::size_t>(size));
  comm.allgather(ddp::view(mine), ddp::view(all)).wait();
  bool same = true;
  for (const auto f : all) same = same && f == mine[0];
  std::printf("rank %d: b = [%.4f %.4f %.4f %.4f], fingerprint %016llx, identical on all %d ranks: %s\n", rank,
              static_cast<double>(m.b(0)), static_cast<double>(m.b(1)), static_cast<double>(m.b(2)),
              static_cast<double>(m.b(3)), static_cast<unsigned long long>(mine[0]), size, same ? "yes" : "NO");
  if (!same) throw std::runtime_error("parameters differ across ranks");
}

// Without ddp: each rank's gradient times 1/N (the Bucketer's copy into its bucket), summed in rank
// order (what every backend does for 2 ranks, and the local backend for any number).
void reference(int ranks) {
  if (ranks < 1) throw std::invalid_argument("--reference needs at least 1 rank");
  model m;
  const float factor = static_cast<float>(1.0 / ranks);
  Eigen::MatrixXf X, Y, gW(out, in);
  Eigen::VectorXf gb(out);
  int step = 0;
  for (int epoch = 1; epoch <= epochs; ++epoch) {
    for (int s = 0; s < steps_per_epoch; ++s, ++step) {
      for (int r = 0; r < ranks; ++r) {
        samples(step, r, X, Y);
        m.gradients(X, Y);
        if (r == 0) {
          gW = m.gW * factor;
          gb = m.gb * factor;
        } else {
          gW += m.gW * factor;
          gb += m.gb * factor;
        }
      }
      m.gW = gW;
      m.gb = gb;
      m.sgd();
    }
  }
  std::printf("reference (one process, %d rank%s simulated): fingerprint %016llx\n", ranks, ranks == 1 ? "" : "s",
              static_cast<unsigned long long>(m.fingerprint()));
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc > 2 && std::strcmp(argv[1], "--threads") == 0) {
      ddp::local::run(std::atoi(argv[2]), [](ddp::local::communicator& c) { train(c); });
      return 0;
    }
    if (argc > 2 && std::strcmp(argv[1], "--reference") == 0) {
      reference(std::atoi(argv[2]));
      return 0;
    }
    ddp::mpi::environment env(&argc, &argv);
    auto comm = ddp::world(env);  // shared memory inside a node, TCP between nodes
    train(comm);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "eigen_regression: %s\n", e.what());
    return 1;
  }
}
