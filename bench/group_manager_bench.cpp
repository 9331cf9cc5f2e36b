// Replica groups against one replica per rank, measured (issue #30). H hosts of k ranks train the
// same gradient over the same state, as processes over gloo and a file store:
//
//   flat    every rank a replica: a ddp::Manager each, the gradient allreduced through it;
//   groups  a group per host: a GroupManager each (DDP inside the group, group_state::replicated),
//           the gradient allreduced through group_communicator(inner gloo, GroupManager).
//
// The last host starts late (fresh state) and heals. Per shape:
//
//   step ms          median commit interval once every replica is in (allreduce + vote, no compute)
//   cross MB/rank    payload each rank hands the replica dimension per step (its cross allreduces)
//   NIC MB/host      bytes each host sent on its link per step (/proc/net/dev in its namespace;
//                    on one machine: loopback, shared by every rank)
//   heal ms          the late host's heal (Manager stats; a group's covers every rank's part, the
//                    hash checks and the sharing inside the group)
//   join ms          the late host's processes up to their first committed step
//   join MB/host     bytes the late host received on its link until then (its heal, mostly)
//
//   group_manager_bench [--hosts 2] [--ranks-per-host 2] [--grad-mib 16] [--state-mib 64]
//                       [--steps 20] [--heal-over routes|quorum] [--shapes flat,groups] [--on-hosts]
//
// Across test hosts with a capped link (docs/replica-groups.md has the numbers):
//
//   scripts/ddp-run --hosts 3 --hosts-only --link-rate 1gbit build/default/bench/group_manager_bench
//       --on-hosts --hosts 3     (one command line)
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ddp/gloo.hpp>
#include <ddp/groups.hpp>
#include <ddp/manager.hpp>
#include <ddp/stores/file_store.hpp>
#include <ddp/stores/prefix_store.hpp>

#include "common/cli.hpp"
#include "common/stats.hpp"
#include "common/table.hpp"

namespace {

using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

struct config {
  int hosts = 2;
  int k = 2;  // ranks per host
  std::size_t grad_bytes = std::size_t{16} << 20;
  std::size_t state_bytes = std::size_t{64} << 20;
  int steps = 20;      // measured steps once every replica is in
  int warm_steps = 5;  // committed before the last host starts
  ddp::heal_transport heal_over = ddp::heal_transport::source_routes;
  bool on_hosts = false;
  int timeout_s = 180;
};

// This process joins test host `host`'s network namespace (made by ddp-run --hosts).
void enter_host(const std::string& host) {
  const char* cluster = std::getenv("DDP_HOSTS_ID");
  if (cluster == nullptr) throw std::runtime_error("--on-hosts: DDP_HOSTS_ID not set (run under ddp-run --hosts-only)");
  const std::string path = std::string("/run/netns/") + cluster + "-" + host;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0) throw std::runtime_error("cannot enter " + path);
  ::close(fd);
}

// Bytes sent (or received) on `iface` in this process's network namespace (/proc/net/dev is per
// namespace).
std::uint64_t link_bytes(const std::string& iface, bool received = false) {
  std::ifstream in("/proc/net/dev");
  for (std::string line; std::getline(in, line);) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string name = line.substr(0, colon);
    name.erase(0, name.find_first_not_of(' '));
    if (name != iface) continue;
    std::istringstream fields(line.substr(colon + 1));
    std::uint64_t v = 0;
    for (int f = 0; f < (received ? 1 : 9); ++f) fields >> v;  // the 1st field: bytes received; the 9th: sent
    return v;
  }
  return 0;
}

// A gloo communicator that counts the payload bytes of its allreduces (what a rank hands the
// replica dimension).
class counted_comm {
 public:
  counted_comm(ddp::gloo::communicator c, std::shared_ptr<std::atomic<std::uint64_t>> bytes)
      : c_(std::move(c)), bytes_(std::move(bytes)) {}
  [[nodiscard]] int rank() const { return c_.rank(); }
  [[nodiscard]] int size() const { return c_.size(); }
  ddp::work allreduce(std::span<const ddp::tensor_view> ts, ddp::reduce_op op) {
    for (const auto& t : ts) *bytes_ += t.bytes();
    return c_.allreduce(ts, op);
  }
  ddp::work broadcast(std::span<const ddp::tensor_view> ts, int root) { return c_.broadcast(ts, root); }
  ddp::work allgather(ddp::tensor_view in, ddp::tensor_view out) { return c_.allgather(in, out); }
  ddp::work reduce_scatter(ddp::tensor_view in, ddp::tensor_view out, ddp::reduce_op op) {
    return c_.reduce_scatter(in, out, op);
  }
  ddp::work barrier() { return c_.barrier(); }
  void abort() noexcept { c_.abort(); }

