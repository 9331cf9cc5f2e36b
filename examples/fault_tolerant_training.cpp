// Fault-tolerant data-parallel training: three trainer processes over gloo, one of them killed
// with SIGKILL in the middle of training and started again. The survivors discard the step that
// failed, form a new quorum and go on; the restarted trainer asks to enroll, receives the full
// training state from the others (healing) and finishes with them. At the end all three hold
// bit-identical parameters.
//
//   ./fault_tolerant_training                 file store in a temporary directory
//   ./fault_tolerant_training --store redis   a redis-server this program starts on loopback
//   ./fault_tolerant_training --diloco H      DiLoCo: H local steps per outer step, and the outer
//                                             steps are the Manager's (ddp::fault_tolerant_diloco)
//   ./fault_tolerant_training --spares 1      one hot spare: two trainers contribute, the third
//                                             applies every step warm and takes r1's place when it
//                                             is killed, without healing (active_replicas)
//
// No mpirun: the program starts its trainers itself (`--trainer <id> ...`), like a job launcher.
// Under scripts/ddp-supervise (or Slurm), one trainer per replica:
//   ./fault_tolerant_training --trainer r$DDP_REPLICA_ID --store file --dir <shared dir>
//                             [--interface eth0]   across hosts: gloo on this host's eth0
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <thread>
#include <vector>

#include <ddp/bucketer.hpp>
#include <ddp/bucketing/fixed.hpp>
#include <ddp/gloo.hpp>
#include <ddp/gloo/manager_factory.hpp>
#include <ddp/local_steps/fault_tolerant_diloco.hpp>
#include <ddp/manager.hpp>
#include <ddp/stores/file_store.hpp>
#ifdef DDP_EXAMPLE_WITH_REDIS
#include <ddp/stores/redis_store.hpp>
#endif

namespace {

using namespace std::chrono_literals;

constexpr int replicas = 3;
constexpr std::int64_t steps = 100;
constexpr std::size_t dim = 1 << 16;

struct config {
  std::string store = "file";
  std::string dir;
  int redis_port = 0;
  int diloco = 0;         // > 0: inner steps per outer step
  int spares = 0;         // hot spares: manager_options::active_replicas = replicas - spares
  std::string interface;  // gloo's network interface ("eth0"); default loopback: one machine
};

// ---- one trainer process -------------------------------------------------------------------

template <class Store>
int train(const std::string& id, Store& store, int diloco, int spares, const std::string& interface) {
  std::vector<float> w(dim, 0.0f), grad(dim, 0.0f), momentum(dim, 0.0f);
  for (std::size_t k = 0; k < dim; ++k) w[k] = static_cast<float>(std::hash<std::string>{}(id) % 7) * 0.01f;
  ddp::training_state state;
  if (diloco == 0) state.add(w).add(momentum);  // DiLoCo: its anchor and outer momentum instead

  // The cluster preset: a hung or dead replica costs the others one step of at most 5 s plus a
  // quorum re-form, and the gloo communicators' own timeouts follow from it (docs/fault-tolerance.md,
  // "Timing").
  auto opts = ddp::manager_options::fast_failover(id);
  opts.min_replicas = 2;
  opts.active_replicas = spares > 0 ? replicas - spares : 0;
  opts.heal_over = ddp::heal_transport::source_routes;  // the factory keys gloo's rendezvous by q.store
  ddp::gloo::options gloo;
  gloo.interface = interface;  // across hosts: this host's address on it, never loopback
  ddp::Manager m(store, ddp::gloo::manager_factory(gloo), state, opts);
  m.on_event([&](const ddp::manager_event& e) {
    std::printf("%s step %lld: %s\n", id.c_str(), static_cast<long long>(e.step), e.text.c_str());
    std::fflush(stdout);
  });

  const auto seed = static_cast<double>(std::hash<std::string>{}(id) % 101);
  // This replica's batch at step s: pull w towards a moving target.
  const auto compute_gradient = [&](double s) {
    for (std::size_t k = 0; k < dim; ++k) {
      grad[k] = w[k] - static_cast<float>(std::sin(seed + 0.1 * s + 1e-3 * static_cast<double>(k)));
    }
  };
  const auto report = [&] {
    if (m.step() % 20 == 0) {
      std::printf("%s: committed step %lld with %d replicas\n", id.c_str(), static_cast<long long>(m.step()),
                  m.participants());
      std::fflush(stdout);
    }
  };
  if (diloco > 0) {
    ddp::fault_tolerant_diloco<> outer(m, state, {ddp::view(w)}, {.sync_every = diloco});
    while (m.step() < steps || static_cast<int>(m.members().size()) < replicas) {
      const int inner = outer.begin();
      for (int h = 0; h < inner; ++h) {
        compute_gradient(static_cast<double>(m.step() * diloco + h));
        for (std::size_t k = 0; k < dim; ++k) w[k] -= 0.05f * grad[k];  // the inner optimizer: plain SGD
        std::this_thread::sleep_for(20ms / diloco);
      }
      if (outer.end()) report();
    }
  } else {
    ddp::Bucketer<ddp::bucketing::fixed> grads(m);
    // With spares: the Manager's hook zeroes a spare's buckets and divides by the contributors.
    if (spares > 0) grads.register_comm_hook(m.comm_hook());
    grads.add(w, grad);
    m.attach(grads);  // builds it: the Manager compares its layout at every quorum
    while (m.step() < steps || static_cast<int>(m.members().size()) < replicas) {
      m.start_quorum();
      if (m.participating()) {  // a hot spare skips the forward and backward passes
        compute_gradient(static_cast<double>(m.step()));
        std::this_thread::sleep_for(20ms);  // the rest of the forward and backward pass
      }
      grads.mark_ready(0);
      grads.finalize();
      const int contributors = m.participants();
      if (m.should_commit()) {
        if (spares > 0 && contributors != replicas - spares) {  // a spare took the dead one's place
          std::printf("%s: step %lld committed with %d contributors, not %d\n", id.c_str(),
                      static_cast<long long>(m.step()), contributors, replicas - spares);
          return 1;
        }
        for (std::size_t k = 0; k < dim; ++k) {
          momentum[k] = 0.9f * momentum[k] + grad[k];
          w[k] -= 0.05f * momentum[k];
        }
        report();
      }
    }
  }
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (float x : w) {
    std::uint32_t b = 0;
    std::memcpy(&b, &x, 4);
    h = (h ^ b) * 0x100000001b3ull;
  }
  char text[32];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(h));
  store.set("result/" + id, ddp::as_bytes(text));
  const auto& st = m.stats();
  store.set("heals/" + id, ddp::as_bytes(std::to_string(st.heals)));
  std::printf("%s: finished at step %lld: %llu quorums, %llu steps discarded, healed %llu times; parameters %s\n",
              id.c_str(), static_cast<long long>(m.step()), static_cast<unsigned long long>(st.quorums),
              static_cast<unsigned long long>(st.discarded), static_cast<unsigned long long>(st.heals), text);
  return 0;
}

