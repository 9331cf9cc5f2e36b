// Training across a slow link with DiLoCo: each replica takes H local SGD steps on its own shard
// of the data, then the replicas average their outer gradients (the change since the last outer
// step) and take one outer Nesterov step together. One exchange per H steps instead of one per
// step (docs/local-steps.md).
//
//   ./diloco_training --threads 2             (replicas as threads of one process)
//   mpiexec -n 2 ./diloco_training            (MPI processes; ddp::world(env))
//   ... --mode sync|localsgd|diloco|streaming (default diloco)
//   ... --sync-every H                         (inner steps per outer step, default 20)
//   ... --wire native|bf16|int8                (how outer gradients travel: diloco, streaming)
//   ... --fragments F --delay TAU              (streaming: default 2 fragments, 1 step of overlap)
//   ... --outer-steps N                        (default 20)
//
// At the end every rank checks that the replicas hold the same global parameters, and rank 0
// prints the loss on held-out data and what the cost model says each rank sent.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <ddp/ddp.hpp>
#include <ddp/local.hpp>
#include <ddp/local_steps.hpp>
#include <ddp/mpi.hpp>

namespace {

constexpr std::size_t in_dim = 8, hidden = 32, batch = 32;
constexpr float inner_lr = 0.05f;

struct options {
  std::string mode = "diloco";
  int sync_every = 20, outer_steps = 20, fragments = 2, delay = 1;
  ddp::outer_wire wire = ddp::outer_wire::native;
};

// A 2-layer MLP on plain std::vectors: ddp::view() takes them as they are.
struct mlp {
  std::vector<float> w1, b1, w2, b2;      // parameters
  std::vector<float> gw1, gb1, gw2, gb2;  // their gradients

  explicit mlp(unsigned seed)
      : w1(hidden * in_dim), b1(hidden), w2(hidden), b2(1), gw1(w1.size()), gb1(hidden), gw2(hidden), gb2(1) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> n(0.0f, 0.3f);
    for (float& v : w1) v = n(rng);
    for (float& v : w2) v = n(rng);
  }

  std::vector<ddp::tensor_view> params() { return {ddp::view(w1), ddp::view(b1), ddp::view(w2), ddp::view(b2)}; }
  std::vector<ddp::tensor_view> grads() { return {ddp::view(gw1), ddp::view(gb1), ddp::view(gw2), ddp::view(gb2)}; }

  // Mean squared error on (x, y); with `backward`, also its gradients.
  float loss(const std::vector<float>& x, const std::vector<float>& y, bool backward) {
    const std::size_t n = y.size();
    float total = 0;
    if (backward) {
      for (auto* g : {&gw1, &gb1, &gw2, &gb2}) std::fill(g->begin(), g->end(), 0.0f);
    }
    std::vector<float> h(hidden);
    for (std::size_t s = 0; s < n; ++s) {
      float out = b2[0];
      for (std::size_t j = 0; j < hidden; ++j) {
        float a = b1[j];
        for (std::size_t k = 0; k < in_dim; ++k) a += w1[j * in_dim + k] * x[s * in_dim + k];
        h[j] = std::tanh(a);
        out += w2[j] * h[j];
      }
      const float err = out - y[s];
      total += 0.5f * err * err / static_cast<float>(n);
      if (!backward) continue;
      const float dout = err / static_cast<float>(n);
      gb2[0] += dout;
      for (std::size_t j = 0; j < hidden; ++j) {
        gw2[j] += dout * h[j];
        const float dh = dout * w2[j] * (1 - h[j] * h[j]);
        gb1[j] += dh;
        for (std::size_t k = 0; k < in_dim; ++k) gw1[j * in_dim + k] += dh * x[s * in_dim + k];
      }
    }
    return total;
  }

  void sgd() {  // the inner optimizer: the trainer's own
    auto upd = [](std::vector<float>& p, const std::vector<float>& g) {
      for (std::size_t i = 0; i < p.size(); ++i) p[i] -= inner_lr * g[i];
    };
    upd(w1, gw1), upd(b1, gb1), upd(w2, gw2), upd(b2, gb2);
  }
};

