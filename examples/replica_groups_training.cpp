// Fault tolerance between replica groups: three groups of two trainer processes (think: three
// hosts of two GPUs), DDP inside each group and a GroupManager between the groups, all over gloo
// and a file store, run and restarted by ddp-supervise (docs/launching.md). One process of group
// g1 crashes mid-training (it SIGKILLs itself); the supervisor stops its group-mate (the group
// shares its fate); g0 and g2 go on without g1; the supervisor starts g1 again as two fresh
// processes in a fresh inner namespace, which rejoin, heal (each rank half of the state, from the
// same-index ranks of g0 and g2 at once) and finish with the others. At the end all six hold
// bit-identical parameters and momentum: rank g0.0 compares everyone's hash.
//
//   ddp-supervise -n 3 --group-size 2 -- ./replica_groups_training --crash-at 20
//   ... ./replica_groups_training --interface eth0     across hosts (ddp-supervise --srun under
//                                                      Slurm): gloo between groups on eth0
//
// --crash-at S: rank 1 of group 1, at the group's first start, SIGKILLs itself in step S.
// Each process reads its group, rank, restart count and store from ddp-supervise's environment
// (ddp::replica_env). docs/replica-groups.md.
#include <signal.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <ddp/bucketer.hpp>
#include <ddp/bucketing/fixed.hpp>
#include <ddp/gloo.hpp>
#include <ddp/groups.hpp>
#include <ddp/launch_env.hpp>
#include <ddp/stores/file_store.hpp>
#include <ddp/stores/prefix_store.hpp>