template <class F>
int with_store(const config& c, F&& f) {
  if (c.store == "redis") {
#ifdef DDP_EXAMPLE_WITH_REDIS
    ddp::stores::redis_options ro;
    ro.port = c.redis_port;
    ddp::stores::redis_store s(ro);
    ddp::stores::prefix_store<ddp::stores::redis_store> job(s, "ft-example/");
    return f(job);
#else
    std::printf("SKIP: built without hiredis\n");
    return 0;
#endif
  }
  ddp::stores::file_store s(c.dir);
  return f(s);
}

// ---- the launcher --------------------------------------------------------------------------

pid_t spawn(const std::string& self, const std::string& id, const config& c) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const std::string port = std::to_string(c.redis_port), diloco = std::to_string(c.diloco),
                      spares = std::to_string(c.spares);
    ::execl(self.c_str(), self.c_str(), "--trainer", id.c_str(), "--store", c.store.c_str(), "--dir", c.dir.c_str(),
            "--port", port.c_str(), "--diloco", diloco.c_str(), "--spares", spares.c_str(),
            static_cast<char*>(nullptr));
    std::_Exit(127);
  }
  return pid;
}

std::optional<std::string> find_on_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/bin:/bin";
  for (std::size_t pos = 0; pos <= dirs.size();) {
    const auto end = dirs.find(':', pos);
    const auto p = std::filesystem::path(dirs.substr(pos, end - pos)) / name;
    if (::access(p.c_str(), X_OK) == 0) return p.string();
    if (end == std::string::npos) break;
    pos = end + 1;
  }
  return std::nullopt;
}

// A loopback port the kernel just handed out (bind to port 0): free at this instant.
int free_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int port = 0;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  if (fd >= 0) ::close(fd);
  return port;
}