// Samples of y = sin(sum of x), x uniform in [-1, 1]^8.
void sample(std::mt19937& rng, std::size_t n, std::vector<float>& x, std::vector<float>& y) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  x.resize(n * in_dim);
  y.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    float t = 0;
    for (std::size_t k = 0; k < in_dim; ++k) t += (x[i * in_dim + k] = u(rng));
    y[i] = std::sin(t);
  }
}

std::uint64_t fingerprint(const std::vector<ddp::tensor_view>& ts) {
  std::uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a over the bytes
  for (const ddp::tensor_view& t : ts) {
    const auto* bytes = static_cast<const unsigned char*>(t.data);
    for (std::size_t i = 0; i < t.bytes(); ++i) h = (h ^ bytes[i]) * 0x100000001b3ull;
  }
  return h;
}

void train(ddp::communicator_ref comm, const options& o) {
  const int rank = comm.rank(), size = comm.size();
  mlp model(42u + static_cast<unsigned>(rank));  // different on every rank: the components broadcast rank 0's
  const std::vector<ddp::tensor_view> params = model.params();
  const ddp::outer_sgd outer{.lr = 0.7, .momentum = 0.9, .nesterov = true};  // the DiLoCo paper's

  // One of the four ways of synchronising; `sync_step` runs after every inner optimizer step.
  std::optional<ddp::local_sgd> local;
  std::optional<ddp::diloco<>> dl;
  std::optional<ddp::streaming_diloco<>> streaming;
  std::function<void()> sync_step;
  ddp::sync_plan plan{.sync_every = o.sync_every, .wire = o.wire};  // for the cost model below
  if (o.mode == "sync") {
    comm.broadcast(params, 0).wait();
    sync_step = [] {};  // the gradients are averaged before the optimizer step instead (below)
    plan.mode = ddp::sync_mode::data_parallel;
  } else if (o.mode == "localsgd") {
    local.emplace(comm, params, ddp::local_sgd_options{.sync_every = o.sync_every});
    sync_step = [&] { local->step(); };
    plan.mode = ddp::sync_mode::local_sgd;
  } else if (o.mode == "diloco") {
    dl.emplace(comm, params, ddp::diloco_options<>{.sync_every = o.sync_every, .outer = outer, .wire = o.wire});
    sync_step = [&] { dl->step(); };
    plan.mode = ddp::sync_mode::diloco;
  } else {
    streaming.emplace(
        comm, params,
        ddp::streaming_diloco_options<>{
            .sync_every = o.sync_every, .fragments = o.fragments, .delay = o.delay, .outer = outer, .wire = o.wire});
    sync_step = [&] { streaming->step(); };
    plan.mode = ddp::sync_mode::streaming_diloco;
    plan.fragments = o.fragments;
    plan.delay = o.delay;
  }
  // The loss on held-out data (the same on every rank), averaged over the replicas.
  std::vector<float> test_x, test_y;
  std::mt19937 held_out(7);
  sample(held_out, 512, test_x, test_y);
  auto test_loss = [&] {
    std::vector<float> l{model.loss(test_x, test_y, /*backward=*/false)};
    comm.allreduce(l, ddp::reduce_op::avg).wait();
    return l[0];
  };
  const float initial_loss = test_loss();
  if (rank == 0) {
    std::printf("%s: %d replicas, a %zu-%zu-1 MLP, %d outer steps of %d inner SGD steps\n", ddp::describe(plan).c_str(),
                size, in_dim, hidden, o.outer_steps, o.sync_every);
  }

  std::mt19937 shard(1000u + static_cast<unsigned>(rank));  // this replica's own data
  std::vector<float> x, y;
  const std::vector<ddp::tensor_view> grads = model.grads();
  for (int outer_step = 1; outer_step <= o.outer_steps; ++outer_step) {
    std::vector<float> loss_sum{0.0f};
    for (int s = 0; s < o.sync_every; ++s) {
      sample(shard, batch, x, y);
      loss_sum[0] += model.loss(x, y, /*backward=*/true);
      if (o.mode == "sync") ddp::allreduce_average(comm, grads, size).wait();
      model.sgd();
      sync_step();
    }
    comm.allreduce(loss_sum, ddp::reduce_op::avg).wait();  // for printing only: one float
    if (rank == 0) std::printf("outer step %2d  training loss %.5f\n", outer_step, loss_sum[0] / o.sync_every);
  }

  // What every replica must now hold alike: the parameters, or for Streaming DiLoCo (whose
  // fragments took local steps since their last merge) the global state: anchors and momenta.
  const std::uint64_t mine = fingerprint(streaming ? streaming->state() : params);
  std::vector<std::int64_t> all(static_cast<std::size_t>(size));
  std::vector<std::int64_t> own{static_cast<std::int64_t>(mine)};
  comm.allgather(ddp::view(own), ddp::view(all)).wait();
  for (const std::int64_t f : all) {
    if (f != own[0]) throw std::runtime_error("rank " + std::to_string(rank) + ": replicas hold different parameters");
  }

  const float final_loss = test_loss();
  if (!(final_loss < initial_loss / 2)) {
    throw std::runtime_error("the held-out loss went from " + std::to_string(initial_loss) + " to " +
                             std::to_string(final_loss) + ": the model did not learn");
  }
  const ddp::training_setup setup{
      .parameters = static_cast<double>(model.w1.size() + model.b1.size() + model.w2.size() + model.b2.size()),
      .dtype_bytes = 4,
      .tensors = params.size(),
      .replicas = size};
  const double inner_steps = static_cast<double>(o.outer_steps) * o.sync_every;
  const double sent = ddp::cost_of(setup, plan).bytes_per_step * inner_steps;
  const double sent_dp = ddp::cost_of(setup, {.mode = ddp::sync_mode::data_parallel}).bytes_per_step * inner_steps;
  if (rank == 0) {
    std::printf(
        "final loss %.4f on held-out data (initial %.4f); bytes sent per rank %.0f (%.1f%% of data "
        "parallel's), per the cost model\n",
        final_loss, initial_loss, sent, sent_dp > 0 ? 100 * sent / sent_dp : 100.0);
    std::printf("replicas agree: fingerprint %016llx on all %d ranks\n", static_cast<unsigned long long>(mine), size);
  }
}

