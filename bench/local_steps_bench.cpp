// Time to a target loss over a slow link (issue #29): synchronous data parallelism, LocalSGD,
// DiLoCo and Streaming DiLoCo train the same small model from the same initial parameters, one
// mode after another in one run, until the held-out loss reaches --target (or a cap). Per mode:
// inner steps to the target, training seconds to it (slowest rank), bytes each rank handed to
// its collectives, and the time as a share of synchronous training's. docs/benchmarks.md.
//
//   ddp-run -n 2 local_steps_bench                                   (one host, no cap)
//   ddp-run --hosts 2 --link-rate 100mbit local_steps_bench          (2 test hosts, capped link)
//   bench/local_steps_hosts.sh                                       (both rates, 2 and 3 hosts)
//
// The model: a 2-layer tanh MLP (128 -> 2048 -> 128 by default: 0.53 M f32 parameters in 4
// tensors) regressing the outputs of a fixed, narrower random teacher MLP on Gaussian inputs;
// every rank draws its own stream of fresh samples (the same stream in every mode), and the
// held-out set is the same on every rank. Inner optimizer: Adam, on every replica. `sync`
// averages the gradients every step (allreduce_average, then Adam); the others register the
// parameters with ddp::local_sgd, ddp::diloco<> or ddp::streaming_diloco<> and call step() after
// each Adam step.
//
// Communicator (--comm): `world` (default) is ddp::world, what a trainer starts from: between
// hosts its node leaders run ddp's sockets ring near the link rate, on a thread of the
// communicator's, so Streaming DiLoCo's exchanges overlap the inner steps. `mpi` is
// ddp::mpi::communicator: its collectives move when tested (Streaming DiLoCo tests at each
// step()), over MPI's TCP path, which reached about half the link rate between test hosts
// (docs/benchmarks.md, "Across test hosts").
//
// Evaluation: `sync` every --eval-every steps, the local modes at every outer step (every H inner
// steps, where LocalSGD and DiLoCo replicas hold the same parameters; Streaming DiLoCo's last
// fragment merges then). The loss is each replica's held-out loss, averaged over replicas. The
// evaluation's time and its one small gather are excluded from the times and the bytes.
//
// Bytes: a forwarding communicator counts the payload of every collective a mode issues
// ("payload MB"), and what a bandwidth-optimal algorithm makes each rank send for it ("sent MB":
// 2 (p-1)/p of an allreduce, p-1 blocks of an allgather). On test hosts, "link tx MB" is what the
// host's interface ($DDP_HOSTS_IFNAME) actually transmitted during the mode, headers and MPI's
// own traffic included (per host, so per rank with one rank per host).
//
// Time per inner step: "ms/step" measured, "compute ms" the part outside the collectives (data,
// forward, backward, Adam; slowest rank), and with --link-gbit "model ms", what the local-steps
// cost model (ddp/local_steps/cost_model.hpp) predicts for that compute on that link.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ddp/average.hpp>
#include <ddp/communicator.hpp>
#include <ddp/local_steps.hpp>
#include <ddp/mpi.hpp>
#include <ddp/world.hpp>

#include "common/cli.hpp"
#include "common/table.hpp"

namespace {

// Forwards to another communicator and sums what every collective issued through it carries.
class counting_communicator {
 public:
  explicit counting_communicator(ddp::communicator_ref inner) : inner_(inner) {}
  [[nodiscard]] int rank() const { return inner_.rank(); }
  [[nodiscard]] int size() const { return inner_.size(); }
  ddp::work allreduce(std::span<const ddp::tensor_view> ts, ddp::reduce_op op) {
    const double b = bytes(ts);
    note(b, 2.0 * (size() - 1) / size() * b);  // reduce-scatter + allgather
    return inner_.allreduce(ts, op);
  }
  ddp::work broadcast(std::span<const ddp::tensor_view> ts, int root) {
    const double b = bytes(ts);
    note(b, static_cast<double>(size() - 1) / size() * b);  // scatter + allgather
    return inner_.broadcast(ts, root);
  }
  ddp::work allgather(ddp::tensor_view in, ddp::tensor_view out) {
    note(static_cast<double>(in.bytes()), static_cast<double>(size() - 1) * static_cast<double>(in.bytes()));
    return inner_.allgather(in, out);
  }
  ddp::work reduce_scatter(ddp::tensor_view in, ddp::tensor_view out, ddp::reduce_op op) {
    const auto b = static_cast<double>(in.bytes());
    note(b, static_cast<double>(size() - 1) / size() * b);
    return inner_.reduce_scatter(in, out, op);
  }
  ddp::work barrier() { return inner_.barrier(); }
  void abort() noexcept { inner_.abort(); }

