// Fault-tolerant data-parallel training: one trainer per replica over gloo, run and restarted by
// ddp-supervise (docs/launching.md). One trainer crashes in the middle of training (it SIGKILLs
// itself); the survivors discard the step that failed, form a new quorum and go on; the supervisor
// starts the dead one again, which asks to enroll, receives the full training state from the
// others (healing) and finishes with them. At the end all replicas hold bit-identical parameters:
// replica 0 compares everyone's hash.
//
//   ddp-supervise -n 3 -- ./fault_tolerant_training --crash-at 30
//   ddp-supervise -n 3 --store redis -- ./fault_tolerant_training --crash-at 30
//       a password-protected redis-server the supervisor starts, instead of a file store
//   ... ./fault_tolerant_training --diloco H     DiLoCo: H local steps per outer step, and the outer
//                                                steps are the Manager's (ddp::fault_tolerant_diloco)
//   ... ./fault_tolerant_training --spares 1     one hot spare: two trainers contribute, the third
//                                                applies every step warm and takes r1's place when it
//                                                dies, without healing (active_replicas)
//   ... ./fault_tolerant_training --interface eth0   across hosts (ddp-supervise --srun under Slurm):
//                                                gloo on this host's eth0, never loopback
//
// --crash-at S: replica 1, at its first start, SIGKILLs itself in the middle of step S.
// The trainer reads its replica id, restart count and store from ddp-supervise's environment
// (ddp::replica_env); the job's secret (DDP_JOB_SECRET) is read by gloo itself.
#include <signal.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <ddp/bucketer.hpp>
#include <ddp/bucketing/fixed.hpp>
#include <ddp/gloo.hpp>
#include <ddp/gloo/manager_factory.hpp>
#include <ddp/launch_env.hpp>
#include <ddp/local_steps/fault_tolerant_diloco.hpp>
#include <ddp/manager.hpp>
#include <ddp/stores/file_store.hpp>
#ifdef DDP_EXAMPLE_WITH_REDIS
#include <ddp/stores/redis_store.hpp>
#endif

namespace {

using namespace std::chrono_literals;

constexpr std::int64_t steps = 100;
constexpr std::size_t dim = 1 << 16;

struct config {
  int diloco = 0;              // > 0: inner steps per outer step
  int spares = 0;              // hot spares: manager_options::active_replicas = replicas - spares
  std::int64_t crash_at = -1;  // replica 1's first start SIGKILLs itself in this step
  std::string interface;       // gloo's network interface ("eth0"); default loopback: one machine
};

// The bits of the parameters (FNV-1a over every float's bytes): equal hashes mean bit-identical.
std::string hash_of(const std::vector<float>& w) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (float x : w) {
    std::uint32_t b = 0;
    std::memcpy(&b, &x, 4);
    h = (h ^ b) * 0x100000001b3ull;
  }
  char text[32];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(h));
  return text;
}

