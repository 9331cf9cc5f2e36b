// Data-parallel training with gradients on the GPU: a 2-layer MLP (hand-written CUDA kernels)
// learns a fixed random "teacher" MLP, one rank per visible GPU, each rank a thread of this
// process with its own NCCL communicator and its own shard of the data. No MPI: the NCCL unique
// id is generated once and handed to every thread.
//
// Per step, all on the rank's compute stream, nothing waiting on the host:
//   forward, loss, backward (writing all gradients into ONE device allocation), and as each
//   layer's gradients are written, `bucketer.mark_ready(i)` (the Bucketer records an event on
//   the compute stream and copies the gradient into its bucket on the communicator's stream
//   behind it; a bucket's allreduce starts as soon as its gradients are in); then
//   `bucketer.finalize()` (the compute stream waits, on the device, for the averaged gradients)
//   and the SGD kernel. The host only reads the loss every `--print-every` steps.
//
//   cuda_trainer [--gpus N] [--steps S] [--print-every K] [--compress none|fp16|bf16]
//
// Exit status: 0 converged; 1 not converged or an error; 2 no CUDA device visible
// ("cuda_trainer: no CUDA device visible").
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ddp/bucketer.hpp>
#include <ddp/cuda/compress.cuh>
#include <ddp/cuda/runtime.hpp>
#include <ddp/nccl.hpp>

namespace {

// ---- model sizes -------------------------------------------------------------------------------
constexpr int batch = 512;  // samples per rank (full-batch gradient descent on the rank's shard)
constexpr int d_in = 32;
constexpr int hidden = 128;
constexpr int d_out = 16;
constexpr float learning_rate = 0.2f;

// Parameters (and, at the same offsets, gradients) in one allocation: W1, b1, W2, b2.
constexpr std::size_t w1_count = std::size_t{hidden} * d_in;
constexpr std::size_t b1_count = hidden;
constexpr std::size_t w2_count = std::size_t{d_out} * hidden;
constexpr std::size_t b2_count = d_out;
constexpr std::size_t w1_at = 0;
constexpr std::size_t b1_at = w1_at + w1_count;
constexpr std::size_t w2_at = b1_at + b1_count;
constexpr std::size_t b2_at = w2_at + w2_count;
constexpr std::size_t param_count = b2_at + b2_count;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// ---- kernels (one thread per output element; the sizes are tiny) --------------------------------

// pre[b][j] = b1[j] + sum_k x[b][k] W1[j][k]
__global__ void forward_hidden(const float* x, const float* w1, const float* b1, float* pre) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= batch * hidden) return;
  const int b = i / hidden, j = i % hidden;
  float acc = b1[j];
  for (int k = 0; k < d_in; ++k) acc += x[b * d_in + k] * w1[j * d_in + k];
  pre[i] = acc;
}

// y = b2 + relu(pre) W2^T; dy = d(loss)/dy for loss = mean (y - t)^2; sq = (y - t)^2
__global__ void forward_out(const float* pre, const float* w2, const float* b2, const float* target, float* dy,
                            float* sq) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= batch * d_out) return;
  const int b = i / d_out, o = i % d_out;
  float y = b2[o];
  for (int j = 0; j < hidden; ++j) y += fmaxf(pre[b * hidden + j], 0.0f) * w2[o * hidden + j];
  const float diff = y - target[i];
  sq[i] = diff * diff;
  dy[i] = 2.0f * diff / static_cast<float>(batch * d_out);
}

// loss = mean(sq): one block.
__global__ void mean_loss(const float* sq, float* loss) {
  __shared__ float part[256];
  float acc = 0.0f;
  for (int i = threadIdx.x; i < batch * d_out; i += blockDim.x) acc += sq[i];
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) *loss = part[0] / static_cast<float>(batch * d_out);
}

// gW2[o][j] = sum_b dy[b][o] relu(pre[b][j]); column j == hidden is gb2[o] = sum_b dy[b][o].
__global__ void backward_out(const float* dy, const float* pre, float* gw2, float* gb2) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= d_out * (hidden + 1)) return;
  const int o = i / (hidden + 1), j = i % (hidden + 1);
  float acc = 0.0f;
  for (int b = 0; b < batch; ++b) acc += dy[b * d_out + o] * (j == hidden ? 1.0f : fmaxf(pre[b * hidden + j], 0.0f));
  if (j == hidden) {
    gb2[o] = acc;
  } else {
    gw2[o * hidden + j] = acc;
  }
}