  [[nodiscard]] double payload_bytes() const noexcept { return payload_; }
  [[nodiscard]] double sent_bytes() const noexcept { return sent_; }
  [[nodiscard]] std::int64_t collectives() const noexcept { return calls_; }

 private:
  static double bytes(std::span<const ddp::tensor_view> ts) {
    double b = 0;
    for (const ddp::tensor_view& t : ts) b += static_cast<double>(t.bytes());
    return b;
  }
  void note(double payload, double sent) {
    payload_ += payload;
    sent_ += sent;
    ++calls_;
  }
  ddp::communicator_ref inner_;
  double payload_ = 0, sent_ = 0;
  std::int64_t calls_ = 0;
};

struct shape {
  std::size_t in, hidden, out;
};

// 8 partial sums: the compiler vectorises this without reassociating a single sum (no -ffast-math).
float dot(const float* a, const float* b, std::size_t n) {
  float acc[8] = {};
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (std::size_t l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  }
  float s = 0;
  for (; i < n; ++i) s += a[i] * b[i];
  for (const float v : acc) s += v;
  return s;
}

void axpy(float a, const float* x, float* y, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// y = W2 tanh(W1 x + b1) + b2, on plain vectors; W1 is hidden x in and W2 out x hidden, row-major.
struct mlp {
  shape s;
  std::vector<float> w1, b1, w2, b2;      // parameters
  std::vector<float> gw1, gb1, gw2, gb2;  // their gradients

  mlp(shape sh, std::uint64_t seed, float gain)
      : s(sh),
        w1(sh.hidden * sh.in),
        b1(sh.hidden),
        w2(sh.out * sh.hidden),
        b2(sh.out),
        gw1(w1.size()),
        gb1(b1.size()),
        gw2(w2.size()),
        gb2(b2.size()) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> n1(0.0f, gain / std::sqrt(static_cast<float>(sh.in)));
    std::normal_distribution<float> n2(0.0f, 1.0f / std::sqrt(static_cast<float>(sh.hidden)));
    for (float& v : w1) v = n1(rng);
    for (float& v : w2) v = n2(rng);
  }

  [[nodiscard]] std::size_t parameters() const { return w1.size() + b1.size() + w2.size() + b2.size(); }
  std::vector<ddp::tensor_view> params() { return {ddp::view(w1), ddp::view(b1), ddp::view(w2), ddp::view(b2)}; }
  std::vector<ddp::tensor_view> grads() { return {ddp::view(gw1), ddp::view(gb1), ddp::view(gw2), ddp::view(gb2)}; }

  // The outputs for n inputs x (n x in) into y (n x out).
  void forward(const std::vector<float>& x, std::size_t n, std::vector<float>& y) const {
    std::vector<float> h(s.hidden);
    y.resize(n * s.out);
    for (std::size_t i = 0; i < n; ++i) hidden_and_output(&x[i * s.in], h.data(), &y[i * s.out]);
  }

  // Half the mean squared error over every output of the n samples; with `backward`, also its
  // gradients (overwritten).
  double loss(const std::vector<float>& x, const std::vector<float>& target, std::size_t n, bool backward) {
    if (backward) {
      for (auto* g : {&gw1, &gb1, &gw2, &gb2}) std::fill(g->begin(), g->end(), 0.0f);
    }
    std::vector<float> h(s.hidden), y(s.out), dh(s.hidden);
    const float scale = 1.0f / static_cast<float>(n * s.out);
    double total = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const float* xi = &x[i * s.in];
      hidden_and_output(xi, h.data(), y.data());
      std::fill(dh.begin(), dh.end(), 0.0f);
      for (std::size_t o = 0; o < s.out; ++o) {
        const float err = y[o] - target[i * s.out + o];
        total += 0.5 * static_cast<double>(err) * err;
        if (!backward) continue;
        const float dy = err * scale;
        gb2[o] += dy;
        axpy(dy, h.data(), &gw2[o * s.hidden], s.hidden);
        axpy(dy, &w2[o * s.hidden], dh.data(), s.hidden);
      }
      if (!backward) continue;
      for (std::size_t j = 0; j < s.hidden; ++j) {
        const float da = dh[j] * (1 - h[j] * h[j]);
        gb1[j] += da;
        axpy(da, xi, &gw1[j * s.in], s.in);
      }
    }
    return total / static_cast<double>(n * s.out);
  }