options parse(int argc, char** argv, int& threads) {
  options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--threads") {
      threads = std::atoi(v.c_str());
    } else if (k == "--mode") {
      if (v != "sync" && v != "localsgd" && v != "diloco" && v != "streaming") {
        throw std::invalid_argument("--mode " + v + ": sync, localsgd, diloco or streaming");
      }
      o.mode = v;
    } else if (k == "--sync-every") {
      o.sync_every = std::atoi(v.c_str());
    } else if (k == "--outer-steps") {
      o.outer_steps = std::atoi(v.c_str());
    } else if (k == "--fragments") {
      o.fragments = std::atoi(v.c_str());
    } else if (k == "--delay") {
      o.delay = std::atoi(v.c_str());
    } else if (k == "--wire") {
      if (v == "bf16") {
        o.wire = ddp::outer_wire::bf16;
      } else if (v == "int8") {
        o.wire = ddp::outer_wire::int8;
      } else if (v != "native") {
        throw std::invalid_argument("--wire " + v + ": native, bf16 or int8");
      }
    } else {
      throw std::invalid_argument("unknown option " + k);
    }
  }
  if (o.wire != ddp::outer_wire::native && o.mode != "diloco" && o.mode != "streaming") {
    throw std::invalid_argument("--wire applies to --mode diloco and streaming");
  }
  if (o.sync_every < 1 || o.outer_steps < 1) throw std::invalid_argument("--sync-every and --outer-steps must be >= 1");
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    int threads = 0;
    const options o = parse(argc, argv, threads);
    if (threads > 0) {
      ddp::local::run(threads, [&](ddp::local::communicator& c) { train(c, o); });
      return 0;
    }
    ddp::mpi::environment env(&argc, &argv);
    auto comm = ddp::world(env);  // shared memory inside a node, TCP between nodes
    train(comm, o);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "diloco_training: %s\n", e.what());
    return 1;
  }
}