// dh[b][j] = (pre[b][j] > 0) * sum_o dy[b][o] W2[o][j]
__global__ void backward_hidden(const float* dy, const float* w2, const float* pre, float* dh) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= batch * hidden) return;
  const int b = i / hidden, j = i % hidden;
  float acc = 0.0f;
  for (int o = 0; o < d_out; ++o) acc += dy[b * d_out + o] * w2[o * hidden + j];
  dh[i] = pre[i] > 0.0f ? acc : 0.0f;
}

// gW1[j][k] = sum_b dh[b][j] x[b][k]; column k == d_in is gb1[j] = sum_b dh[b][j].
__global__ void backward_in(const float* dh, const float* x, float* gw1, float* gb1) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= hidden * (d_in + 1)) return;
  const int j = i / (d_in + 1), k = i % (d_in + 1);
  float acc = 0.0f;
  for (int b = 0; b < batch; ++b) acc += dh[b * hidden + j] * (k == d_in ? 1.0f : x[b * d_in + k]);
  if (k == d_in) {
    gb1[j] = acc;
  } else {
    gw1[j * d_in + k] = acc;
  }
}

// p -= lr * g over every parameter (gradients sit at the parameters' offsets).
__global__ void sgd(float* params, const float* grads, int n, float lr) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) params[i] -= lr * grads[i];
}

constexpr int threads = 256;
constexpr unsigned blocks(std::size_t n) { return static_cast<unsigned>((n + threads - 1) / threads); }

// ---- host side ---------------------------------------------------------------------------------

// Host reference of the teacher: t = b2 + relu(x W1^T + b1) W2^T.
std::vector<float> teacher_targets(const std::vector<float>& x, const std::vector<float>& teacher) {
  std::vector<float> t(std::size_t{batch} * d_out);
  for (int b = 0; b < batch; ++b) {
    for (int o = 0; o < d_out; ++o) {
      float y = teacher[b2_at + o];
      for (int j = 0; j < hidden; ++j) {
        float h = teacher[b1_at + j];
        for (int k = 0; k < d_in; ++k) h += x[b * d_in + k] * teacher[w1_at + j * d_in + k];
        y += std::max(h, 0.0f) * teacher[w2_at + o * hidden + j];
      }
      t[b * d_out + o] = y;
    }
  }
  return t;
}

// Gaussian weights scaled by 1/sqrt(fan-in); biases `bias_scale` (0: zero).
std::vector<float> random_mlp(unsigned seed, float bias_scale) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> p(param_count);
  for (std::size_t i = 0; i < w1_count; ++i) p[w1_at + i] = normal(gen) / std::sqrt(static_cast<float>(d_in));
  for (std::size_t i = 0; i < b1_count; ++i) p[b1_at + i] = normal(gen) * bias_scale;
  for (std::size_t i = 0; i < w2_count; ++i) p[w2_at + i] = normal(gen) / std::sqrt(static_cast<float>(hidden));
  for (std::size_t i = 0; i < b2_count; ++i) p[b2_at + i] = normal(gen) * bias_scale;
  return p;
}