 private:
  void hidden_and_output(const float* x, float* h, float* y) const {
    for (std::size_t j = 0; j < s.hidden; ++j) h[j] = std::tanh(b1[j] + dot(&w1[j * s.in], x, s.in));
    for (std::size_t o = 0; o < s.out; ++o) y[o] = b2[o] + dot(&w2[o * s.hidden], h, s.hidden);
  }
};

// Adam (Kingma & Ba) over the model's four tensors: the inner optimizer, the trainer's own.
struct adam {
  float lr, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  std::vector<std::vector<float>> m, v;
  std::int64_t t = 0;

  explicit adam(float rate) : lr(rate) {}

  void step(const std::vector<ddp::tensor_view>& params, const std::vector<ddp::tensor_view>& grads) {
    if (m.empty()) {
      for (const ddp::tensor_view& p : params) {
        m.emplace_back(p.count, 0.0f);
        v.emplace_back(p.count, 0.0f);
      }
    }
    ++t;
    const auto c1 = static_cast<float>(1 - std::pow(static_cast<double>(beta1), static_cast<double>(t)));
    const auto c2 = static_cast<float>(1 - std::pow(static_cast<double>(beta2), static_cast<double>(t)));
    for (std::size_t k = 0; k < params.size(); ++k) {
      auto* p = static_cast<float*>(params[k].data);
      const auto* g = static_cast<const float*>(grads[k].data);
      float* mk = m[k].data();
      float* vk = v[k].data();
      for (std::size_t i = 0; i < params[k].count; ++i) {
        mk[i] = beta1 * mk[i] + (1 - beta1) * g[i];
        vk[i] = beta2 * vk[i] + (1 - beta2) * g[i] * g[i];
        p[i] -= lr * (mk[i] / c1) / (std::sqrt(vk[i] / c2) + eps);
      }
    }
  }
};

struct config {
  shape student{}, teacher{};
  std::size_t batch = 32, eval_samples = 512;
  float inner_lr = 1e-3f, teacher_gain = 1.0f;
  double target = 0, max_seconds = 180;
  std::int64_t max_steps = 2000, eval_every = 10;
  int sync_every = 30, fragments = 2, delay = 5;
  double outer_lr = 0.7, outer_momentum = 0.9, alpha = 1.0;
  ddp::outer_wire wire = ddp::outer_wire::native;
  std::uint64_t seed = 1;
  bool verbose = false;
  double link_gbit = 0, link_latency_ms = 0.05;  // for the cost model's column; 0: no column
  std::string ifname;  // the test host's interface whose transmit counter we read; empty: none
};

struct dataset {
  std::vector<float> x, y;
  std::size_t n = 0;
};

// n fresh inputs x ~ N(0, 1) and the teacher's outputs for them.
void draw(std::mt19937_64& rng, const mlp& teacher, std::size_t n, dataset& d) {
  std::normal_distribution<float> g(0.0f, 1.0f);
  d.n = n;
  d.x.resize(n * teacher.s.in);
  for (float& v : d.x) v = g(rng);
  teacher.forward(d.x, n, d.y);
}