namespace {

using namespace std::chrono_literals;

constexpr std::int64_t steps = 80;
constexpr std::size_t dim = 1 << 16;

// ---- one trainer process: rank env.group_rank of group env.id -----------------------------------

int train(const ddp::replica_env& env, std::int64_t crash_at, const std::string& interface) {
  const std::string group = "g" + std::to_string(env.id);
  const int index = env.group_rank, incarnation = env.incarnation, group_size = env.group_size, groups = env.replicas;
  ddp::stores::file_store store(env.store->path);
  ddp::gloo::options gloo_opts;
  gloo_opts.timeout = 3s;
  gloo_opts.connect_timeout = 10s;
  gloo_opts.interface = interface;  // across hosts: this host's address on it (a group is on one host)
  // The group's own communicator. Its followers wait on it while the leader forms a quorum and
  // heals: its timeout covers quorum_timeout.
  ddp::stores::prefix_store<ddp::stores::file_store> inner_ns(
      store, "inner/" + group + "/" + std::to_string(incarnation) + "/");
  ddp::gloo::options inner_opts = gloo_opts;
  inner_opts.timeout = 90s;
  inner_opts.interface = {};  // loopback: the group's ranks share a host
  ddp::gloo::communicator inner(ddp::store_ref(inner_ns), index, group_size, inner_opts);

  std::vector<float> w(dim, 0.0f), grad(dim, 0.0f), momentum(dim, 0.0f);
  for (std::size_t k = 0; k < dim; ++k) w[k] = static_cast<float>(std::hash<std::string>{}(group) % 7) * 0.01f;
  ddp::training_state state;
  state.add(w).add(momentum);  // every rank holds all of it: group_state::replicated

  ddp::manager_options opts;
  opts.replica_id = group;  // one id per group, on each of its ranks
  opts.min_replicas = 2;
  opts.heartbeat_interval = 50ms;
  opts.heartbeat_timeout = 1000ms;
  opts.settle = 300ms;
  opts.quorum_timeout = 60s;
  opts.heal_over = ddp::heal_transport::source_routes;
  ddp::GroupManager<ddp::gloo::communicator> gm(
      inner, store,
      [&](const ddp::quorum_info& q) {  // this rank's index across the groups
        return ddp::any_communicator(ddp::gloo::communicator(q.store, q.rank, q.size, gloo_opts));
      },
      state, ddp::group_state::replicated, opts);
  const std::string me = group + "." + std::to_string(index);
  gm.on_event([&](const ddp::manager_event& e) {  // the leader's
    std::printf("%s step %lld: %s\n", me.c_str(), static_cast<long long>(e.step), e.text.c_str());
    std::fflush(stdout);
  });
  // Gradients: reduced inside the group, each rank's half allreduced across, gathered inside.
  ddp::group_communicator<ddp::communicator_ref, ddp::communicator_ref> comm(inner, gm);
  ddp::Bucketer<ddp::bucketing::fixed> grads(comm, {}, {.check_layout = false});
  grads.add(w, grad);
  grads.build();

  const auto seed = static_cast<double>(std::hash<std::string>{}(me) % 101);
  try {
    while (gm.step() < steps || static_cast<int>(gm.members().size()) < groups) {
      gm.start_quorum();
      for (std::size_t k = 0; k < dim; ++k) {  // this rank's batch: pull w towards a moving target
        grad[k] = w[k] - static_cast<float>(std::sin(seed + 0.1 * static_cast<double>(gm.step()) + 1e-3 * k));
      }
      std::this_thread::sleep_for(20ms);  // "compute"
      if (env.id == 1 && index == 1 && incarnation == 0 && gm.step() == crash_at) {
        std::printf("%s: crashing in step %lld (SIGKILL)\n", me.c_str(), static_cast<long long>(gm.step()));
        std::fflush(stdout);
        ::raise(SIGKILL);  // what a crash looks like to the others: gone in the middle of a step
      }
      grads.mark_ready(0);
      grads.finalize();
      if (!gm.should_commit()) continue;
      for (std::size_t k = 0; k < dim; ++k) {
        momentum[k] = 0.9f * momentum[k] + grad[k];
        w[k] -= 0.05f * momentum[k];
      }
      if (gm.step() % 20 == 0 && index == 0) {
        std::printf("%s: committed step %lld with %zu groups\n", group.c_str(), static_cast<long long>(gm.step()),
                    gm.members().size());
        std::fflush(stdout);
      }
    }
  } catch (const ddp::error& e) {  // a rank of this group died: the whole group stops (the
                                   // supervisor stops it too, and may be first)
    std::printf("%s: leaving with my group: %s\n", me.c_str(), e.what());
    std::fflush(stdout);
    return 3;
  }
  // The bits of the parameters and the momentum (FNV-1a over every float's bytes): g0.0 compares
  // the six hashes, so equal means bit-identical, not equal after rounding.
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (const auto* v : {&w, &momentum}) {
    for (const float x : *v) {
      std::uint32_t b = 0;
      std::memcpy(&b, &x, 4);
      h = (h ^ b) * 0x100000001b3ull;
    }
  }
  char text[32];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(h));
  store.set("result/" + me, ddp::as_bytes(std::string(text)));
  std::printf("%s: finished at step %lld, healed %llu times; parameters and momentum %s\n", me.c_str(),
              static_cast<long long>(gm.step()), static_cast<unsigned long long>(gm.stats().heals), text);
  std::fflush(stdout);
  if (me != "g0.0") return 0;

  // g0.0 checks the job: every rank of every group, bit for bit.
  std::vector<std::string> keys;
  for (int g = 0; g < groups; ++g) {
    for (int i = 0; i < group_size; ++i) keys.push_back("result/g" + std::to_string(g) + "." + std::to_string(i));
  }
  store.wait(keys, 60s);
  bool same = true;
  for (const auto& key : keys) same = same && ddp::to_text(*store.get(key)) == text;
  std::printf("%s: all %d trainers finished with bit-identical parameters and momentum (hash %s): %s\n", me.c_str(),
              groups * group_size, text, same ? "yes" : "NO");
  return same ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string interface;
  std::int64_t crash_at = -1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--crash-at") crash_at = std::atoll(v.c_str());
    if (k == "--interface") interface = v;
  }
  std::string me = "trainer";
  try {
    const auto env = ddp::replica_env::detect();
    if (!env || !env->store || env->store->type != ddp::store_address::kind::file || env->group_size < 2) {
      std::fprintf(stderr,
                   "%s: run it under ddp-supervise with replica groups and a file store, which starts and restarts "
                   "the groups and gives each process its group, rank and the store:\n"
                   "  ddp-supervise -n 3 --group-size 2 -- %s --crash-at 20\n",
                   argv[0], argv[0]);
      return 2;
    }
    me = "g" + std::to_string(env->id) + "." + std::to_string(env->group_rank);
    return train(*env, crash_at, interface);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", me.c_str(), e.what());
    return 1;
  }
}
