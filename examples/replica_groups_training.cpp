// Fault tolerance between replica groups: three groups of two trainer processes (think: three
// hosts of two GPUs), DDP inside each group and a GroupManager between the groups, all over gloo
// and a file store. One process of group g1 is killed with SIGKILL mid-training: its group-mate
// stops too (the group shares its fate), g0 and g2 go on without g1; the launcher restarts g1 as
// two fresh processes, which rejoin, heal (each rank half of the state, from the same-index ranks
// of g0 and g2 at once) and finish with the others. At the end all six hold bit-identical parameters
// and momentum (each trainer hashes their bits; the launcher compares the hashes).
//
//   ./replica_groups_training
//
// No mpirun: the program starts its trainers itself (`--group <g> --rank <i> --dir <store>`).
// Under scripts/ddp-supervise --group-size 2 (or Slurm), one trainer per process:
//   ./replica_groups_training --group g$DDP_REPLICA_ID --rank $DDP_GROUP_RANK
//       --incarnation $DDP_REPLICA_INCARNATION --dir <shared dir> [--interface eth0]
// docs/replica-groups.md.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <ddp/bucketer.hpp>
#include <ddp/bucketing/fixed.hpp>
#include <ddp/gloo.hpp>
#include <ddp/groups.hpp>
#include <ddp/stores/file_store.hpp>
#include <ddp/stores/prefix_store.hpp>

namespace {

using namespace std::chrono_literals;

constexpr int groups = 3, group_size = 2;
constexpr std::int64_t steps = 80, kill_after = 20;
constexpr std::size_t dim = 1 << 16;

// ---- one trainer process: rank `index` of group `group` ----------------------------------------

int train(const std::string& group, int index, int incarnation, const std::string& dir, const std::string& interface) {
  ddp::stores::file_store store(dir);
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
      grads.mark_ready(0);
      grads.finalize();
      if (!gm.should_commit()) continue;
      for (std::size_t k = 0; k < dim; ++k) {
        momentum[k] = 0.9f * momentum[k] + grad[k];
        w[k] -= 0.05f * momentum[k];
      }
      if (me == "g0.0") store.add("progress", 1);  // the launcher kills a rank of g1 after kill_after steps
      if (gm.step() % 20 == 0 && index == 0) {
        std::printf("%s: committed step %lld with %zu groups\n", group.c_str(), static_cast<long long>(gm.step()),
                    gm.members().size());
        std::fflush(stdout);
      }
    }
  } catch (const ddp::error& e) {  // a rank of this group died: the whole group stops
    std::printf("%s: leaving with my group: %s\n", me.c_str(), e.what());
    std::fflush(stdout);
    return 3;
  }
  // The bits of the parameters and the momentum (FNV-1a over every float's bytes): the launcher
  // compares the six hashes, so equal means bit-identical, not equal after rounding.
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
  return 0;
}

// ---- the launcher ------------------------------------------------------------------------------

pid_t spawn(const std::string& self, int group, int index, int incarnation, const std::string& dir) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const std::string g = "g" + std::to_string(group), i = std::to_string(index), n = std::to_string(incarnation);
    ::execl(self.c_str(), self.c_str(), "--group", g.c_str(), "--rank", i.c_str(), "--incarnation", n.c_str(), "--dir",
            dir.c_str(), static_cast<char*>(nullptr));
    std::_Exit(127);
  }
  return pid;
}

int launch(const std::string& self) {
  std::string pattern = (std::filesystem::temp_directory_path() / "ddp-groups-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) {
    std::printf("launcher: cannot create a directory from %s: %s\n", pattern.c_str(), std::strerror(errno));
    return 1;
  }
  const std::string dir = pattern;
  std::printf("launcher: %d groups of %d trainers over gloo; a rank of g1 will be killed, g1 restarted\n", groups,
              group_size);
  std::fflush(stdout);
  std::map<std::pair<int, int>, pid_t> pids;
  for (int g = 0; g < groups; ++g) {
    for (int i = 0; i < group_size; ++i) pids[{g, i}] = spawn(self, g, i, 0, dir);
  }
  ddp::stores::file_store store(dir);
  for (int waited = 0; store.add("progress", 0) < kill_after && waited < 3000; ++waited) {
    std::this_thread::sleep_for(10ms);
  }
  std::printf("launcher: SIGKILL g1.1 (pid %d)\n", static_cast<int>(pids[{1, 1}]));
  std::fflush(stdout);
  ::kill(pids[{1, 1}], SIGKILL);
  ::waitpid(pids[{1, 1}], nullptr, 0);
  int status = 0;
  ::waitpid(pids[{1, 0}], &status, 0);  // its group-mate stops on its own
  const bool mate_left = WIFEXITED(status) && WEXITSTATUS(status) == 3;
  std::printf("launcher: g1.0 left with its group: %s\n", mate_left ? "yes" : "NO");
  const std::int64_t at_kill = store.add("progress", 0);
  for (int waited = 0; store.add("progress", 0) < at_kill + 10 && waited < 3000; ++waited) {
    std::this_thread::sleep_for(10ms);
  }
  std::printf("launcher: g0 and g2 committed %lld steps without g1; restarting g1\n",
              static_cast<long long>(store.add("progress", 0) - at_kill));
  std::fflush(stdout);
  for (int i = 0; i < group_size; ++i) pids[{1, i}] = spawn(self, 1, i, 1, dir);

  bool ok = mate_left;
  for (auto& [who, pid] : pids) {
    ::waitpid(pid, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  std::vector<std::string> results;
  for (int g = 0; g < groups; ++g) {
    for (int i = 0; i < group_size; ++i) {
      const auto v = store.get("result/g" + std::to_string(g) + "." + std::to_string(i));
      results.push_back(v ? ddp::to_text(*v) : "missing");
    }
  }
  bool same = ok;
  for (const auto& r : results) same = same && r == results.front() && r != "missing";
  std::printf("launcher: all %d trainers finished with bit-identical parameters and momentum (hash %s): %s\n",
              groups * group_size, results.front().c_str(), same ? "yes" : "NO");
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return same ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string group, dir, interface;
  int index = 0, incarnation = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--group") group = v;
    if (k == "--rank") index = std::atoi(v.c_str());
    if (k == "--incarnation") incarnation = std::atoi(v.c_str());
    if (k == "--dir") dir = v;
    if (k == "--interface") interface = v;
  }
  try {
    if (group.empty()) return launch("/proc/self/exe");
    return train(group, index, incarnation, dir, interface);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s.%d: %s\n", group.empty() ? "launcher" : group.c_str(), index, e.what());
    return 1;
  }
}