 private:
  ddp::gloo::communicator c_;
  std::shared_ptr<std::atomic<std::uint64_t>> bytes_;
};

double ms_between(clock_type::time_point a, clock_type::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// One rank (host h, index i) of a shape; prints "key=value" lines to `out`.
void run_rank(const config& c, bool grouped, int h, int i, const std::filesystem::path& dir, std::FILE* out) {
  std::string iface = "lo";
  if (c.on_hosts) {
    enter_host("h" + std::to_string(h + 1));
    if (const char* name = std::getenv("DDP_HOSTS_IFNAME")) iface = name;
  }
  ddp::stores::file_store store(dir);
  const bool late = h == c.hosts - 1;
  while (late && store.add("progress", 0) < c.warm_steps) std::this_thread::sleep_for(5ms);
  const auto started = clock_type::now();

  ddp::gloo::options go;
  go.timeout = 60s;
  go.connect_timeout = 30s;
  go.interface = c.on_hosts ? iface : "";
  go.progress = {};
  ddp::manager_options o;
  o.min_replicas = grouped ? c.hosts - 1 : (c.hosts - 1) * c.k;
  o.heartbeat_interval = 50ms;
  o.heartbeat_timeout = 1000ms;
  o.settle = 100ms;
  o.quorum_timeout = 60s;
  o.heal_over = c.heal_over;
  o.progress = {};
  o.replica_id = grouped ? "h" + std::to_string(h) : "h" + std::to_string(h) + "." + std::to_string(i);
  std::vector<float> state_values(c.state_bytes / sizeof(float), static_cast<float>(h + 1));
  std::vector<float> grad(c.grad_bytes / sizeof(float), 1.0f);
  ddp::training_state state;
  state.add(state_values);
  auto cross_bytes = std::make_shared<std::atomic<std::uint64_t>>(0);
  const ddp::communicator_factory factory = [&](const ddp::quorum_info& q) {
    return ddp::any_communicator(counted_comm(ddp::gloo::communicator(q.store, q.rank, q.size, go), cross_bytes));
  };

  // Both shapes as: the step's calls and the introspection the measurement needs.
  struct step_api {
    std::function<void()> start, reduce;
    std::function<bool()> commit;
    std::function<std::int64_t()> step;
    std::function<std::size_t()> members;
    std::function<double()> heal_ms;
  } api;
  std::unique_ptr<ddp::Manager> flat;
  std::unique_ptr<ddp::stores::prefix_store<ddp::stores::file_store>> inner_ns;
  std::unique_ptr<ddp::gloo::communicator> inner;
  std::unique_ptr<ddp::GroupManager<ddp::gloo::communicator>> gm;
  std::unique_ptr<ddp::group_communicator<ddp::communicator_ref, ddp::communicator_ref>> gc;
  if (grouped) {
    inner_ns = std::make_unique<ddp::stores::prefix_store<ddp::stores::file_store>>(
        store, "inner/h" + std::to_string(h) + "/");
    ddp::gloo::options io = go;
    io.timeout = 120s;  // covers the leader's quorum and heal
    inner = std::make_unique<ddp::gloo::communicator>(ddp::store_ref(*inner_ns), i, c.k, io);
    gm = std::make_unique<ddp::GroupManager<ddp::gloo::communicator>>(*inner, store, factory, state,
                                                                      ddp::group_state::replicated, o);
    gc = std::make_unique<ddp::group_communicator<ddp::communicator_ref, ddp::communicator_ref>>(*inner, *gm);
    api = {[&] { gm->start_quorum(); },
           [&] { ddp::communicator_ref(*gc).allreduce(grad, ddp::reduce_op::sum).wait(); },
           [&] { return gm->should_commit(); },
           [&] { return gm->step(); },
           [&] { return gm->members().size(); },
           [&] { return gm->stats().heal_ms; }};
  } else {
    flat = std::make_unique<ddp::Manager>(store, factory, state, o);
    api = {[&] { flat->start_quorum(); },
           [&] { ddp::communicator_ref(*flat).allreduce(grad, ddp::reduce_op::sum).wait(); },
           [&] { return flat->should_commit(); },
           [&] { return flat->step(); },
           [&] { return flat->members().size(); },
           [&] { return flat->stats().heal_ms; }};
  }
  const std::size_t everyone = grouped ? static_cast<std::size_t>(c.hosts) : static_cast<std::size_t>(c.hosts * c.k);

  std::int64_t first_full = -1;  // the first step committed with every replica in
  std::map<std::int64_t, clock_type::time_point> committed;
  std::map<std::int64_t, std::uint64_t> tx_at, cross_at;
  const std::uint64_t rx_before = link_bytes(iface, true);
  std::uint64_t rx_joined = 0;
  double join_ms = -1;
  for (int guard = 0; guard < 100000; ++guard) {
    api.start();
    const std::int64_t s = api.step();
    api.reduce();
    if (!api.commit()) continue;
    const auto t = clock_type::now();
    if (join_ms < 0) {
      join_ms = ms_between(started, t);
      rx_joined = link_bytes(iface, true);
    }
    committed[s] = t;
    tx_at[s] = link_bytes(iface);
    cross_at[s] = *cross_bytes;
    const auto seen = store.add("progress", 0);
    if (api.step() > seen) store.add("progress", api.step() - seen);
    if (first_full < 0 && api.members() == everyone) first_full = s;
    if (first_full >= 0 && s >= first_full + 3 + c.steps) break;
  }
  const std::int64_t a = first_full + 3, b = first_full + 3 + c.steps;
  std::vector<double> intervals;
  for (std::int64_t s = a + 1; s <= b; ++s) {
    if (committed.count(s) && committed.count(s - 1)) intervals.push_back(ms_between(committed[s - 1], committed[s]));
  }
  const double steps = static_cast<double>(b - a);
  std::fprintf(out, "step_ms=%.3f\n", intervals.empty() ? -1.0 : bench::median(intervals));
  std::fprintf(out, "cross_mb=%.3f\n", static_cast<double>(cross_at[b] - cross_at[a]) / steps / 1e6);
  if (i == 0) std::fprintf(out, "nic_mb=%.3f\n", static_cast<double>(tx_at[b] - tx_at[a]) / steps / 1e6);
  if (late) {
    std::fprintf(out, "heal_ms=%.3f\njoin_ms=%.3f\n", api.heal_ms(), join_ms);
    if (i == 0) std::fprintf(out, "join_rx_mb=%.3f\n", static_cast<double>(rx_joined - rx_before) / 1e6);
  }
  std::fflush(out);
}

struct shape_result {
  bool ok = false;
  std::string why;
  double step_ms = 0, cross_mb = 0, nic_mb = 0, heal_ms = 0, join_ms = 0, join_rx_mb = 0;
};

// Forks every rank of a shape, collects what they print, and summarises.
shape_result run_shape(const config& c, bool grouped) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("ddp-group-bench-" + std::to_string(::getpid()) + (grouped ? "-groups" : "-flat"));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  struct child {
    pid_t pid;
    int fd;
    int host, index;
    std::string text;
  };
  std::vector<child> children;
  for (int h = 0; h < c.hosts; ++h) {
    for (int i = 0; i < c.k; ++i) {
      int p[2];
      if (::pipe(p) != 0) throw std::runtime_error("pipe failed");
      const pid_t pid = ::fork();
      if (pid == 0) {
        ::close(p[0]);
        std::FILE* out = ::fdopen(p[1], "w");
        try {
          run_rank(c, grouped, h, i, dir, out);
        } catch (const std::exception& e) {
          std::fprintf(out, "error=%s\n", e.what());
          std::fflush(out);
          std::_Exit(1);
        }
        std::_Exit(0);
      }
      ::close(p[1]);
      children.push_back({pid, p[0], h, i, {}});
    }
  }
  shape_result r;
  const auto deadline = clock_type::now() + std::chrono::seconds(c.timeout_s);
  std::size_t running = children.size();
  while (running > 0 && clock_type::now() < deadline) {
    for (auto& ch : children) {
      if (ch.pid <= 0) continue;
      int status = 0;
      if (::waitpid(ch.pid, &status, WNOHANG) == ch.pid) {
        char buf[4096];
        for (ssize_t n; (n = ::read(ch.fd, buf, sizeof buf)) > 0;) ch.text.append(buf, static_cast<std::size_t>(n));
        ::close(ch.fd);
        ch.pid = 0;
        --running;
      }
    }
    std::this_thread::sleep_for(20ms);
  }
  for (auto& ch : children) {
    if (ch.pid > 0) {
      ::kill(ch.pid, SIGKILL);
      ::waitpid(ch.pid, nullptr, 0);
      ::close(ch.fd);
      r.why = "timed out after " + std::to_string(c.timeout_s) + " s";
    }
  }
  std::filesystem::remove_all(dir);
  if (!r.why.empty()) return r;
  std::vector<double> step_ms, cross, nic;
  for (const auto& ch : children) {
    std::map<std::string, std::string> kv;
    std::istringstream in(ch.text);
    for (std::string line; std::getline(in, line);) {
      const auto eq = line.find('=');
      if (eq != std::string::npos) kv[line.substr(0, eq)] = line.substr(eq + 1);
    }
    if (kv.count("error") || !kv.count("step_ms")) {
      r.why = "host " + std::to_string(ch.host) + " rank " + std::to_string(ch.index) + ": " +
              (kv.count("error") ? kv["error"] : "no result");
      return r;
    }
    step_ms.push_back(std::stod(kv["step_ms"]));
    cross.push_back(std::stod(kv["cross_mb"]));
    if (kv.count("nic_mb")) nic.push_back(std::stod(kv["nic_mb"]));
    if (kv.count("heal_ms")) r.heal_ms = std::max(r.heal_ms, std::stod(kv["heal_ms"]));
    if (kv.count("join_ms")) r.join_ms = std::max(r.join_ms, std::stod(kv["join_ms"]));
    if (kv.count("join_rx_mb")) r.join_rx_mb = std::stod(kv["join_rx_mb"]);
  }
  r.step_ms = bench::median(step_ms);
  r.cross_mb = bench::median(cross);
  r.nic_mb = nic.empty() ? 0.0 : bench::median(nic);
  r.ok = true;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    bench::cli args(argc, argv,
                    "Replica groups (GroupManager) against one replica per rank (Manager): step time, bytes "
                    "across the replica dimension, heal time of a late host",
                    {{"--hosts", "N", "hosts, the last one starting late (default 2)"},
                     {"--ranks-per-host", "K", "ranks per host: a group's size (default 2)"},
                     {"--grad-mib", "N", "gradient allreduced per step, MiB (default 16)"},
                     {"--state-mib", "N", "training state per rank, MiB (default 64)"},
                     {"--steps", "N", "steps measured once every replica is in (default 20)"},
                     {"--heal-over", "NAME", "routes or quorum (manager_options::heal_over; default routes)"},
                     {"--shapes", "LIST", "flat, groups (default both)"},
                     {"--timeout", "S", "limit per shape, seconds (default 180)"},
                     {"--on-hosts", "", "one host per test host (under ddp-run --hosts N --hosts-only)"}});
    if (args.has("--help")) {
      args.print_help(std::cout);
      return 0;
    }
    config c;
    c.hosts = static_cast<int>(args.int_or("--hosts", 2));
    c.k = static_cast<int>(args.int_or("--ranks-per-host", 2));
    c.grad_bytes = static_cast<std::size_t>(args.int_or("--grad-mib", 16)) << 20;
    c.state_bytes = static_cast<std::size_t>(args.int_or("--state-mib", 64)) << 20;
    c.steps = static_cast<int>(args.int_or("--steps", 20));
    c.timeout_s = static_cast<int>(args.int_or("--timeout", 180));
    c.on_hosts = args.has("--on-hosts");
    const std::string over = args.string_or("--heal-over", "routes");
    if (over != "routes" && over != "quorum") throw std::invalid_argument("--heal-over: routes or quorum");
    c.heal_over = over == "routes" ? ddp::heal_transport::source_routes : ddp::heal_transport::quorum_broadcast;
    if (c.hosts < 2 || c.k < 1) throw std::invalid_argument("--hosts must be at least 2 and --ranks-per-host 1");
    const std::string shapes = args.string_or("--shapes", "flat,groups");

    std::cout << "# group_manager_bench: " << c.hosts << " hosts x " << c.k << " ranks"
              << (c.on_hosts ? " (test hosts)" : " (one machine)") << ", gloo + file store; gradient "
              << (c.grad_bytes >> 20) << " MiB, state " << (c.state_bytes >> 20) << " MiB per rank, heal over " << over
              << "; load " <<
        [] {
          std::ifstream in("/proc/loadavg");
          std::string a, b, x;
          in >> a >> b >> x;
          return a + " " + b + " " + x;
        }() << std::endl;
    bench::table t({{"shape"},
                    {"replicas"},
                    {"step ms", 1},
                    {"cross MB/rank/step", 2},
                    {"NIC MB/host/step", 2},
                    {"heal ms", 1},
                    {"join ms", 1},
                    {"join MB/host", 1}});
    for (const bool grouped : {false, true}) {
      const std::string name = grouped ? "groups" : "flat";
      if (shapes.find(name) == std::string::npos) continue;
      const shape_result r = run_shape(c, grouped);
      if (!r.ok) {
        std::cout << "# " << name << ": FAILED: " << r.why << std::endl;
        continue;
      }
      const std::string replicas = grouped ? std::to_string(c.hosts) + " groups of " + std::to_string(c.k)
                                           : std::to_string(c.hosts * c.k) + " ranks";
      t.add({name, replicas, r.step_ms, r.cross_mb, r.nic_mb, r.heal_ms, r.join_ms, r.join_rx_mb});
    }
    t.print(std::cout);
    if (auto csv = args.csv()) {
      std::ofstream out(*csv);
      t.write_csv(out);
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "group_manager_bench: " << e.what() << "\n";
    return 1;
  }
}
