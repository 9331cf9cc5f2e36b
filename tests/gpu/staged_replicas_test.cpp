// GPU check (a) of issue #45: fault-tolerant training of replica processes that share one GPU,
// their device gradients and device training state crossing over ddp::staged::communicator (host
// copies over gloo behind gates, ddp::cuda::runtime). Three processes: replica "a"; replica "b",
// which SIGKILLs itself in the middle of step 8; and "b" again, started once the job committed
// step 12, which heals its device state from "a". At the end both hold bit-identical parameters and
// momentum (hashes of the bytes read back from the device), and the restarted "b" healed.
//
// No MPI and no Catch2 (scripts/gpu-check.sh runs it on GPU machines that have neither); needs
// gloo. Without a CUDA device it prints "SKIP: ..." and exits 77. Output: "RESULT gpu.staged_replicas
// PASS|FAIL: ...".
#include <cuda_runtime_api.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <ddp/bucketer.hpp>
#include <ddp/bucketing/fixed.hpp>
#include <ddp/cuda/runtime.hpp>
#include <ddp/gloo.hpp>
#include <ddp/manager.hpp>
#include <ddp/staged/owning_communicator.hpp>
#include <ddp/stores/file_store.hpp>

namespace {

using namespace std::chrono_literals;

constexpr std::size_t dim = 1 << 18;  // 1 MiB of f32 per tensor
constexpr std::int64_t last = 30;
const ddp::device gpu0 = ddp::device::cuda(0);

struct plan {
  std::string id;
  std::int64_t kill_at = -1;     // SIGKILLs itself after start_quorum() of this step
  std::int64_t start_after = 0;  // waits until the job committed this many steps
};

std::uint64_t fnv(const std::vector<float>& v, std::uint64_t h = 0xcbf29ce484222325ull) {
  for (const float x : v) {
    std::uint32_t b = 0;
    std::memcpy(&b, &x, 4);
    h = (h ^ b) * 0x100000001b3ull;
  }
  return h;
}

// One replica process; returns its exit status (0: finished, 1: failed, with a line on stderr).
int replica(const std::filesystem::path& dir, const plan& p) {
  ddp::stores::file_store store(dir);
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (store.add("progress", 0) < p.start_after) {
    if (std::chrono::steady_clock::now() > until) return 1;
    std::this_thread::sleep_for(5ms);
  }
  ddp::cuda::runtime rt(0);
  const ddp::device_stream replica_stream = rt.create_stream(gpu0);
  const ddp::device_stream compute = rt.create_stream(gpu0);
  float* w = static_cast<float*>(rt.allocate(gpu0, dim * sizeof(float), compute));
  float* momentum = static_cast<float*>(rt.allocate(gpu0, dim * sizeof(float), compute));
  float* grad = static_cast<float*>(rt.allocate(gpu0, dim * sizeof(float), compute));
  std::vector<float> hw(dim), hm(dim, 0.0f), hg(dim);
  for (std::size_t k = 0; k < dim; ++k)
    hw[k] = static_cast<float>(p.id == "a" ? 1 : 2) + 1e-3f * static_cast<float>(k % 97);
  const auto sync = [&](ddp::device_stream s) {
    const ddp::device_event e = rt.create_event(gpu0);
    rt.record(e, s);
    rt.synchronize(e);
    rt.destroy_event(e);
  };
  const auto upload = [&](float* d, const std::vector<float>& h) {
    const ddp::copy_region r{d, h.data(), dim * sizeof(float)};
    rt.copy(std::span<const ddp::copy_region>(&r, 1), compute);
  };
  const auto download = [&](std::vector<float>& h, const float* d) {
    const ddp::copy_region r{h.data(), d, dim * sizeof(float)};
    rt.copy(std::span<const ddp::copy_region>(&r, 1), compute);
    sync(compute);
  };
  upload(w, hw);
  upload(momentum, hm);
  sync(compute);

  ddp::training_state state;
  state.add(ddp::tensor_view{w, dim, ddp::dtype::f32, gpu0})
      .add(ddp::tensor_view{momentum, dim, ddp::dtype::f32, gpu0});
  ddp::manager_options opts;
  opts.replica_id = p.id;
  opts.min_replicas = 1;
  opts.heartbeat_interval = 50ms;
  opts.heartbeat_timeout = 1s;
  opts.step_timeout = 10s;
  opts.settle = 50ms;
  opts.quorum_timeout = 60s;
  opts.device_queue = {&rt, replica_stream, gpu0};
  ddp::gloo::options go;
  go.timeout = 10s;
  go.connect_timeout = 10s;
  ddp::Manager m(
      store,
      [&](const ddp::quorum_info& q) {
        return ddp::any_communicator(ddp::staged::owning_communicator<ddp::gloo::communicator>(
            ddp::gloo::communicator(q.store, q.rank, q.size, go), rt, gpu0,
            {.timeout = 10s, .stream = replica_stream}));
      },
      state, opts);
  ddp::Bucketer<ddp::bucketing::fixed> grads(m);
  grads.add(ddp::tensor_view{w, dim, ddp::dtype::f32, gpu0}, ddp::tensor_view{grad, dim, ddp::dtype::f32, gpu0});
  grads.set_compute_stream(compute);
  m.attach(grads);
  for (int guard = 0; guard < 2000; ++guard) {
    m.start_quorum();
    const std::int64_t s = m.step();
    if (s == p.kill_at) ::raise(SIGKILL);
    download(hw, w);  // the "backward pass" on the host: the same function of w on every replica
    for (std::size_t k = 0; k < dim; ++k)
      hg[k] = hw[k] - std::sin(0.3f * static_cast<float>(s) + 1e-4f * static_cast<float>(k));
    upload(grad, hg);
    grads.mark_ready(0);
    grads.finalize();
    if (!m.should_commit()) continue;
    download(hg, grad);  // the averaged gradient; the optimizer on the host, the state back on the device
    download(hm, momentum);
    for (std::size_t k = 0; k < dim; ++k) {
      hm[k] = 0.9f * hm[k] + hg[k];
      hw[k] -= 0.05f * hm[k];
    }
    upload(w, hw);
    upload(momentum, hm);
    sync(compute);
    if (p.id == "a") store.add("progress", 1);
    if (m.step() > last && m.members().size() == 2) break;
  }
  download(hw, w);
  download(hm, momentum);
  char text[64];
  std::snprintf(text, sizeof text, "%016llx at %lld healed %llu", static_cast<unsigned long long>(fnv(hm, fnv(hw))),
                static_cast<long long>(m.step()), static_cast<unsigned long long>(m.stats().heals));
  store.set("result/" + p.id, ddp::as_bytes(std::string(text)));
  rt.deallocate(w, compute);
  rt.deallocate(momentum, compute);
  rt.deallocate(grad, compute);
  sync(compute);
  return 0;
}

}  // namespace

