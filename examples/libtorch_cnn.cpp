// Data-parallel training of a small CNN with BatchNorm, written in libtorch, through <ddp/torch.hpp>.
//
//   mpiexec -n 2 ./libtorch_cnn            (MPI processes)
//   ./libtorch_cnn --threads 2             (the same, as threads of one process)
//   ./libtorch_cnn --reference 2           (one process, no ddp at all: see below)
//
// The model is libtorch's own (torch::nn::Conv2d, BatchNorm2d, Linear, torch::optim::SGD); ddp
// only sees it through register_module: the parameters' gradients go to a Bucketer, which libtorch's
// autograd drives through AccumulateGrad post hooks (the buckets are averaged while backward()
// still runs), and the BatchNorm statistics go to a BufferReducer (running mean and variance:
// mean over ranks; num_batches_tracked: broadcast).
//
// Each step, the global batch of 32 synthetic images is split into one contiguous slice per rank.
// At the end every rank prints a fingerprint (FNV-1a over the bytes of every parameter and buffer).
//
// --reference N computes the same thing in one process with N model replicas and no communication:
// replica r runs forward/backward on slice r with the same kernels and shapes as rank r, the
// gradients are averaged as the Bucketer does (each times 1/N, then summed in rank order) and the
// BatchNorm statistics as the BufferReducer does (summed, divided by N; the counter taken from
// replica 0). Its fingerprint equals the distributed runs' bit for bit: the test
// example.libtorch_cnn.bit_identical compares them (docs/torch.md says what that promises).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

// First: libtorch 1.13's headers need c10::IValue complete before <ATen/core/List.h> under
// clang++ -std=c++20 (pytorch/pytorch#93978); <ddp/torch.hpp> includes it first as well.
#include <ATen/core/ivalue.h>
// (then the rest)
#include <torch/torch.h>

#include <ddp/bucketer.hpp>
#include <ddp/buffer_reducer.hpp>
#include <ddp/local.hpp>
#include <ddp/mpi.hpp>
#include <ddp/torch.hpp>

namespace {

constexpr int classes = 4, side = 12, epochs = 4, steps_per_epoch = 16;
constexpr std::int64_t global_batch = 32;
constexpr double lr = 0.05, momentum = 0.9;

struct CnnImpl : torch::nn::Module {
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  torch::nn::Linear fc{nullptr};

  CnnImpl() {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 8, 3).padding(1)));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(8));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 16, 3).padding(1)));
    bn2 = register_module("bn2", torch::nn::BatchNorm2d(16));
    fc = register_module("fc", torch::nn::Linear(16, classes));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(bn1(conv1(x))), 2);  // 8 x 6 x 6
    x = torch::relu(bn2(conv2(x)));                        // 16 x 6 x 6
    x = torch::adaptive_avg_pool2d(x, {1, 1}).flatten(1);  // 16
    return fc(x);
  }
};
TORCH_MODULE(Cnn);

// The same initial parameters everywhere: libtorch's default initialisation from a fixed seed.
// libtorch's generator is global, so threads (--threads, --reference) take turns.
Cnn make_model() {
  static std::mutex m;
  std::lock_guard lk(m);
  torch::manual_seed(20261122);
  return Cnn();
}

std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
float uniform(std::uint64_t key) { return static_cast<float>(splitmix(key) >> 40) / 16777216.0f; }  // [0, 1)

// Sample i: noise, plus a bright 3x3 blob in the quadrant that is its label.
struct batch {
  torch::Tensor x, y;
};
batch make_batch(std::int64_t first, std::int64_t n) {
  std::vector<float> pixels(static_cast<std::size_t>(n * side * side));
  std::vector<std::int64_t> labels(static_cast<std::size_t>(n));
  for (std::int64_t s = 0; s < n; ++s) {
    const auto i = static_cast<std::uint64_t>(first + s);
    const int label = static_cast<int>(splitmix(i) % classes);
    const int r0 = (label / 2) * 6 + static_cast<int>(splitmix(i + 7) % 4),
              c0 = (label % 2) * 6 + static_cast<int>(splitmix(i + 9) % 4);
    float* img = pixels.data() + s * side * side;
    for (int p = 0; p < side * side; ++p) img[p] = uniform(i * 1000 + static_cast<std::uint64_t>(p)) - 0.5f;
    for (int r = r0; r < r0 + 3; ++r) {
      for (int c = c0; c < c0 + 3; ++c) img[r * side + c] += 2.0f;
    }
    labels[static_cast<std::size_t>(s)] = label;
  }
  return {torch::from_blob(pixels.data(), {n, 1, side, side}, torch::kFloat).clone(),
          torch::from_blob(labels.data(), {n}, torch::kLong).clone()};
}

