// Data-parallel training of a small MLP with a hand-written tensor type.
//
//   mpiexec -n 2 ./train_mlp            (MPI processes; ddp::world(env): shared memory inside a node)
//   ./train_mlp --threads 2             (the same, as threads of one process: no mpirun needed)
//   mpiexec -n 2 ./train_mlp --trace DIR (also write a timeline: DIR/trace.<rank>.json, merged
//                                        into DIR/train_mlp.trace.json; docs/observability.md)
//   ... --slow-rank R                    (rank R sleeps 1 ms in each backward pass: a straggler)
//
// Each rank trains on its own shard of a synthetic regression task. The backward pass marks each
// gradient ready as soon as it is computed (last layer first), so the Bucketer averages the first
// bucket while the earlier layers are still being differentiated. At the end every rank prints a
// fingerprint of its parameters: they are identical on all ranks.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <ddp/ddp.hpp>
#include <ddp/local.hpp>
#include <ddp/mpi.hpp>
#include <ddp/timeline.hpp>

// ---- the trainer's own tensor type: the library has never heard of it ------------------------
namespace tiny {
struct Tensor {
  std::vector<std::size_t> shape;
  std::unique_ptr<float[]> values;

  explicit Tensor(std::vector<std::size_t> s) : shape(std::move(s)), values(new float[numel()]()) {}
  [[nodiscard]] std::size_t numel() const {
    std::size_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
  float& operator[](std::size_t i) { return values[i]; }
  float operator[](std::size_t i) const { return values[i]; }
};
}  // namespace tiny

// The whole integration: four static functions.
template <>
struct ddp::tensor_traits<tiny::Tensor> {
  static void* data(tiny::Tensor& t) { return t.values.get(); }
  static std::size_t size(const tiny::Tensor& t) { return t.numel(); }
  static ddp::dtype dtype(const tiny::Tensor&) { return ddp::dtype::f32; }
  static ddp::device device(const tiny::Tensor&) { return ddp::device::host(); }
};

namespace {

constexpr std::size_t in_dim = 8, hidden = 64, batch = 32;
constexpr int epochs = 5, steps_per_epoch = 40;
constexpr float lr = 0.05f;

struct mlp {
  tiny::Tensor w1{{hidden, in_dim}}, b1{{hidden}}, w2{{1, hidden}}, b2{{1}};
  tiny::Tensor gw1{{hidden, in_dim}}, gb1{{hidden}}, gw2{{1, hidden}}, gb2{{1}};

  explicit mlp(unsigned seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> n(0.0f, 0.3f);
    for (std::size_t i = 0; i < w1.numel(); ++i) w1[i] = n(rng);
    for (std::size_t i = 0; i < w2.numel(); ++i) w2[i] = n(rng);
  }

  // Forward + backward on one batch; `ready(i)` is called as gradient i becomes final.
  template <class Ready>
  float step(const std::vector<float>& x, const std::vector<float>& y, Ready&& ready, bool slow = false) {
    std::vector<float> h(batch * hidden), out(batch);
    for (std::size_t s = 0; s < batch; ++s) {
      for (std::size_t j = 0; j < hidden; ++j) {
        float a = b1[j];
        for (std::size_t k = 0; k < in_dim; ++k) a += w1[j * in_dim + k] * x[s * in_dim + k];
        h[s * hidden + j] = std::tanh(a);
      }
      float o = b2[0];
      for (std::size_t j = 0; j < hidden; ++j) o += w2[j] * h[s * hidden + j];
      out[s] = o;
    }
    float loss = 0;
    std::vector<float> dout(batch);
    for (std::size_t s = 0; s < batch; ++s) {
      dout[s] = (out[s] - y[s]) / static_cast<float>(batch);
      loss += 0.5f * (out[s] - y[s]) * (out[s] - y[s]) / static_cast<float>(batch);
    }
    // Backward, last layer first: its gradients are ready before the first layer's.
    gb2[0] = 0;
    for (std::size_t j = 0; j < hidden; ++j) gw2[j] = 0;
    for (std::size_t s = 0; s < batch; ++s) {
      gb2[0] += dout[s];
      for (std::size_t j = 0; j < hidden; ++j) gw2[j] += dout[s] * h[s * hidden + j];
    }
    ready(3);
    ready(2);
    if (slow) std::this_thread::sleep_for(std::chrono::milliseconds(1));  // --slow-rank: a straggler
    for (std::size_t i = 0; i < gw1.numel(); ++i) gw1[i] = 0;
    for (std::size_t j = 0; j < hidden; ++j) gb1[j] = 0;
    for (std::size_t s = 0; s < batch; ++s) {
      for (std::size_t j = 0; j < hidden; ++j) {
        const float dh = dout[s] * w2[j] * (1 - h[s * hidden + j] * h[s * hidden + j]);
        gb1[j] += dh;
        for (std::size_t k = 0; k < in_dim; ++k) gw1[j * in_dim + k] += dh * x[s * in_dim + k];
      }
    }
    ready(1);
    ready(0);
    return loss;
  }

  void sgd() {
    auto upd = [](tiny::Tensor& p, const tiny::Tensor& g) {
      for (std::size_t i = 0; i < p.numel(); ++i) p[i] -= lr * g[i];
    };
    upd(w1, gw1), upd(b1, gb1), upd(w2, gw2), upd(b2, gb2);
  }