// Bytes transmitted by `ifname` in this process's network namespace (a test host's), or -1.
double tx_bytes(const std::string& ifname) {
  if (ifname.empty()) return -1;
  std::ifstream in("/proc/self/net/dev");
  std::string line;
  while (std::getline(in, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string name = line.substr(0, colon);
    name.erase(0, name.find_first_not_of(' '));
    if (name != ifname) continue;
    std::istringstream fields(line.substr(colon + 1));
    double v = 0;
    for (int i = 0; i < 9; ++i) fields >> v;  // 8 receive counters, then transmitted bytes
    return fields ? v : -1;
  }
  return -1;
}

struct result {
  std::string mode;
  std::int64_t steps = 0;
  bool reached = false;
  double loss = 0, seconds = 0, compute_s = 0, payload = 0, sent = 0, link_tx = -1;
  std::int64_t collectives = 0;
};

using clock_type = std::chrono::steady_clock;

result train(const std::string& mode, ddp::communicator_ref world, const config& c, const mlp& initial,
             const mlp& teacher, const dataset& held_out) {
  const int rank = world.rank(), size = world.size();
  counting_communicator counted(world);
  mlp model = initial;  // every mode from the same parameters, on every rank
  adam inner(c.inner_lr);
  const std::vector<ddp::tensor_view> params = model.params(), grads = model.grads();
  const ddp::outer_sgd outer{.lr = c.outer_lr, .momentum = c.outer_momentum, .nesterov = c.outer_momentum > 0};

  // Every rank built the same initial parameters from one seed: no broadcast to count.
  std::optional<ddp::local_sgd> local;
  std::optional<ddp::diloco<>> dl;
  std::optional<ddp::streaming_diloco<>> streaming;
  std::function<void()> after_step = [] {};
  std::int64_t eval_every = c.sync_every;
  if (mode == "sync") {
    eval_every = c.eval_every;
  } else if (mode == "localsgd") {
    local.emplace(counted, params, ddp::local_sgd_options{.sync_every = c.sync_every, .broadcast_initial = false});
    after_step = [&] { local->step(); };
  } else if (mode == "diloco") {
    dl.emplace(
        counted, params,
        ddp::diloco_options<>{.sync_every = c.sync_every, .outer = outer, .wire = c.wire, .broadcast_initial = false});
    after_step = [&] { dl->step(); };
  } else if (mode == "streaming") {
    streaming.emplace(counted, params,
                      ddp::streaming_diloco_options<>{.sync_every = c.sync_every,
                                                      .fragments = c.fragments,
                                                      .delay = c.delay,
                                                      .alpha = c.alpha,
                                                      .outer = outer,
                                                      .wire = c.wire,
                                                      .broadcast_initial = false});
    after_step = [&] { streaming->step(); };
  } else {
    throw std::invalid_argument("--modes: unknown mode " + mode + " (sync, localsgd, diloco, streaming)");
  }

  // Each rank's own data stream: the same in every mode.
  std::mt19937_64 rng(c.seed * 1000003u + static_cast<std::uint64_t>(rank) + 1);
  dataset batch;
  result r{.mode = mode};
  double train_s = 0;    // this rank's time in training steps, evaluation excluded
  double compute_s = 0;  // of it, outside the collectives: data, forward, backward, Adam
  world.barrier().wait();
  const double tx0 = tx_bytes(c.ifname);
  for (std::int64_t step = 1; step <= c.max_steps; ++step) {
    const auto t0 = clock_type::now();
    draw(rng, teacher, c.batch, batch);
    model.loss(batch.x, batch.y, batch.n, /*backward=*/true);
    const auto t1 = clock_type::now();
    if (mode == "sync") ddp::allreduce_average(counted, grads, size).wait();
    const auto t2 = clock_type::now();
    inner.step(params, grads);
    const auto t3 = clock_type::now();
    after_step();
    train_s += std::chrono::duration<double>(clock_type::now() - t0).count();
    compute_s += std::chrono::duration<double>((t1 - t0) + (t3 - t2)).count();
    if (step % eval_every != 0 && step != c.max_steps) continue;

    // Every rank decides from the same gathered numbers, so they all stop at the same step.
    std::vector<double> mine{model.loss(held_out.x, held_out.y, held_out.n, false), train_s};
    std::vector<double> all(2 * static_cast<std::size_t>(size));
    world.allgather(ddp::view(mine), ddp::view(all)).wait();
    double loss = 0, slowest = 0;
    for (int k = 0; k < size; ++k) {
      loss += all[2 * static_cast<std::size_t>(k)] / size;
      slowest = std::max(slowest, all[2 * static_cast<std::size_t>(k) + 1]);
    }
    r.steps = step;
    r.loss = loss;
    r.seconds = slowest;
    if (c.verbose && rank == 0) {
      std::cout << "#   " << mode << " step " << step << " held-out loss " << loss << " after " << slowest << " s\n"
                << std::flush;
    }
    if (loss <= c.target) {
      r.reached = true;
      break;
    }
    if (slowest >= c.max_seconds) break;
  }
  const double tx1 = tx_bytes(c.ifname);
  // Bytes: the most any rank issued (they issue the same collectives; the max is the safe report).
  std::vector<double> mine{counted.payload_bytes(), counted.sent_bytes(), tx0 >= 0 && tx1 >= 0 ? tx1 - tx0 : -1,
                           compute_s};
  world.allreduce(mine, ddp::reduce_op::max).wait();
  r.payload = mine[0];
  r.sent = mine[1];
  r.link_tx = mine[2];
  r.compute_s = mine[3];  // the slowest rank's
  r.collectives = counted.collectives();
  return r;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

std::string fixed(double v, int digits) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(digits) << v;
  return os.str();
}

int run_on(ddp::communicator_ref world, const std::string& comm_name, const config& c,
           const std::vector<std::string>& modes, const bench::cli& args);

int run(const bench::cli& args, ddp::mpi::environment& env) {
  config c;
  c.student = {static_cast<std::size_t>(args.int_or("--in", 128)),
               static_cast<std::size_t>(args.int_or("--hidden", 2048)),
               static_cast<std::size_t>(args.int_or("--out", 128))};
  c.teacher = {c.student.in, static_cast<std::size_t>(args.int_or("--teacher-hidden", 256)), c.student.out};
  c.teacher_gain = static_cast<float>(args.double_or("--teacher-gain", 1.0));
  c.batch = static_cast<std::size_t>(args.int_or("--batch", 32));
  c.eval_samples = static_cast<std::size_t>(args.int_or("--eval-samples", 512));
  c.inner_lr = static_cast<float>(args.double_or("--inner-lr", 1e-3));
  c.target = args.double_or("--target", 0.03);
  c.max_steps = args.int_or("--max-steps", 2000);
  c.max_seconds = args.double_or("--max-seconds", 180);
  c.eval_every = args.int_or("--eval-every", 10);
  c.sync_every = static_cast<int>(args.int_or("--sync-every", 30));
  c.fragments = static_cast<int>(args.int_or("--fragments", 2));
  c.delay = static_cast<int>(args.int_or("--delay", 5));
  c.alpha = args.double_or("--alpha", 1.0);
  c.outer_lr = args.double_or("--outer-lr", 0.7);
  c.outer_momentum = args.double_or("--outer-momentum", 0.9);
  c.seed = static_cast<std::uint64_t>(args.int_or("--seed", 1));
  c.verbose = args.has("--verbose");
  const std::string wire = args.string_or("--wire", "native");
  if (wire == "bf16") {
    c.wire = ddp::outer_wire::bf16;
  } else if (wire == "int8") {
    c.wire = ddp::outer_wire::int8;
  } else if (wire != "native") {
    throw std::invalid_argument("--wire " + wire + ": native, bf16 or int8");
  }
  if (c.student.in < 1 || c.student.hidden < 1 || c.student.out < 1 || c.teacher.hidden < 1 || c.batch < 1 ||
      c.eval_samples < 1 || c.max_steps < 1 || c.eval_every < 1 || c.sync_every < 1) {
    throw std::invalid_argument(
        "sizes, --batch, --eval-samples, --max-steps, --eval-every and --sync-every must be >= 1");
  }
  if (const char* hosts = std::getenv("DDP_HOSTS"); hosts != nullptr && *hosts != '\0') {
    const char* ifname = std::getenv("DDP_HOSTS_IFNAME");
    c.ifname = ifname != nullptr ? ifname : "eth0";
  }
  const std::vector<std::string> modes = split(args.string_or("--modes", "sync,localsgd,diloco,streaming"));
  // Streaming DiLoCo checks these too, but only when its turn comes, after the other modes ran.
  const bool streams = std::find(modes.begin(), modes.end(), "streaming") != modes.end();
  if (streams &&
      (c.fragments < 1 || c.sync_every % c.fragments != 0 || c.delay < 0 || c.delay >= c.sync_every / c.fragments)) {
    throw std::invalid_argument("streaming needs --fragments dividing --sync-every and --delay in [0, H / F)");
  }
  c.link_gbit = args.double_or("--link-gbit", 0);
  c.link_latency_ms = args.double_or("--link-latency-ms", 0.05);
  const std::string comm = args.string_or("--comm", "world");
  if (comm == "world") {
    auto world = ddp::world(env);
    return run_on(world, "ddp::world (shared memory in a host, sockets ring on a thread between hosts)", c, modes,
                  args);
  }
  if (comm == "mpi") {
    auto world = ddp::mpi::communicator::world(env);
    return run_on(world, "ddp::mpi::communicator (non-blocking, progressed when tested)", c, modes, args);
  }
  throw std::invalid_argument("--comm " + comm + ": world or mpi");
}

int run_on(ddp::communicator_ref world, const std::string& comm_name, const config& c,
           const std::vector<std::string>& modes, const bench::cli& args) {
  const int rank = world.rank(), size = world.size();
  const mlp teacher(c.teacher, c.seed + 100, c.teacher_gain);
  const mlp initial(c.student, c.seed, 1.0f);
  dataset held_out;
  std::mt19937_64 held_rng(c.seed + 7);
  draw(held_rng, teacher, c.eval_samples, held_out);
  mlp probe = initial;
  const double initial_loss = probe.loss(held_out.x, held_out.y, held_out.n, false);

  if (rank == 0) {
    const char* host_env = std::getenv("DDP_HOSTS");
    std::cout << "# local steps to a target loss: " << size << " ranks"
              << (host_env != nullptr ? std::string(" across test hosts ") + host_env : std::string(" (no test hosts)"))
              << "; MLP " << c.student.in << "-" << c.student.hidden << "-" << c.student.out << " ("
              << initial.parameters() << " f32 parameters, " << fixed(4.0 * initial.parameters() / 1e6, 2)
              << " MB), teacher hidden " << c.teacher.hidden << " gain " << c.teacher_gain << ", batch " << c.batch
              << " per rank, Adam lr " << c.inner_lr << "\n# communicator: " << comm_name << "\n# H = " << c.sync_every
              << ", outer SGD lr " << c.outer_lr << " momentum " << c.outer_momentum
              << (c.outer_momentum > 0 ? " Nesterov" : "") << ", wire " << ddp::name_of(c.wire)
              << ", streaming F = " << c.fragments << " tau = " << c.delay << " alpha = " << c.alpha
              << "\n# held-out loss: initial " << fixed(initial_loss, 4) << ", target " << c.target << " ("
              << c.eval_samples << " samples; sync evaluated every " << c.eval_every
              << " steps, the others every H); caps " << c.max_steps << " steps, " << c.max_seconds
              << " s\n# time: training steps only (slowest rank), evaluation excluded\n"
              << std::flush;
  }

  std::vector<result> results;
  for (const std::string& mode : modes) results.push_back(train(mode, world, c, initial, teacher, held_out));

  double sync_s = 0;
  for (const result& r : results) {
    if (r.mode == "sync" && r.reached) sync_s = r.seconds;
  }
  bench::table t({{"mode"},
                  {"reached"},
                  {"inner steps"},
                  {"held-out loss", 4},
                  {"seconds", 2},
                  {"ms/step", 1},
                  {"compute ms", 1},
                  {"model ms", 1},
                  {"collectives"},
                  {"payload MB", 2},
                  {"sent MB", 2},
                  {"link tx MB", 2},
                  {"time / sync", 3}});
  // What the cost model (ddp/local_steps/cost_model.hpp) predicts per inner step for the measured
  // compute and the link rate given: what it gets right here is the communication alone.
  auto model_ms = [&](const result& r) -> bench::cell {
    if (c.link_gbit <= 0) return std::string("-");
    const ddp::training_setup setup{.parameters = static_cast<double>(initial.parameters()),
                                    .dtype_bytes = 4,
                                    .tensors = 4,
                                    .replicas = size,
                                    .compute_s = r.compute_s / static_cast<double>(r.steps),
                                    .link = ddp::gbit_link(c.link_gbit, c.link_latency_ms)};
    ddp::sync_plan plan;
    plan.sync_every = c.sync_every;
    plan.wire = c.wire;
    if (r.mode == "sync") {
      plan.mode = ddp::sync_mode::data_parallel;
      plan.wire = ddp::outer_wire::native;
    } else if (r.mode == "localsgd") {
      plan.mode = ddp::sync_mode::local_sgd;
      plan.wire = ddp::outer_wire::native;
    } else if (r.mode == "diloco") {
      plan.mode = ddp::sync_mode::diloco;
    } else {
      plan.mode = ddp::sync_mode::streaming_diloco;
      plan.fragments = c.fragments;
      plan.delay = c.delay;
    }
    return 1e3 * ddp::cost_of(setup, plan).step_s;
  };
  for (const result& r : results) {
    const bench::cell vs_sync = sync_s > 0 && r.reached ? bench::cell(r.seconds / sync_s) : bench::cell("-");
    t.add({r.mode, std::string(r.reached ? "yes" : "no"), r.steps, r.loss, r.seconds,
           1e3 * r.seconds / static_cast<double>(r.steps), 1e3 * r.compute_s / static_cast<double>(r.steps),
           model_ms(r), r.collectives, r.payload / 1e6, r.sent / 1e6,
           r.link_tx >= 0 ? bench::cell(r.link_tx / 1e6) : bench::cell("-"), vs_sync});
  }
  if (rank == 0) {
    t.print(std::cout);
    if (const auto csv = args.csv()) t.write_csv(*csv);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ddp::mpi::environment env(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  try {
    const bench::cli args(
        argc, argv,
        "Time to a target loss with synchronous data parallelism, LocalSGD, DiLoCo and Streaming DiLoCo (one MPI "
        "rank per replica)",
        {{"--comm", "C", "world (ddp::world, default) or mpi (ddp::mpi::communicator)"},
         {"--modes", "LIST", "comma-separated, in order (default sync,localsgd,diloco,streaming)"},
         {"--target", "LOSS", "held-out loss to reach (default 0.03)"},
         {"--max-steps", "N", "inner steps at most, per mode (default 2000)"},
         {"--max-seconds", "S", "training seconds at most, per mode (default 180)"},
         {"--eval-every", "N", "sync: steps between evaluations (default 10); the others: every H"},
         {"--eval-samples", "N", "held-out samples (default 512)"},
         {"--sync-every", "H", "inner steps per outer step / parameter average (default 30)"},
         {"--fragments", "F", "streaming: fragments (default 2)"},
         {"--delay", "TAU", "streaming: inner steps an exchange overlaps (default 5)"},
         {"--alpha", "A", "streaming: mixing factor (default 1)"},
         {"--outer-lr", "LR", "DiLoCo outer SGD learning rate (default 0.7)"},
         {"--outer-momentum", "M", "DiLoCo outer Nesterov momentum; 0: plain SGD (default 0.9)"},
         {"--wire", "W", "outer gradients: native, bf16 or int8 (default native)"},
         {"--inner-lr", "LR", "Adam learning rate (default 0.001)"},
         {"--batch", "N", "samples per rank and step (default 32)"},
         {"--in", "N", "input width (default 128)"},
         {"--hidden", "N", "hidden width (default 2048)"},
         {"--out", "N", "output width (default 128)"},
         {"--teacher-hidden", "N", "teacher's hidden width (default 256)"},
         {"--teacher-gain", "G", "scale of the teacher's first layer: larger, more nonlinear (default 1)"},
         {"--seed", "N", "seed of the model, teacher and data (default 1)"},
         {"--link-gbit", "G", "the link's rate, for the cost model's column (default: no column)"},
         {"--link-latency-ms", "MS", "the link's latency for the cost model (default 0.05)"},
         {"--verbose", "", "print every evaluation"}});
    if (args.help_requested()) {
      if (rank == 0) args.print_help(std::cout);
      return 0;
    }
    return run(args, env);
  } catch (const std::exception& e) {
    std::cerr << "local_steps_bench: rank " << rank << ": " << e.what() << '\n';
    MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
}