// Rank r's slice of global step `step`.
batch slice(int step, int rank, int ranks) {
  const std::int64_t per_rank = global_batch / ranks;
  return make_batch(static_cast<std::int64_t>(step) * global_batch + rank * per_rank, per_rank);
}

std::uint64_t fingerprint(Cnn& net) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&](const torch::Tensor& t) {
    const auto* bytes = static_cast<const unsigned char*>(t.data_ptr());
    for (std::size_t i = 0; i < static_cast<std::size_t>(t.nbytes()); ++i) h = (h ^ bytes[i]) * 0x100000001b3ull;
  };
  for (const auto& p : net->named_parameters()) mix(p.value());
  for (const auto& b : net->named_buffers()) mix(b.value());
  return h;
}

void check_ranks(int ranks) {
  if (ranks < 1 || global_batch % ranks != 0) {
    throw std::invalid_argument("the global batch of " + std::to_string(global_batch) + " must split evenly over " +
                                std::to_string(ranks) + " ranks");
  }
}

void train(ddp::communicator_ref comm) {
  const int rank = comm.rank(), size = comm.size();
  check_ranks(size);
  Cnn net = make_model();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(lr).momentum(momentum));

  ddp::libtorch::hook_registry hooks;  // declared first: it must outlive the Bucketer
  std::size_t hooks_while_training = 0;
  {
    ddp::Bucketer grads(comm, ddp::bucketing::size_capped{.cap_bytes = 2048, .small_bucket_bytes = 512});
    ddp::BufferReducer buffers(comm);  // default strategy: broadcast from rank 0
    const auto reg = ddp::libtorch::register_module(*net, grads, hooks, buffers);
    grads.build();
    grads.attach(hooks);            // backward() now calls grads.mark_ready(i) for each parameter
    grads.broadcast_parameters(0);  // as DDP's constructor does (the replicas start equal here anyway)
    buffers.build();
    hooks_while_training = hooks.live_hooks();
    if (rank == 0) {
      std::printf(
          "libtorch_cnn: %d ranks, global batch %lld (%lld per rank), %zu parameters in %zu buckets, "
          "%zu buffers in %zu collectives per sync:",
          size, static_cast<long long>(global_batch), static_cast<long long>(global_batch / size),
          reg.parameters.size(), grads.layout().size(), reg.buffers.size(), buffers.stats().collectives_per_sync);
      for (const auto& b : reg.buffers) std::printf(" %s=%s", b.name.c_str(), b.strategy.c_str());
      std::printf("\n");
    }

    int step = 0;
    for (int epoch = 1; epoch <= epochs; ++epoch) {
      std::vector<double> sums{0.0, 0.0};  // loss, correct
      for (int s = 0; s < steps_per_epoch; ++s, ++step) {
        buffers.sync();  // before forward, like DDP: BatchNorm statistics agree across ranks
        const batch b = slice(step, rank, size);
        opt.zero_grad();  // in place (libtorch 1.x): the Bucketer and the hooks bound this memory
        const torch::Tensor out = net->forward(b.x);
        const torch::Tensor loss = torch::nn::functional::cross_entropy(out, b.y);
        loss.backward();   // buckets are averaged as the hooks fire, last layer first
        grads.finalize();  // every .grad() now holds the average over ranks
        opt.step();
        sums[0] += loss.item<double>();
        sums[1] += out.argmax(1).eq(b.y).sum().item<double>();
      }
      comm.allreduce(sums, ddp::reduce_op::sum).wait();
      if (rank == 0) {
        std::printf("epoch %d  loss %.4f  accuracy %.1f%%\n", epoch, sums[0] / (steps_per_epoch * size),
                    100.0 * sums[1] / (steps_per_epoch * global_batch));
      }
    }
    buffers.sync();  // once more, so the statistics of the last step agree too
  }
  const std::size_t hooks_left = hooks.live_hooks();
  std::size_t torch_hooks_left = 0;
  for (const auto& p : net->parameters()) torch_hooks_left += ddp::libtorch::hook_registry::post_hook_count(p);

  std::vector<std::int64_t> mine{static_cast<std::int64_t>(fingerprint(net))}, all(static_cast<std::size_t>(size));
  comm.allgather(ddp::view(mine), ddp::view(all)).wait();
  bool same = true;
  for (const auto f : all) same = same && f == mine[0];
  std::printf(
      "rank %d: %zu autograd hooks while training, %zu left after the Bucketer was destroyed "
      "(libtorch counts %zu)\n",
      rank, hooks_while_training, hooks_left, torch_hooks_left);
  std::printf("rank %d: fingerprint %016llx (parameters and buffers), identical on all %d ranks: %s\n", rank,
              static_cast<unsigned long long>(mine[0]), size, same ? "yes" : "NO");
  if (!same || hooks_left != 0 || torch_hooks_left != 0) throw std::runtime_error("ranks differ, or hooks left behind");
}