template <class T>
class device_array {
 public:
  explicit device_array(std::size_t n) : n_(n) { check(cudaMalloc(&p_, n * sizeof(T)), "cudaMalloc"); }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
  ~device_array() { (void)cudaFree(p_); }
  void upload(const std::vector<T>& v) {
    check(cudaMemcpy(p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  [[nodiscard]] std::vector<T> download() const {
    std::vector<T> v(n_);
    check(cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
    return v;
  }
  T* get() const { return p_; }

 private:
  std::size_t n_;
  T* p_ = nullptr;
};

struct config {
  int gpus = 0;  // 0: every visible GPU
  int steps = 300;
  int print_every = 50;
  std::string compress = "none";
};

struct rank_result {
  std::vector<float> losses;  // at steps 0, print_every, ..., and the last
  std::vector<float> params;  // final parameters
};

// Every communicator of the run, so that a failing rank can abort the others (which would
// otherwise wait for it inside NCCL).
struct clique {
  std::mutex mutex;
  std::vector<ddp::nccl::communicator*> comms;
  void abort_all() {
    std::lock_guard lk(mutex);
    for (ddp::nccl::communicator* c : comms) c->abort();
  }
};

void train_rank(const config& cfg, const ddp::nccl::unique_id& id, int rank, int size, clique& all, rank_result& out) {
  const int device = rank;
  check(cudaSetDevice(device), "cudaSetDevice");
  ddp::nccl::communicator comm = ddp::nccl::communicator::create(id, rank, size, device);
  {
    std::lock_guard lk(all.mutex);
    all.comms.push_back(&comm);
  }
  struct unregister {
    clique& all;
    ddp::nccl::communicator* comm;
    ~unregister() {
      std::lock_guard lk(all.mutex);
      std::erase(all.comms, comm);
    }
  } unregister_on_exit{all, &comm};

  cudaStream_t compute = nullptr;
  check(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  struct stream_owner {
    cudaStream_t s;
    ~stream_owner() { (void)cudaStreamDestroy(s); }
  } own_stream{compute};

  // Data: this rank's shard; the teacher and the initial student are the same on every rank.
  std::vector<float> x_host(std::size_t{batch} * d_in);
  {
    std::mt19937 gen(1000u + static_cast<unsigned>(rank));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& v : x_host) v = normal(gen);
  }
  const std::vector<float> teacher = random_mlp(7, 0.1f);
  device_array<float> x(x_host.size()), target(std::size_t{batch} * d_out);
  x.upload(x_host);
  target.upload(teacher_targets(x_host, teacher));
  device_array<float> params(param_count), grads(param_count);
  device_array<float> pre(std::size_t{batch} * hidden), dh(std::size_t{batch} * hidden);
  device_array<float> dy(std::size_t{batch} * d_out), sq(std::size_t{batch} * d_out), loss(1);
  params.upload(random_mlp(1, 0.0f));
  check(cudaMemset(grads.get(), 0, param_count * sizeof(float)), "cudaMemset");

  const ddp::device gpu = ddp::device::cuda(device);
  auto view = [&](float* base, std::size_t at, std::size_t n) {
    return ddp::tensor_view{base + at, n, ddp::dtype::f32, gpu};
  };
  // Rank 0's initial parameters everywhere (they are equal already; this is how a real trainer
  // would start). The host waits: it is set-up, not the hot path.
  ddp::tensor_view all_params = view(params.get(), 0, param_count);
  ddp::communicator_ref(comm).broadcast(all_params, 0).wait();

  // Four gradients, in registration (forward) order; tiny caps so that each is its own bucket.
  ddp::Bucketer<> bucketer(comm, ddp::bucketing::size_capped{.cap_bytes = 512, .small_bucket_bytes = 64});
  const std::size_t g_w1 = bucketer.add(view(params.get(), w1_at, w1_count), view(grads.get(), w1_at, w1_count));
  const std::size_t g_b1 = bucketer.add(view(params.get(), b1_at, b1_count), view(grads.get(), b1_at, b1_count));
  const std::size_t g_w2 = bucketer.add(view(params.get(), w2_at, w2_count), view(grads.get(), w2_at, w2_count));
  const std::size_t g_b2 = bucketer.add(view(params.get(), b2_at, b2_count), view(grads.get(), b2_at, b2_count));
  if (cfg.compress == "fp16") bucketer.register_comm_hook(ddp::cuda::hooks::fp16_compress{});
  if (cfg.compress == "bf16") bucketer.register_comm_hook(ddp::cuda::hooks::bf16_compress{});
  bucketer.set_compute_stream(ddp::cuda::stream(compute));

  float* const p = params.get();
  float* const g = grads.get();
  for (int step = 0; step < cfg.steps; ++step) {
    forward_hidden<<<blocks(std::size_t{batch} * hidden), threads, 0, compute>>>(x.get(), p + w1_at, p + b1_at,
                                                                                 pre.get());
    forward_out<<<blocks(std::size_t{batch} * d_out), threads, 0, compute>>>(pre.get(), p + w2_at, p + b2_at,
                                                                             target.get(), dy.get(), sq.get());
    mean_loss<<<1, 256, 0, compute>>>(sq.get(), loss.get());
    // Backward, last layer first: its gradients go out while the first layer's are computed.
    backward_out<<<blocks(std::size_t{d_out} * (hidden + 1)), threads, 0, compute>>>(dy.get(), pre.get(), g + w2_at,
                                                                                     g + b2_at);
    bucketer.mark_ready(g_b2);
    bucketer.mark_ready(g_w2);
    backward_hidden<<<blocks(std::size_t{batch} * hidden), threads, 0, compute>>>(dy.get(), p + w2_at, pre.get(),
                                                                                  dh.get());
    backward_in<<<blocks(std::size_t{hidden} * (d_in + 1)), threads, 0, compute>>>(dh.get(), x.get(), g + w1_at,
                                                                                   g + b1_at);
    bucketer.mark_ready(g_b1);
    bucketer.mark_ready(g_w1);
    check(cudaGetLastError(), "kernel launch");
    bucketer.finalize();  // the compute stream waits for the averaged gradients; the host does not
    sgd<<<blocks(param_count), threads, 0, compute>>>(p, g, static_cast<int>(param_count), learning_rate);

    if (step % cfg.print_every == 0 || step == cfg.steps - 1) {
      float l = 0.0f;
      check(cudaMemcpyAsync(&l, loss.get(), sizeof(float), cudaMemcpyDeviceToHost, compute), "cudaMemcpyAsync");
      check(cudaStreamSynchronize(compute), "cudaStreamSynchronize");
      out.losses.push_back(l);
      if (rank == 0) std::printf("step %4d  loss %.6f (rank 0's shard)\n", step, static_cast<double>(l));
    }
  }
  check(cudaStreamSynchronize(compute), "cudaStreamSynchronize");
  out.params = params.download();
}

bool parse(int argc, char** argv, config& cfg) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--gpus" && has_value) {
      cfg.gpus = std::atoi(argv[++i]);
    } else if (a == "--steps" && has_value) {
      cfg.steps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--print-every" && has_value) {
      cfg.print_every = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--compress" && has_value) {
      cfg.compress = argv[++i];
      if (cfg.compress != "none" && cfg.compress != "fp16" && cfg.compress != "bf16") return false;
    } else {
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  config cfg;
  if (!parse(argc, argv, cfg)) {
    std::fprintf(stderr, "usage: cuda_trainer [--gpus N] [--steps S] [--print-every K] [--compress none|fp16|bf16]\n");
    return 1;
  }
  const ddp::nccl::device_count visible = ddp::nccl::visible_devices();
  if (visible.count == 0) {
    std::printf("cuda_trainer: no CUDA device visible (%s)\n", cudaGetErrorString(visible.status));
    return 2;
  }
  const int size = cfg.gpus > 0 ? std::min(cfg.gpus, visible.count) : visible.count;
  std::printf("cuda_trainer: %d rank(s), one per GPU, %d steps, compression %s\n", size, cfg.steps,
              cfg.compress.c_str());
  std::fflush(stdout);

  try {
    const ddp::nccl::unique_id id = ddp::nccl::unique_id::generate();
    clique all;
    std::vector<rank_result> results(static_cast<std::size_t>(size));
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(size));
    std::vector<std::thread> ranks;
    for (int r = 0; r < size; ++r) {
      ranks.emplace_back([&, r] {
        try {
          train_rank(cfg, id, r, size, all, results[static_cast<std::size_t>(r)]);
        } catch (...) {
          errors[static_cast<std::size_t>(r)] = std::current_exception();
          all.abort_all();  // peers waiting for this rank inside NCCL fail instead of hanging
        }
      });
    }
    for (std::thread& t : ranks) t.join();
    for (int r = 0; r < size; ++r) {
      if (errors[static_cast<std::size_t>(r)]) std::rethrow_exception(errors[static_cast<std::size_t>(r)]);
    }

    // Mean over ranks of the first and last sampled loss; every rank must end with the same bits.
    double first = 0.0, last = 0.0;
    bool identical = true;
    for (const rank_result& res : results) {
      first += res.losses.front() / size;
      last += res.losses.back() / size;
      identical =
          identical && std::memcmp(res.params.data(), results[0].params.data(), res.params.size() * sizeof(float)) == 0;
    }
    // The parameters' sum, to tell runs apart whose losses agree to the digits printed (near the
    // minimum, compression changes the loss only in the second order of its rounding).
    double checksum = 0.0;
    for (const float v : results[0].params) checksum += static_cast<double>(v);
    std::printf("parameters identical on all %d rank(s): %s (sum %.9g)\n", size, identical ? "yes" : "NO", checksum);
    const bool converged = identical && std::isfinite(last) && last < 0.25 * first;
    std::printf("cuda_trainer: %d GPU(s), loss %.6f -> %.6f: %s\n", size, first, last,
                converged ? "converged" : "NOT converged");
    return converged ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cuda_trainer: error: %s\n", e.what());
    return 1;
  }
}