  [[nodiscard]] std::uint64_t fingerprint() const {
    std::uint64_t h = 0xcbf29ce484222325ull;
    for (const tiny::Tensor* t : {&w1, &b1, &w2, &b2}) {
      const auto* bytes = reinterpret_cast<const unsigned char*>(t->values.get());
      for (std::size_t i = 0; i < t->numel() * sizeof(float); ++i) h = (h ^ bytes[i]) * 0x100000001b3ull;
    }
    return h;
  }
};

void train(ddp::communicator_ref comm, const std::string& trace_dir, int slow_rank) {
  const int rank = comm.rank(), size = comm.size();
  mlp model(42);  // same initial parameters everywhere (or broadcast them: grads.broadcast_parameters(0))
  // With a trace, every step also tells every rank which rank was slowest (one tiny allgather).
  ddp::Bucketer grads(comm, ddp::bucketing::size_capped{.cap_bytes = 1024, .small_bucket_bytes = 512},
                      {.straggler_every = trace_dir.empty() ? 0u : 1u});
  grads.add(model.w1, model.gw1);
  grads.add(model.b1, model.gb1);
  grads.add(model.w2, model.gw2);
  grads.add(model.b2, model.gb2);
  grads.build();
  std::optional<ddp::timeline::recorder> timeline;  // one per rank; nothing is recorded without --trace
  if (!trace_dir.empty()) {
    timeline.emplace(rank);
    timeline->synchronize(comm);  // a common time origin for the merged view
    grads.set_recorder(&*timeline);
  }
  if (rank == 0) {
    std::printf("training a %zu-%zu-1 MLP on %d ranks, %zu gradient buckets\n", in_dim, hidden, size,
                grads.layout().size());
  }

  std::mt19937 data_rng(1000u + static_cast<unsigned>(rank));  // this rank's shard
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(batch * in_dim), y(batch);
  const auto start = std::chrono::steady_clock::now();
  for (int epoch = 1; epoch <= epochs; ++epoch) {
    std::vector<float> loss_sum{0.0f};
    for (int s = 0; s < steps_per_epoch; ++s) {
      for (std::size_t i = 0; i < batch; ++i) {
        float t = 0;
        for (std::size_t k = 0; k < in_dim; ++k) t += (x[i * in_dim + k] = u(data_rng));
        y[i] = std::sin(t);
      }
      loss_sum[0] += model.step(
          x, y, [&](std::size_t i) { grads.mark_ready(i); }, rank == slow_rank);
      grads.finalize();  // averaged gradients are in place
      model.sgd();
    }
    comm.allreduce(loss_sum, ddp::reduce_op::avg).wait();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (rank == 0) {
      std::printf("epoch %d  loss %.5f  %.0f samples/s\n", epoch, loss_sum[0] / steps_per_epoch,
                  epoch * steps_per_epoch * batch * size / secs);
    }
  }
  const auto& st = grads.last_step();
  if (rank == 0) {
    std::printf("last step: %zu collectives, backward %.3f ms, finalize waited %.3f ms\n", st.collectives,
                st.backward_ms, st.finalize_wait_ms);
  }
  if (timeline) {
    if (rank == 0) std::printf("last step: %s\n", st.straggler.describe().c_str());
    const std::filesystem::path dir(trace_dir);
    timeline->write_file((dir / ("trace." + std::to_string(rank) + ".json")).string());
    comm.barrier().wait();
    if (rank == 0) {
      std::vector<std::string> files;
      for (int r = 0; r < size; ++r) files.push_back((dir / ("trace." + std::to_string(r) + ".json")).string());
      ddp::timeline::merge_files(files, (dir / "train_mlp.trace.json").string());
      std::printf("timeline: %s (open in https://ui.perfetto.dev or chrome://tracing)\n",
                  (dir / "train_mlp.trace.json").string().c_str());
    }
  }
  std::vector<std::int64_t> mine{static_cast<std::int64_t>(model.fingerprint())};
  std::vector<std::int64_t> all(static_cast<std::size_t>(size));
  comm.allgather(ddp::view(mine), ddp::view(all)).wait();
  bool same = true;
  for (auto f : all) same = same && f == mine[0];
  std::printf("rank %d: parameter fingerprint %016llx, identical on all %d ranks: %s\n", rank,
              static_cast<unsigned long long>(mine[0]), size, same ? "yes" : "NO");
  if (!same) throw std::runtime_error("parameters differ across ranks");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::string trace_dir;
    int threads = 0, slow_rank = -1;
    for (int i = 1; i + 1 < argc; ++i) {
      if (std::strcmp(argv[i], "--trace") == 0) trace_dir = argv[i + 1];
      if (std::strcmp(argv[i], "--threads") == 0) threads = std::atoi(argv[i + 1]);
      if (std::strcmp(argv[i], "--slow-rank") == 0) slow_rank = std::atoi(argv[i + 1]);
    }
    if (!trace_dir.empty()) std::filesystem::create_directories(trace_dir);
    if (threads > 0) {
      ddp::local::run(threads, [&](ddp::local::communicator& c) { train(c, trace_dir, slow_rank); });
      return 0;
    }
    ddp::mpi::environment env(&argc, &argv);
    auto comm = ddp::world(env);  // shared memory inside a node, TCP between nodes
    train(comm, trace_dir, slow_rank);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_mlp: %s\n", e.what());
    return 1;
  }
}