// The same computation without ddp (see the file comment).
void reference(int ranks) {
  check_ranks(ranks);
  std::vector<Cnn> replicas;
  std::vector<std::unique_ptr<torch::optim::SGD>> opts;
  for (int r = 0; r < ranks; ++r) {
    replicas.push_back(make_model());
    opts.push_back(std::make_unique<torch::optim::SGD>(replicas.back()->parameters(),
                                                       torch::optim::SGDOptions(lr).momentum(momentum)));
  }
  const auto sync_buffers = [&] {
    torch::NoGradGuard no_grad;
    std::vector<std::vector<torch::Tensor>> bufs;
    for (auto& net : replicas) bufs.push_back(net->buffers());
    for (std::size_t k = 0; k < bufs[0].size(); ++k) {
      if (bufs[0][k].scalar_type() == torch::kLong) {  // num_batches_tracked: broadcast from 0
        for (int r = 1; r < ranks; ++r) bufs[static_cast<std::size_t>(r)][k].copy_(bufs[0][k]);
        continue;
      }
      // running mean/var (f32): summed in rank order, then divided by N, as the backends' avg does
      const auto n = static_cast<std::size_t>(bufs[0][k].numel());
      std::vector<float> mean(n);
      for (int r = 0; r < ranks; ++r) {
        const float* v = bufs[static_cast<std::size_t>(r)][k].data_ptr<float>();
        for (std::size_t i = 0; i < n; ++i) mean[i] = r == 0 ? v[i] : mean[i] + v[i];
      }
      for (std::size_t i = 0; i < n; ++i) mean[i] = mean[i] / static_cast<float>(ranks);
      for (auto& b : bufs) std::memcpy(b[k].data_ptr<float>(), mean.data(), n * sizeof(float));
    }
  };
  const auto average_gradients = [&] {
    const float factor = static_cast<float>(1.0 / ranks);  // what the Bucketer multiplies by
    std::vector<std::vector<torch::Tensor>> params;
    for (auto& net : replicas) params.push_back(net->parameters());
    for (std::size_t k = 0; k < params[0].size(); ++k) {
      const auto n = static_cast<std::size_t>(params[0][k].numel());
      std::vector<float> acc(n);
      for (int r = 0; r < ranks; ++r) {
        const float* g = params[static_cast<std::size_t>(r)][k].grad().data_ptr<float>();
        for (std::size_t i = 0; i < n; ++i) acc[i] = r == 0 ? g[i] * factor : acc[i] + g[i] * factor;
      }
      for (auto& p : params) std::memcpy(p[k].grad().data_ptr<float>(), acc.data(), n * sizeof(float));
    }
  };

  int step = 0;
  for (int epoch = 1; epoch <= epochs; ++epoch) {
    double loss_sum = 0;
    for (int s = 0; s < steps_per_epoch; ++s, ++step) {
      sync_buffers();
      for (int r = 0; r < ranks; ++r) {
        const batch b = slice(step, r, ranks);
        opts[static_cast<std::size_t>(r)]->zero_grad();
        const torch::Tensor loss =
            torch::nn::functional::cross_entropy(replicas[static_cast<std::size_t>(r)]->forward(b.x), b.y);
        loss.backward();
        loss_sum += loss.item<double>();
      }
      average_gradients();
      for (auto& o : opts) o->step();
    }
    std::printf("epoch %d  loss %.4f\n", epoch, loss_sum / (steps_per_epoch * ranks));
  }
  sync_buffers();
  const std::uint64_t f = fingerprint(replicas[0]);
  bool same = true;
  for (auto& net : replicas) same = same && fingerprint(net) == f;
  std::printf(
      "reference (one process, %d replica%s, no communication): fingerprint %016llx (parameters and buffers), "
      "replicas identical: %s\n",
      ranks, ranks == 1 ? "" : "s", static_cast<unsigned long long>(f), same ? "yes" : "NO");
  if (!same) throw std::runtime_error("replicas differ");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    torch::set_num_threads(1);  // one intra-op thread per rank: 2 ranks on 2 cores, deterministic kernels
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
    std::fprintf(stderr, "libtorch_cnn: %s\n", e.what());
    return 1;
  }
}