bool accepts_connections(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

// Starts redis-server on a free loopback port and waits until it accepts connections; (pid, port).
// Another process may take the port between our probe and redis's bind (redis then exits): try
// again on a new port, up to 5 times.
std::optional<std::pair<pid_t, int>> start_redis(const std::string& exe, const std::string& dir) {
  for (int attempt = 0; attempt < 5; ++attempt) {
    const int port = free_loopback_port();
    if (port == 0) continue;
    const pid_t pid = ::fork();
    if (pid == 0) {
      const std::string p = std::to_string(port);
      ::execl(exe.c_str(), exe.c_str(), "--port", p.c_str(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
              "--dir", dir.c_str(), static_cast<char*>(nullptr));
      std::_Exit(127);
    }
    if (pid < 0) return std::nullopt;
    for (int i = 0; i < 500; ++i) {  // up to 5 s on a busy machine
      if (accepts_connections(port)) return std::make_pair(pid, port);
      if (::waitpid(pid, nullptr, WNOHANG) == pid) break;  // it exited: the port was taken
      std::this_thread::sleep_for(10ms);
    }
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
  return std::nullopt;
}

int launch(const std::string& self, config c) {
  // mkdtemp: a fresh 0700 directory under a name nobody can guess and create first (the store
  // refuses a directory another user owns or can write to).
  std::string pattern = (std::filesystem::temp_directory_path() / "ddp-ft-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) {
    std::printf("launcher: cannot create a directory from %s: %s\n", pattern.c_str(), std::strerror(errno));
    return 1;
  }
  c.dir = pattern;
  pid_t redis = -1;
  if (c.store == "redis") {
    const auto exe = find_on_path("redis-server");
    if (!exe) {
      std::printf("SKIP: redis-server not found\n");
      return 0;
    }
    const auto started = start_redis(*exe, c.dir);
    if (!started) {
      std::printf("launcher: redis-server did not start (5 tries on free loopback ports)\n");
      return 1;
    }
    redis = started->first;
    c.redis_port = started->second;
  }
  std::printf("launcher: %d trainers over gloo, %s store%s%s; r1 will be killed and restarted\n", replicas,
              c.store.c_str(),
              c.diloco > 0 ? (", DiLoCo with " + std::to_string(c.diloco) + " inner steps").c_str() : "",
              c.spares > 0 ? (", " + std::to_string(c.spares) + " hot spare(s)").c_str() : "");
  std::fflush(stdout);
  std::map<std::string, pid_t> pids;
  for (int r = 0; r < replicas; ++r) pids["r" + std::to_string(r)] = spawn(self, "r" + std::to_string(r), c);

  std::this_thread::sleep_for(1500ms);
  std::printf("launcher: SIGKILL r1 (pid %d)\n", static_cast<int>(pids["r1"]));
  std::fflush(stdout);
  ::kill(pids["r1"], SIGKILL);
  ::waitpid(pids["r1"], nullptr, 0);
  std::this_thread::sleep_for(500ms);
  std::printf("launcher: restarting r1\n");
  std::fflush(stdout);
  pids["r1"] = spawn(self, "r1", c);

  bool ok = true;
  for (auto& [id, pid] : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  std::vector<std::string> results, heals;
  with_store(c, [&](auto& store) {
    for (int r = 0; r < replicas; ++r) {
      const auto v = store.get("result/r" + std::to_string(r));
      results.push_back(v ? ddp::to_text(*v) : "missing");
      const auto h = store.get("heals/r" + std::to_string(r));
      heals.push_back(h ? ddp::to_text(*h) : "missing");
    }
    return 0;
  });
  bool same = ok;
  for (const auto& r : results) same = same && r == results.front() && r != "missing";
  if (c.spares > 0) {
    // r0 started the job; r2, the spare, received the state once, at the start, never again.
    const bool warm = heals[2] == "1";
    std::printf("launcher: the spare r2 replaced r1 without healing (%s heal(s) in all): %s\n", heals[2].c_str(),
                warm ? "yes" : "NO");
    same = same && warm;
  }
  std::printf("launcher: all %d replicas finished with identical parameters: %s\n", replicas, same ? "yes" : "NO");
  if (redis > 0) {
    ::kill(redis, SIGTERM);
    ::waitpid(redis, nullptr, 0);
  }
  std::error_code ec;
  std::filesystem::remove_all(c.dir, ec);
  return same ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  config c;
  std::string trainer;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--trainer") trainer = v;
    if (k == "--store") c.store = v;
    if (k == "--dir") c.dir = v;
    if (k == "--port") c.redis_port = std::atoi(v.c_str());
    if (k == "--diloco") c.diloco = std::atoi(v.c_str());
    if (k == "--spares") c.spares = std::atoi(v.c_str());
    if (k == "--interface") c.interface = v;
  }
  try {
    if (trainer.empty()) return launch("/proc/self/exe", c);
    return with_store(c, [&](auto& store) { return train(trainer, store, c.diloco, c.spares, c.interface); });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", trainer.empty() ? "launcher" : trainer.c_str(), e.what());
    return 1;
  }
}