int main() {
  // CUDA must not be initialised before fork(): the device is probed in a child of its own.
  if (const pid_t probe = ::fork(); probe == 0) {
    int devices = 0;
    const cudaError_t e = cudaGetDeviceCount(&devices);
    if (e != cudaSuccess || devices == 0) {
      std::printf("SKIP: no CUDA device visible (%s)\n", e == cudaSuccess ? "none" : cudaGetErrorString(e));
      std::fflush(stdout);
      std::_Exit(77);
    }
    std::_Exit(0);
  } else {
    int status = 0;
    ::waitpid(probe, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return 77;
  }
  const auto dir = std::filesystem::temp_directory_path() / ("ddp-staged-replicas-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::filesystem::permissions(dir, std::filesystem::perms::owner_all);
  const std::vector<plan> plans{{.id = "a"}, {.id = "b", .kill_at = 8}, {.id = "b", .start_after = 12}};
  std::vector<pid_t> pids;
  const auto t0 = std::chrono::steady_clock::now();
  for (const plan& p : plans) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      int status = 1;
      try {
        status = replica(dir, p);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "replica %s: %s\n", p.id.c_str(), e.what());
      }
      std::_Exit(status);
    }
    pids.push_back(pid);
  }
  std::string failure;
  for (std::size_t i = 0; i < pids.size(); ++i) {
    int status = 0;
    ::waitpid(pids[i], &status, 0);
    const bool killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (i == 1 ? !killed : !ok)
      failure += "process " + std::to_string(i) + " ended with status " + std::to_string(status) + "; ";
  }
  ddp::stores::file_store store(dir);
  const auto a = store.get("result/a");
  const auto b = store.get("result/b");
  const std::string ra = a ? ddp::to_text(*a) : "missing", rb = b ? ddp::to_text(*b) : "missing";
  std::printf("replica a: %s\nreplica b (restarted): %s\n", ra.c_str(), rb.c_str());
  if (ra == "missing" || rb == "missing" || ra.substr(0, 16) != rb.substr(0, 16))
    failure += "the replicas' state differs; ";
  if (rb.find("healed 0") != std::string::npos) failure += "the restarted replica did not heal; ";
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (failure.empty()) {
    std::printf("RESULT gpu.staged_replicas PASS (%.1f s)\n", s);
    return 0;
  }
  std::printf("RESULT gpu.staged_replicas FAIL: %s\n", failure.c_str());
  return 1;
}