template <class Store>
int train(const config& c, const ddp::replica_env& env, Store& store) {
  const std::string id = "r" + std::to_string(env.id);
  const int replicas = env.replicas;
  std::vector<float> w(dim, 0.0f), grad(dim, 0.0f), momentum(dim, 0.0f);
  for (std::size_t k = 0; k < dim; ++k) w[k] = static_cast<float>(std::hash<std::string>{}(id) % 7) * 0.01f;
  ddp::training_state state;
  if (c.diloco == 0) state.add(w).add(momentum);  // DiLoCo: its anchor and outer momentum instead

  // The cluster preset: a hung or dead replica costs the others one step of at most 5 s plus a
  // quorum re-form, and the gloo communicators' own timeouts follow from it (docs/fault-tolerance.md,
  // "Timing").
  auto opts = ddp::manager_options::fast_failover(id);
  opts.min_replicas = 2;
  opts.active_replicas = c.spares > 0 ? replicas - c.spares : 0;
  opts.heal_over = ddp::heal_transport::source_routes;  // the factory keys gloo's rendezvous by q.store
  ddp::gloo::options gloo;
  gloo.interface = c.interface;  // across hosts: this host's address on it, never loopback
  ddp::Manager m(store, ddp::gloo::manager_factory(gloo), state, opts);
  m.on_event([&](const ddp::manager_event& e) {
    std::printf("%s step %lld: %s\n", id.c_str(), static_cast<long long>(e.step), e.text.c_str());
    std::fflush(stdout);
  });
  // What a crash looks like to the others: this process vanishes in the middle of a step.
  const auto maybe_crash = [&] {
    if (env.id == 1 && env.incarnation == 0 && m.step() == c.crash_at) {
      std::printf("%s: crashing in step %lld (SIGKILL)\n", id.c_str(), static_cast<long long>(m.step()));
      std::fflush(stdout);
      ::raise(SIGKILL);
    }
  };

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
  if (c.diloco > 0) {
    ddp::fault_tolerant_diloco<> outer(m, state, {ddp::view(w)}, {.sync_every = c.diloco});
    while (m.step() < steps || static_cast<int>(m.members().size()) < replicas) {
      const int inner = outer.begin();
      for (int h = 0; h < inner; ++h) {
        compute_gradient(static_cast<double>(m.step() * c.diloco + h));
        for (std::size_t k = 0; k < dim; ++k) w[k] -= 0.05f * grad[k];  // the inner optimizer: plain SGD
        std::this_thread::sleep_for(20ms / c.diloco);
        if (h == 1) maybe_crash();
      }
      if (outer.end()) report();
    }
  } else {
    ddp::Bucketer<ddp::bucketing::fixed> grads(m);
    // With spares: the Manager's hook zeroes a spare's buckets and divides by the contributors.
    if (c.spares > 0) grads.register_comm_hook(m.comm_hook());
    grads.add(w, grad);
    m.attach(grads);  // builds it: the Manager compares its layout at every quorum
    while (m.step() < steps || static_cast<int>(m.members().size()) < replicas) {
      m.start_quorum();
      if (m.participating()) {  // a hot spare skips the forward and backward passes
        compute_gradient(static_cast<double>(m.step()));
        std::this_thread::sleep_for(20ms);  // the rest of the forward and backward pass
      }
      maybe_crash();
      grads.mark_ready(0);
      grads.finalize();
      const int contributors = m.participants();
      if (m.should_commit()) {
        if (c.spares > 0 && contributors != replicas - c.spares) {  // a spare took the dead one's place
          std::printf("%s: step %lld committed with %d contributors, not %d\n", id.c_str(),
                      static_cast<long long>(m.step()), contributors, replicas - c.spares);
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
  const std::string hash = hash_of(w);
  const auto& st = m.stats();
  store.set("heals/" + id, ddp::as_bytes(std::to_string(st.heals)));
  store.set("result/" + id, ddp::as_bytes(hash));
  std::printf("%s: finished at step %lld: %llu quorums, %llu steps discarded, healed %llu times; parameters %s\n",
              id.c_str(), static_cast<long long>(m.step()), static_cast<unsigned long long>(st.quorums),
              static_cast<unsigned long long>(st.discarded), static_cast<unsigned long long>(st.heals), hash.c_str());
  std::fflush(stdout);
  if (env.id != 0) return 0;

  // Replica 0 checks the job: every replica's parameters, bit for bit.
  std::vector<std::string> keys;
  for (int r = 0; r < replicas; ++r) keys.push_back("result/r" + std::to_string(r));
  store.wait(keys, 60s);
  bool same = true;
  for (const auto& key : keys) same = same && ddp::to_text(*store.get(key)) == hash;
  if (c.spares > 0) {
    // r0 started the job; the spare r2 received the state once, at the start, never again.
    store.wait(std::vector<std::string>{"heals/r2"}, 60s);
    const std::string heals = ddp::to_text(*store.get("heals/r2"));
    std::printf("%s: the spare r2 replaced r1 without healing (%s heal(s) in all): %s\n", id.c_str(), heals.c_str(),
                heals == "1" ? "yes" : "NO");
    same = same && heals == "1";
  }
  std::printf("%s: all %d replicas finished with identical parameters: %s\n", id.c_str(), replicas,
              same ? "yes" : "NO");
  return same ? 0 : 1;
}

template <class F>
int with_store(const ddp::store_address& where, F&& f) {
  if (where.type == ddp::store_address::kind::redis) {
#ifdef DDP_EXAMPLE_WITH_REDIS
    ddp::stores::redis_options ro;  // the password: $DDP_REDIS_PASSWORD, which ddp-supervise sets
    ro.host = where.host;
    ro.port = where.port;
    ddp::stores::redis_store s(ro);
    ddp::stores::prefix_store<ddp::stores::redis_store> job(s, "ft-example/");
    return f(job);
#else
    std::printf("SKIP: built without hiredis\n");
    return 0;
#endif
  }
  ddp::stores::file_store s(where.path);
  return f(s);
}

}  // namespace

int main(int argc, char** argv) {
  config c;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--diloco") c.diloco = std::atoi(v.c_str());
    if (k == "--spares") c.spares = std::atoi(v.c_str());
    if (k == "--crash-at") c.crash_at = std::atoll(v.c_str());
    if (k == "--interface") c.interface = v;
  }
  std::string me = "trainer";
  try {
    const auto env = ddp::replica_env::detect();
    if (!env || !env->store) {
      std::fprintf(stderr,
                   "%s: run it under ddp-supervise, which starts and restarts one trainer per replica and gives "
                   "each its replica id and the job's store:\n  ddp-supervise -n 3 -- %s --crash-at 30\n",
                   argv[0], argv[0]);
      return 2;
    }
    me = "r" + std::to_string(env->id);
    return with_store(*env->store, [&](auto& store) { return train(c, *env, store); });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", me.c_str(), e.what());
    return 1;
  }
}
