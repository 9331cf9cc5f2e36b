// Fault to full speed, measured (issue #28): N replica processes train through a ddp::Manager
// over gloo and a file store; after a warm-up one replica is killed with SIGKILL at a random
// point inside a step and restarted at once (a fresh process, the same replica id). From what
// every process records, per run:
//
//   T_full    kill -> the first commit after which every later commit interval (to the end of the
//             run, `--after` steps past the restarted replica's first commit) is at most 1.3 x the
//             median interval before the kill (the "full speed" rule; --full-speed-factor);
//   T_healed  kill -> the first committed step in which the restarted replica takes part;
//   target    2 s + the state's bytes over this heal's bandwidth (bytes / heal GB/s = heal ms);
//
// and where the time went: failure detected on a survivor (its first error event), the
// survivors' first quorum after the kill (its size), the restarted process up (state allocated,
// Manager built), its quorum formed and healed (Manager events and stats()).
//
//   fault_recovery_bench [--replicas 2,3] [--state-mib 64,256] [--presets default,tuned]
//                        [--compute-ms 50] [--grad-mib 4] [--buckets 1] [--kill-step 20] [--after 30]
//                        [--reps 1] [--gloo-timeout-s 10]
//
// A hung replica (issue #43), `--fault stop`: the victim is not killed but stopped (SIGSTOP: alive,
// its sockets open, silent) at a random point inside the step after `--kill-step`, kept stopped for
// `--stop-s` seconds, then resumed (SIGCONT). Per run:
//
//   stall->commit   SIGSTOP -> the others' next committed step (one made without the stopped
//                   replica: a quorum of fewer than N; the latest of the others), against
//   target          the step deadline + 2 s (issue #43's goal; "-" for a build without one);
//   CPU %           the CPU each waiting (healthy) replica process used between the SIGSTOP and
//                   that commit, as % of one core ("max" and "each", r0 first): utime + stime of
//                   /proc/<pid>/stat, every thread, in clock ticks (sysconf(_SC_CLK_TCK)), read by
//                   the launcher right after the SIGSTOP and by the replica itself (/proc/self/stat)
//                   at its commit (issue #43's goal: under 5 %); it includes the re-form and the
//                   step that commits;
//   in-wait CPU %   the same up to each waiting replica's first error event (its step failed: the
//                   wait alone), the most of any;
//   SIGCONT->healed SIGCONT -> the stopped replica's first commit after it woke (it finds itself
//                   out of the quorum, rejoins and heals: "heal ms" is that heal's transfer);
//
// with the survivor r0's first error and first quorum after the SIGSTOP, and its discarded steps.
//
//   fault_recovery_bench --fault stop [--stop-s S] [--step-timeout-ms MS] [--gloo-timeout-s 60] ...
//
//   --fault kill|stop     SIGKILL and restart (default), or SIGSTOP and SIGCONT;
//   --stop-s S            how long the victim stays stopped (default: the others' longest wait, the
//                         step deadline or, in a build without one, gloo's timeout, + 10 s: it must
//                         outlast that wait, or the others simply wait for it and the row FAILs);
//   --step-timeout-ms MS  manager_options::step_timeout (default: the library's, 30 s); ignored,
//                         and shown as "none", when built against a tree without it (below);
//   --gloo-timeout-s S    gloo's collective timeout (default 10 with --fault kill, 60 with --fault
//                         stop: longer than the step deadline, so that the deadline, not gloo, ends
//                         the others' wait);
//   --buckets LIST        the gradient as 1 allreduce and its wait() (default), or as N allreduces
//                         waited together with ddp::work::wait_all (the Bucketer's way: a polled
//                         wait); N > 1 shows in the "options" column.
//
// Before and after (docs/benchmarks.md, "A hung replica"): this file also builds against a tree
// from before manager_options::step_timeout (commit bc35e62); there a Manager's collective waits
// up to gloo's timeout.
//
// Across test hosts (one replica per host, a capped link): bench/fault_recovery_hosts.sh runs
// this program under `ddp-run --hosts N --hosts-only --link-rate R` with `--on-hosts`.
//
// The program starts its replicas itself (fork + exec of /proc/self/exe with --child), like the
// fault_tolerant_training example; each writes one line per commit and per Manager event to its
// own log file, with CLOCK_MONOTONIC times (one clock for every process of the machine).
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ddp/gloo.hpp>
#include <ddp/manager.hpp>
#include <ddp/stores/file_store.hpp>

#include "common/cli.hpp"
#include "common/stats.hpp"
#include "common/table.hpp"

namespace {

using namespace std::chrono_literals;

// SIGINT/SIGTERM/SIGHUP to the launcher (ddp-run passes them on): the run in progress stops its
// replicas and removes its files.
volatile std::sig_atomic_t stop_requested = 0;
extern "C" void on_stop_signal(int) { stop_requested = 1; }

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// manager_options::step_timeout (#43) came in commit 5f28d91 together with detail/idle_backoff.hpp;
// that header's presence tells this tree from an older one (the "before" column of
// docs/benchmarks.md, "A hung replica", builds this same file at bc35e62, where the field does not
// exist). Nothing else of the bench depends on the difference.
#if __has_include(<ddp/detail/idle_backoff.hpp>)
constexpr bool has_step_timeout = true;
// The step deadline in effect: `ms` where given (> 0), else the library's default.
std::chrono::milliseconds step_timeout_of(std::int64_t ms) {
  return ms > 0 ? std::chrono::milliseconds(ms) : ddp::manager_options{}.step_timeout;
}
void set_step_timeout(ddp::manager_options& o, std::int64_t ms) { o.step_timeout = step_timeout_of(ms); }
#else
constexpr bool has_step_timeout = false;
std::chrono::milliseconds step_timeout_of(std::int64_t) { return std::chrono::milliseconds(0); }
void set_step_timeout(ddp::manager_options&, std::int64_t) {}
#endif

// utime + stime of process `pid` (0: this one) from /proc/<pid>/stat, in clock ticks
// (sysconf(_SC_CLK_TCK)): every thread's CPU time; -1 if it cannot be read.
std::int64_t cpu_ticks(pid_t pid) {
  std::ifstream in(pid == 0 ? std::string("/proc/self/stat") : "/proc/" + std::to_string(pid) + "/stat");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto paren = text.rfind(')');  // the command name may hold spaces and parentheses
  if (paren == std::string::npos) return -1;
  std::istringstream fields(text.substr(paren + 1));
  std::string skip;
  for (int f = 3; f < 14; ++f) fields >> skip;  // state .. cmajflt (fields 3-13)
  std::int64_t utime = 0, stime = 0;
  if (!(fields >> utime >> stime)) return -1;  // fields 14 and 15
  return utime + stime;
}

std::vector<std::int64_t> int_list(const std::string& text) {
  std::vector<std::int64_t> v;
  std::stringstream ss(text);
  for (std::string s; std::getline(ss, s, ',');) v.push_back(std::stoll(s));
  return v;
}

std::vector<std::string> word_list(const std::string& text) {
  std::vector<std::string> v;
  std::stringstream ss(text);
  for (std::string s; std::getline(ss, s, ',');) v.push_back(s);
  return v;
}

// The options a user would give: the Manager's defaults ("default") or faster failure handling
// ("tuned"); min_replicas N-1 (the job goes on without one replica); gloo's connect timeout 10 s,
// its collective timeout --gloo-timeout-s.
ddp::manager_options manager_options_for(const std::string& preset, int replicas) {
  ddp::manager_options o;
  o.min_replicas = std::max(1, replicas - 1);
  // "+routes": heal over one communicator per source (manager_options::heal_over).
  const std::string base = preset.ends_with("+routes") ? preset.substr(0, preset.size() - 7) : preset;
  if (base != preset) o.heal_over = ddp::heal_transport::source_routes;
  if (base == "tuned") {
    o.heartbeat_interval = 50ms;
    o.heartbeat_timeout = 1000ms;
    o.settle = 100ms;
  } else if (base != "default") {
    throw std::invalid_argument("unknown preset " + preset + " (default, tuned, each with or without +routes)");
  }
  o.progress = {};  // no progress lines on stderr: the bench prints its own table
  return o;
}

ddp::gloo::options gloo_options_for(const std::string& iface, std::chrono::seconds timeout) {
  ddp::gloo::options g;
  g.timeout = timeout;
  g.connect_timeout = 10s;
  g.interface = iface;
  g.progress = {};
  return g;
}

// ---- one replica process ---------------------------------------------------------------------

int run_child(const bench::cli& a) {
  const std::string id = a.string_or("--child", "");
  const std::string store_dir = a.string_or("--store-dir", "");
  const std::string log_path = a.string_or("--log", "");
  const int replicas = static_cast<int>(a.int_or("--replicas", 2));
  const std::string preset = a.string_or("--preset", "default");
  const auto compute = std::chrono::milliseconds(a.int_or("--compute-ms", 50));
  const std::size_t state_bytes = a.bytes_or("--state-bytes", std::uint64_t{64} << 20);
  const std::size_t grad_bytes = a.bytes_or("--grad-bytes", std::uint64_t{4} << 20);
  const std::int64_t max_steps = a.int_or("--max-steps", 100000);
  const auto buckets = static_cast<std::size_t>(std::max<std::int64_t>(1, a.int_or("--buckets", 1)));

  FILE* log = std::fopen(log_path.c_str(), "a");
  if (log == nullptr) throw std::runtime_error("cannot open " + log_path);
  std::fprintf(log, "p %lld main\n", static_cast<long long>(now_ns()));
  std::fflush(log);

  std::vector<float> w(state_bytes / 4, 1.0f);  // the training state (written: its pages are real)
  std::vector<float> grad(grad_bytes / 4, 0.5f);
  ddp::training_state state;
  state.add(w);
  ddp::stores::file_store store(store_dir);
  ddp::manager_options opts = manager_options_for(preset, replicas);
  opts.replica_id = id;
  set_step_timeout(opts, a.int_or("--step-timeout-ms", 0));
  const ddp::gloo::options gopts =
      gloo_options_for(a.string_or("--iface", ""), std::chrono::seconds(a.int_or("--gloo-timeout-s", 10)));
  ddp::Manager m(
      store,
      [&](const ddp::quorum_info& q) {
        return ddp::any_communicator(ddp::gloo::communicator(q.store, q.rank, q.size, gopts));
      },
      state, opts);
  m.on_event([&](const ddp::manager_event& e) {
    std::string text = e.text;
    std::replace(text.begin(), text.end(), '\n', ' ');
    std::fprintf(log, "e %lld %d %lld %lld %s\n", static_cast<long long>(now_ns()), static_cast<int>(e.what),
                 static_cast<long long>(e.step), static_cast<long long>(cpu_ticks(0)), text.c_str());
    std::fflush(log);
  });
  std::fprintf(log, "p %lld ready\n", static_cast<long long>(now_ns()));
  std::fflush(log);

  for (;;) {
    const auto stop = store.get("stop");  // set by the launcher once the run has what it measures
    const std::int64_t stop_at = stop ? std::stoll(ddp::to_text(*stop)) : max_steps;
    if (m.step() >= stop_at) break;
    const std::uint64_t heals_before = m.stats().heals;
    const std::int64_t t0 = now_ns();
    m.start_quorum();
    const std::int64_t t1 = now_ns();
    std::this_thread::sleep_for(compute);  // the forward and backward pass
    if (buckets == 1) {
      m.allreduce(std::vector<ddp::tensor_view>{ddp::view(grad)}, ddp::reduce_op::sum).wait();
    } else {  // the Bucketer's way: one allreduce per bucket, all issued, then waited together
      std::vector<ddp::work> works;
      const std::size_t per = (grad.size() + buckets - 1) / buckets;
      for (std::size_t b = 0; b * per < grad.size(); ++b) {
        std::span<float> part(grad.data() + b * per, std::min(per, grad.size() - b * per));
        works.push_back(m.allreduce(std::vector<ddp::tensor_view>{ddp::view(part)}, ddp::reduce_op::sum));
      }
      ddp::work::wait_all(std::span<ddp::work>(works));
    }
    if (m.should_commit()) {
      const std::int64_t t2 = now_ns();
      w[static_cast<std::size_t>(m.step()) % w.size()] += 1e-3f;  // an optimizer step, in miniature
      std::fill(grad.begin(), grad.end(), 0.5f);
      const auto& st = m.stats();
      // Last: this process's CPU time so far (--fault stop: what a waiting replica used).
      std::fprintf(log, "c %lld %lld %d %d %llu %d %llu %.3f %.3f %lld\n", static_cast<long long>(t2),
                   static_cast<long long>(m.step()), m.participants(), m.size(),
                   static_cast<unsigned long long>(m.generation()), st.heals > heals_before ? 1 : 0,
                   static_cast<unsigned long long>(st.healed_bytes), st.heal_ms, static_cast<double>(t1 - t0) / 1e6,
                   static_cast<long long>(cpu_ticks(0)));
      std::fflush(log);
    }
  }
  // The yardstick of the heal's bandwidth: the same communicator's allreduce of the state's bytes
  // (two steps more, every replica at once; the second is timed).
  for (int k = 0; k < 2; ++k) {
    m.start_quorum();
    const std::int64_t t0 = now_ns();
    m.allreduce(std::vector<ddp::tensor_view>{ddp::view(w)}, ddp::reduce_op::sum).wait();
    const std::int64_t t1 = now_ns();
    if (m.should_commit() && k == 1) {
      std::fprintf(log, "a %.3f %d\n", static_cast<double>(t1 - t0) / 1e6, m.size());
    }
  }
  std::fclose(log);
  return 0;
}

// ---- the launcher ----------------------------------------------------------------------------

struct config {
  int replicas = 2;
  std::size_t state_bytes = std::size_t{64} << 20;
  std::string preset = "default";
  int compute_ms = 50;
  std::size_t grad_bytes = std::size_t{4} << 20;
  std::int64_t kill_step = 20;
  std::int64_t after = 30;
  double factor = 1.3;
  bool on_hosts = false;
  int row_timeout_s = 180;
  bool keep_logs = false;
  std::int64_t buckets = 1;  // allreduces per step's gradient (> 1: waited with work::wait_all)
  int gloo_timeout_s = 10;
  std::int64_t step_timeout_ms = 0;  // 0: the library's default
  bool stop = false;                 // --fault stop: SIGSTOP, then SIGCONT after stop_s
  int stop_s = 10;
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

pid_t spawn(const config& c, int index, const std::string& store_dir, const std::string& log) {
  const std::string id = "r" + std::to_string(index);
  const std::string replicas = std::to_string(c.replicas), compute = std::to_string(c.compute_ms),
                    state = std::to_string(c.state_bytes), grad = std::to_string(c.grad_bytes),
                    buckets = std::to_string(c.buckets), gloo_timeout = std::to_string(c.gloo_timeout_s),
                    step_timeout = std::to_string(c.step_timeout_ms);
  const char* ifname = std::getenv("DDP_HOSTS_IFNAME");
  const std::string iface = c.on_hosts && ifname ? ifname : "";
  const pid_t pid = ::fork();
  if (pid == 0) {
    try {
      if (c.on_hosts) enter_host("h" + std::to_string(index + 1));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      std::_Exit(126);
    }
    std::vector<std::string> args{"/proc/self/exe",
                                  "--child",
                                  id,
                                  "--store-dir",
                                  store_dir,
                                  "--log",
                                  log,
                                  "--replicas",
                                  replicas,
                                  "--preset",
                                  c.preset,
                                  "--compute-ms",
                                  compute,
                                  "--state-bytes",
                                  state,
                                  "--grad-bytes",
                                  grad,
                                  "--buckets",
                                  buckets,
                                  "--gloo-timeout-s",
                                  gloo_timeout,
                                  "--step-timeout-ms",
                                  step_timeout};
    if (!iface.empty()) {
      args.push_back("--iface");
      args.push_back(iface);
    }
    std::vector<char*> argv;
    for (auto& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);
    ::execv("/proc/self/exe", argv.data());
    std::_Exit(127);
  }
  if (pid < 0) throw std::runtime_error("fork failed");
  return pid;
}

struct commit_rec {
  std::int64_t t = 0, step = 0;
  int participants = 0, size = 0;
  std::uint64_t generation = 0;
  bool healed = false;
  std::uint64_t healed_bytes = 0;
  double heal_ms = 0, quorum_ms = 0;
  std::int64_t cpu_ticks = -1;  // the process's utime + stime at the commit
};
struct event_rec {
  std::int64_t t = 0;
  int kind = 0;
  std::int64_t step = 0;
  std::int64_t cpu_ticks = -1;  // the process's utime + stime at the event
  std::string text;
};
struct log_rec {
  std::vector<commit_rec> commits;
  std::vector<event_rec> events;
  std::int64_t t_main = 0, t_ready = 0;
  double allreduce_ms = 0;  // the state's bytes allreduced at the end
  int allreduce_size = 0;
};

log_rec read_log(const std::string& path) {
  log_rec r;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line.back() == '\r') continue;
    std::istringstream ls(line);
    char type = 0;
    ls >> type;
    if (type == 'p') {
      std::int64_t t = 0;
      std::string what;
      ls >> t >> what;
      (what == "main" ? r.t_main : r.t_ready) = t;
    } else if (type == 'c') {
      commit_rec c;
      int healed = 0;
      ls >> c.t >> c.step >> c.participants >> c.size >> c.generation >> healed >> c.healed_bytes >> c.heal_ms >>
          c.quorum_ms;
      if (!ls) continue;  // a torn last line (the process was killed while writing it)
      if (!(ls >> c.cpu_ticks)) c.cpu_ticks = -1;
      c.healed = healed != 0;
      r.commits.push_back(c);
    } else if (type == 'a') {
      ls >> r.allreduce_ms >> r.allreduce_size;
    } else if (type == 'e') {
      event_rec e;
      ls >> e.t >> e.kind >> e.step >> e.cpu_ticks;
      std::getline(ls, e.text);
      if (ls || !e.text.empty()) r.events.push_back(e);
    }
  }
  return r;
}

std::string fresh_dir(const std::string& tag) {
  std::string pattern = (std::filesystem::temp_directory_path() / ("ddp-fault-recovery-" + tag + "-XXXXXX")).string();
  if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp " + pattern + " failed");
  return pattern;
}

// Kills every child still running (by its pid) and reaps it.
void stop_all(std::map<std::string, pid_t>& pids) {
  for (auto& [id, pid] : pids) {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      pid = -1;
    }
  }
}

// The warm-up: waits until the victim (writing `victim_log`) committed `c.kill_step`, then until a
// uniformly random point of its next step (over one median commit interval of r0, steps 3 on).
struct fault_point {
  double step_ms = 0;            // the median commit interval before the fault
  std::int64_t last_commit = 0;  // the victim's last commit before it
  std::string error;             // why the warm-up failed ("" if it did not)
};
fault_point warm_up(const config& c, std::map<std::string, pid_t>& pids, const std::string& victim_log,
                    const std::string& r0_log, std::chrono::steady_clock::time_point deadline, std::mt19937_64& rng) {
  fault_point at;
  for (;;) {
    const log_rec v = read_log(victim_log);
    if (!v.commits.empty() && v.commits.back().step >= c.kill_step) break;
    if (stop_requested) {
      at.error = "interrupted";
      return at;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      at.error = "warm-up did not reach step " + std::to_string(c.kill_step);
      return at;
    }
    for (auto& [id, pid] : pids) {
      if (::waitpid(pid, nullptr, WNOHANG) == pid) {
        pid = -1;
        at.error = id + " exited during the warm-up";
        return at;
      }
    }
    std::this_thread::sleep_for(2ms);
  }
  const log_rec before = read_log(r0_log);
  std::vector<double> warm;
  for (std::size_t i = 1; i < before.commits.size(); ++i) {
    if (before.commits[i].step > 2)
      warm.push_back(static_cast<double>(before.commits[i].t - before.commits[i - 1].t) / 1e6);
  }
  at.step_ms = warm.empty() ? static_cast<double>(c.compute_ms) : bench::median(warm);
  at.last_commit = read_log(victim_log).commits.back().t;
  std::uniform_real_distribution<double> into(0.0, at.step_ms);
  const std::int64_t fault_at = at.last_commit + static_cast<std::int64_t>(into(rng) * 1e6);
  while (now_ns() < fault_at) std::this_thread::sleep_for(std::chrono::microseconds(200));
  return at;
}

// Once the launcher set "stop": waits until every child exited with status 0; "" or why not.
std::string wait_for_exits(std::map<std::string, pid_t>& pids, std::chrono::steady_clock::time_point deadline) {
  for (auto& [id, pid] : pids) {
    for (;;) {
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        pid = -1;
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return id + " failed";
        break;
      }
      if (stop_requested) return "interrupted";
      if (std::chrono::steady_clock::now() > deadline) return id + " did not finish in time";
      std::this_thread::sleep_for(5ms);
    }
  }
  return "";
}

struct result {
  bool ok = false;
  std::string why;
  double step_ms = 0, kill_into_step_ms = 0;
  double detect_ms = -1, reformed_ms = -1;
  int reformed_size = 0;
  double ready_ms = -1, joined_ms = -1, heal_ms = 0, healed_ms = -1, full_ms = -1;
  std::uint64_t heal_bytes = 0;
  double busbw_gbs = 0;  // the allreduce's bus bandwidth for the state's bytes (nccl-tests' busbw)
  int discarded = 0;
};

constexpr int event_quorum = static_cast<int>(ddp::manager_event::kind::quorum);
constexpr int event_discarded = static_cast<int>(ddp::manager_event::kind::discarded);
constexpr int event_error = static_cast<int>(ddp::manager_event::kind::error);

int quorum_size(const std::string& text) {  // "quorum G formed: K replicas [...]"
  const auto p = text.find("formed: ");
  return p == std::string::npos ? 0 : std::atoi(text.c_str() + p + 8);
}

result run_once(const config& c, std::mt19937_64& rng) {
  result res;
  const std::string dir = fresh_dir("run");
  const std::string store_dir = dir + "/store";
  std::filesystem::create_directory(store_dir);
  ::chmod(store_dir.c_str(), 0700);
  const int victim = c.replicas - 1;  // not rank 0 (ranks follow id order)
  const std::string victim_id = "r" + std::to_string(victim);
  auto log_of = [&](int index, int incarnation) {
    return dir + "/r" + std::to_string(index) + "." + std::to_string(incarnation) + ".log";
  };
  std::map<std::string, pid_t> pids;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(c.row_timeout_s);
  auto fail = [&](const std::string& why) {
    stop_all(pids);
    res.why = why;
    if (c.keep_logs) {
      res.why += " (logs in " + dir + ")";
    } else {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
    return res;
  };
  for (int r = 0; r < c.replicas; ++r) pids["r" + std::to_string(r)] = spawn(c, r, store_dir, log_of(r, 0));

  // Warm-up, then the kill at a random point of the victim's next step.
  const fault_point at = warm_up(c, pids, log_of(victim, 0), log_of(0, 0), deadline, rng);
  if (!at.error.empty()) return fail(at.error);
  const double step_ms = at.step_ms;
  const std::int64_t last_commit = at.last_commit;
  const std::int64_t t_kill = now_ns();
  ::kill(pids[victim_id], SIGKILL);
  ::waitpid(pids[victim_id], nullptr, 0);
  pids[victim_id] = spawn(c, victim, store_dir, log_of(victim, 1));  // restarted at once, same id
  res.kill_into_step_ms = static_cast<double>(t_kill - last_commit) / 1e6;

  // Once the restarted replica committed, the run ends `after` steps later (store key "stop").
  ddp::stores::file_store store(store_dir);
  for (;;) {
    const log_rec v = read_log(log_of(victim, 1));
    if (!v.commits.empty()) {
      store.set("stop", ddp::as_bytes(std::to_string(v.commits.front().step + c.after)));
      break;
    }
    if (stop_requested) return fail("interrupted");
    if (std::chrono::steady_clock::now() > deadline) return fail("the restarted replica never committed");
    for (auto& [id, pid] : pids) {
      if (::waitpid(pid, nullptr, WNOHANG) == pid) {
        pid = -1;
        return fail(id + " exited before the restarted replica committed");
      }
    }
    std::this_thread::sleep_for(5ms);
  }
  if (const std::string why = wait_for_exits(pids, deadline); !why.empty()) return fail(why);

  // The survivors' view: replica r0 (rank 0 throughout).
  const log_rec s = read_log(log_of(0, 0));
  const log_rec v = read_log(log_of(victim, 1));
  res.step_ms = step_ms;
  for (const auto& e : s.events) {
    if (e.t < t_kill) continue;
    if (e.kind == event_error && res.detect_ms < 0) res.detect_ms = static_cast<double>(e.t - t_kill) / 1e6;
    if (e.kind == event_quorum && res.reformed_ms < 0) {
      res.reformed_ms = static_cast<double>(e.t - t_kill) / 1e6;
      res.reformed_size = quorum_size(e.text);
    }
    if (e.kind == event_discarded) ++res.discarded;
  }
  res.ready_ms = static_cast<double>(v.t_ready - t_kill) / 1e6;
  for (const auto& e : v.events) {
    if (e.kind == event_quorum && res.joined_ms < 0) res.joined_ms = static_cast<double>(e.t - t_kill) / 1e6;
  }
  const commit_rec& first = v.commits.front();
  res.healed_ms = static_cast<double>(first.t - t_kill) / 1e6;
  res.heal_bytes = first.healed_bytes;
  res.heal_ms = first.heal_ms;
  if (s.allreduce_ms > 0 && s.allreduce_size > 1) {
    const double n = s.allreduce_size;
    res.busbw_gbs = static_cast<double>(c.state_bytes) * 2 * (n - 1) / n / (s.allreduce_ms * 1e6);
  }
  // Full speed: the first commit after the kill from which on every commit interval is within
  // factor x the median before the kill.
  std::size_t k0 = 0;  // r0's last commit before the kill
  while (k0 + 1 < s.commits.size() && s.commits[k0 + 1].t < t_kill) ++k0;
  std::size_t full = s.commits.size();
  for (std::size_t i = s.commits.size(); i-- > k0 + 1;) {
    const double gap = static_cast<double>(s.commits[i].t - s.commits[i - 1].t) / 1e6;
    if (gap > c.factor * step_ms) break;
    full = i - 1;
  }
  full = std::max(full, k0 + 1);
  if (full >= s.commits.size()) return fail("r0 was not back at full speed by the end of the run");
  res.full_ms = static_cast<double>(s.commits[full].t - t_kill) / 1e6;
  res.ok = true;
  if (c.keep_logs) {
    std::cout << "# logs kept in " << dir << std::endl;
  } else {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  return res;
}

// ---- a hung replica (--fault stop) -------------------------------------------------------------

struct stop_result {
  bool ok = false;
  std::string why;
  double step_ms = 0, stop_into_step_ms = 0, stopped_s = 0;
  double detect_ms = -1, reformed_ms = -1;  // r0's first error and first quorum after the SIGSTOP
  int reformed_size = 0;
  double next_commit_ms = -1;   // SIGSTOP -> the others' first commit without the stopped replica (the latest)
  std::vector<double> cpu_pct;  // each waiting replica's CPU over that time, % of one core (r0 first)
  double wait_cpu_pct = -1;     // the most any used from the SIGSTOP to its own first error (the wait alone)
  double resumed_ms = -1;       // SIGCONT -> the stopped replica's first commit
  bool healed = false;          // that commit's step healed it
  double heal_ms = 0;
  int discarded = 0;  // r0's discarded steps after the SIGSTOP
};

stop_result run_stop_once(const config& c, std::mt19937_64& rng) {
  stop_result res;
  const std::string dir = fresh_dir("stop");
  const std::string store_dir = dir + "/store";
  std::filesystem::create_directory(store_dir);
  ::chmod(store_dir.c_str(), 0700);
  const int victim = c.replicas - 1;  // not rank 0 (ranks follow id order)
  const std::string victim_id = "r" + std::to_string(victim);
  auto log_of = [&](int index) { return dir + "/r" + std::to_string(index) + ".log"; };
  std::map<std::string, pid_t> pids;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(c.row_timeout_s);
  auto fail = [&](const std::string& why) {
    stop_all(pids);  // SIGKILL ends a stopped process too
    res.why = why;
    if (c.keep_logs) {
      res.why += " (logs in " + dir + ")";
    } else {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
    return res;
  };
  // A healthy replica that exits while the victim is stopped or healing fails the run.
  auto exited = [&]() -> std::string {
    for (auto& [id, pid] : pids) {
      if (::waitpid(pid, nullptr, WNOHANG) == pid) {
        pid = -1;
        return id + " exited";
      }
    }
    return "";
  };
  for (int r = 0; r < c.replicas; ++r) pids["r" + std::to_string(r)] = spawn(c, r, store_dir, log_of(r));

  // Warm-up, then the SIGSTOP at a random point of the victim's next step; each waiting replica's
  // CPU time right after it.
  const fault_point at = warm_up(c, pids, log_of(victim), log_of(0), deadline, rng);
  if (!at.error.empty()) return fail(at.error);
  const std::int64_t t_stop = now_ns();
  ::kill(pids[victim_id], SIGSTOP);
  std::map<int, std::int64_t> ticks_at_stop;
  for (int r = 0; r < victim; ++r) ticks_at_stop[r] = cpu_ticks(pids["r" + std::to_string(r)]);
  res.step_ms = at.step_ms;
  res.stop_into_step_ms = static_cast<double>(t_stop - at.last_commit) / 1e6;

  // Stopped for stop_s, then resumed.
  const std::int64_t cont_at = t_stop + static_cast<std::int64_t>(c.stop_s) * 1'000'000'000;
  while (now_ns() < cont_at) {
    if (stop_requested) return fail("interrupted");
    if (const std::string why = exited(); !why.empty()) return fail(why + " while " + victim_id + " was stopped");
    std::this_thread::sleep_for(5ms);
  }
  const std::int64_t t_cont = now_ns();
  ::kill(pids[victim_id], SIGCONT);
  res.stopped_s = static_cast<double>(t_cont - t_stop) / 1e9;

  // Once the resumed replica committed, the run ends `after` steps later (store key "stop").
  ddp::stores::file_store store(store_dir);
  for (;;) {
    const log_rec v = read_log(log_of(victim));
    const auto first =
        std::find_if(v.commits.begin(), v.commits.end(), [&](const commit_rec& r) { return r.t > t_cont; });
    if (first != v.commits.end()) {
      store.set("stop", ddp::as_bytes(std::to_string(first->step + c.after)));
      break;
    }
    if (stop_requested) return fail("interrupted");
    if (std::chrono::steady_clock::now() > deadline) return fail(victim_id + " never committed after SIGCONT");
    if (const std::string why = exited(); !why.empty()) return fail(why + " before " + victim_id + " committed again");
    std::this_thread::sleep_for(5ms);
  }
  if (const std::string why = wait_for_exits(pids, deadline); !why.empty()) return fail(why);

  // Each waiting replica's first commit after the SIGSTOP in a quorum without the victim: the
  // step the stall cost is behind it. (A commit of the full quorum right after the SIGSTOP is the
  // step the victim had already voted in; it does not count.)
  std::uint64_t without_generation = 0;
  for (int r = 0; r < victim; ++r) {
    const log_rec w = read_log(log_of(r));
    const auto next = std::find_if(w.commits.begin(), w.commits.end(),
                                   [&](const commit_rec& k) { return k.t > t_stop && k.size < c.replicas; });
    if (next == w.commits.end()) {
      return fail("r" + std::to_string(r) + " made no commit without " + victim_id +
                  ": it waited for the stopped replica (raise --stop-s above the others' wait)");
    }
    const double ms = static_cast<double>(next->t - t_stop) / 1e6;
    res.next_commit_ms = std::max(res.next_commit_ms, ms);
    without_generation = std::max(without_generation, next->generation);
    const std::int64_t ticks0 = ticks_at_stop[r];
    const double cpu_s = next->cpu_ticks >= 0 && ticks0 >= 0
                             ? static_cast<double>(next->cpu_ticks - ticks0) / ::sysconf(_SC_CLK_TCK)
                             : -1;
    res.cpu_pct.push_back(cpu_s >= 0 ? 100.0 * cpu_s / (ms / 1e3) : -1);
    const auto failed = std::find_if(w.events.begin(), w.events.end(),
                                     [&](const event_rec& e) { return e.t > t_stop && e.kind == event_error; });
    if (failed != w.events.end() && failed->cpu_ticks >= 0 && ticks0 >= 0) {
      const double wait_s = static_cast<double>(failed->t - t_stop) / 1e9;
      const double used_s = static_cast<double>(failed->cpu_ticks - ticks0) / ::sysconf(_SC_CLK_TCK);
      res.wait_cpu_pct = std::max(res.wait_cpu_pct, 100.0 * used_s / wait_s);
    }
    if (r == 0) {
      for (const auto& e : w.events) {
        if (e.t < t_stop) continue;
        if (e.kind == event_error && res.detect_ms < 0) res.detect_ms = static_cast<double>(e.t - t_stop) / 1e6;
        if (e.kind == event_quorum && res.reformed_ms < 0) {
          res.reformed_ms = static_cast<double>(e.t - t_stop) / 1e6;
          res.reformed_size = quorum_size(e.text);
        }
        if (e.kind == event_discarded) ++res.discarded;
      }
    }
  }
  const log_rec v = read_log(log_of(victim));
  const auto first =
      std::find_if(v.commits.begin(), v.commits.end(), [&](const commit_rec& r) { return r.t > t_cont; });
  if (first->generation <= without_generation) {
    return fail(victim_id + " committed in generation " + std::to_string(first->generation) +
                " after SIGCONT, not after the others' " + std::to_string(without_generation));
  }
  res.resumed_ms = static_cast<double>(first->t - t_cont) / 1e6;
  constexpr int event_healed = static_cast<int>(ddp::manager_event::kind::healed);
  res.healed = first->healed || std::any_of(v.events.begin(), v.events.end(), [&](const event_rec& e) {
                 return e.kind == event_healed && e.t > t_cont && e.t <= first->t;
               });
  res.heal_ms = first->heal_ms;
  res.ok = true;
  if (c.keep_logs) {
    std::cout << "# logs kept in " << dir << std::endl;
  } else {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    bench::cli args(
        argc, argv,
        "Fault to full speed: kill a replica mid-step, restart it, time the recovery (issue #28); "
        "--fault stop: hang it (SIGSTOP), time the others' stall and CPU, resume it (issue #43)",
        {{"--replicas", "LIST", "replica counts (default 2,3)"},
         {"--state-mib", "LIST", "training state sizes, MiB (default 64,256)"},
         {"--presets", "LIST", "manager_options: default, tuned, +routes on either (default: default,tuned)"},
         {"--compute-ms", "N", "compute per step, a sleep (default 50)"},
         {"--grad-mib", "N", "gradient allreduced per step, MiB (default 4)"},
         {"--fault", "KIND", "kill (SIGKILL, restart at once; default) or stop (SIGSTOP, SIGCONT after --stop-s)"},
         {"--stop-s", "S", "--fault stop: seconds stopped (default: the others' longest wait + 10)"},
         {"--step-timeout-ms", "MS", "manager_options::step_timeout (default: the library's; none before #43)"},
         {"--gloo-timeout-s", "S", "gloo's collective timeout (default 10; 60 with --fault stop)"},
         {"--buckets", "LIST", "allreduces per gradient, > 1 waited with work::wait_all (default 1)"},
         {"--kill-step", "N", "kill (or stop) after the victim committed this step (default 20)"},
         {"--after", "N", "steps to run after the restarted replica's first commit (default 30)"},
         {"--full-speed-factor", "X", "full speed: commit intervals at most X x the median before (1.3)"},
         {"--reps", "N", "runs per configuration (default 1)"},
         {"--seed", "N", "seed of the kill (stop) points (default 1)"},
         {"--on-hosts", "", "one replica per test host (under ddp-run --hosts N --hosts-only)"},
         {"--row-timeout", "S", "give up on a run after S seconds (default 180)"},
         {"--keep-logs", "", "keep each run's replica logs (the directory is printed)"},
         {"--child", "ID", "(internal) run replica ID"},
         {"--store-dir", "DIR", "(internal)"},
         {"--log", "FILE", "(internal)"},
         {"--preset", "NAME", "(internal)"},
         {"--state-bytes", "N", "(internal)"},
         {"--grad-bytes", "N", "(internal)"},
         {"--iface", "NAME", "(internal)"},
         {"--max-steps", "N", "(internal)"}});
    if (args.has("--help")) {
      args.print_help(std::cout);
      return 0;
    }
    if (args.has("--child")) return run_child(args);
    for (const int sig : {SIGINT, SIGTERM, SIGHUP}) std::signal(sig, on_stop_signal);

    config base;
    base.compute_ms = static_cast<int>(args.int_or("--compute-ms", 50));
    base.grad_bytes = static_cast<std::size_t>(args.int_or("--grad-mib", 4)) << 20;
    base.kill_step = args.int_or("--kill-step", 20);
    base.after = args.int_or("--after", 30);
    base.factor = args.double_or("--full-speed-factor", 1.3);
    base.on_hosts = args.has("--on-hosts");
    base.row_timeout_s = static_cast<int>(args.int_or("--row-timeout", 180));
    base.keep_logs = args.has("--keep-logs");
    const std::string fault = args.string_or("--fault", "kill");
    if (fault != "kill" && fault != "stop") throw std::invalid_argument("--fault: kill or stop, not " + fault);
    base.stop = fault == "stop";
    base.gloo_timeout_s = static_cast<int>(args.int_or("--gloo-timeout-s", base.stop ? 60 : 10));
    base.step_timeout_ms = args.int_or("--step-timeout-ms", 0);
    // The others' longest wait for a stopped replica: the step deadline, gloo's timeout without one.
    const auto step_deadline = step_timeout_of(base.step_timeout_ms);
    const auto longest_wait =
        has_step_timeout ? std::min<std::chrono::milliseconds>(step_deadline, std::chrono::seconds(base.gloo_timeout_s))
                         : std::chrono::milliseconds(std::chrono::seconds(base.gloo_timeout_s));
    base.stop_s = static_cast<int>(args.int_or("--stop-s", (longest_wait.count() + 999) / 1000 + 10));
    const int reps = static_cast<int>(args.int_or("--reps", 1));
    std::mt19937_64 rng(static_cast<std::uint64_t>(args.int_or("--seed", 1)));
    const auto replica_counts = int_list(args.string_or("--replicas", base.on_hosts ? "2" : "2,3"));
    const auto sizes = int_list(args.string_or("--state-mib", "64,256"));
    const auto presets = word_list(args.string_or("--presets", "default,tuned"));
    const auto bucket_counts = int_list(args.string_or("--buckets", "1"));
    auto options_of = [](const std::string& preset, std::int64_t buckets) {
      return buckets > 1 ? preset + ", " + std::to_string(buckets) + " buckets" : preset;
    };
    if (base.stop) {
      bench::table t({{"replicas"},
                      {"state MiB"},
                      {"options"},
                      {"step deadline ms"},
                      {"gloo timeout s"},
                      {"step ms", 1},
                      {"stop at ms", 1},
                      {"stopped s", 1},
                      {"detect ms", 1},
                      {"re-formed ms (size)"},
                      {"stall->commit ms", 1},
                      {"target ms"},
                      {"commit/target"},
                      {"CPU % max", 1},
                      {"CPU % each"},
                      {"in-wait CPU %", 1},
                      {"SIGCONT->healed ms", 1},
                      {"healed"},
                      {"heal ms", 1},
                      {"discarded"}});
      std::cout << "# fault_recovery_bench --fault stop: "
                << (base.on_hosts ? "one replica per test host" : "one machine") << ", gloo + file store; compute "
                << base.compute_ms << " ms/step, gradient " << (base.grad_bytes >> 20) << " MiB; SIGSTOP after step "
                << base.kill_step << ", SIGCONT " << base.stop_s << " s later; step deadline "
                << (has_step_timeout ? std::to_string(step_deadline.count()) + " ms" +
                                           (base.step_timeout_ms > 0 ? "" : " (the library's default)")
                                     : std::string("none (a build without manager_options::step_timeout)"))
                << "; gloo timeout " << base.gloo_timeout_s << " s; CPU from /proc/<pid>/stat, "
                << ::sysconf(_SC_CLK_TCK) << " ticks/s" << std::endl;
      for (const auto n : replica_counts) {
        for (const auto mib : sizes) {
          for (const auto& preset : presets) {
            for (const auto buckets : bucket_counts) {
              for (int r = 0; r < reps; ++r) {
                config c = base;
                c.replicas = static_cast<int>(n);
                c.state_bytes = static_cast<std::size_t>(mib) << 20;
                c.preset = preset;
                c.buckets = buckets;
                const std::string options = options_of(preset, buckets);
                const stop_result x = run_stop_once(c, rng);
                if (stop_requested) {
                  std::cout << "# interrupted" << std::endl;
                  return 130;
                }
                if (!x.ok) {
                  std::cout << "# " << n << " replicas, " << mib << " MiB, " << options << ": FAILED: " << x.why
                            << std::endl;
                  continue;
                }
                std::ostringstream reformed, each;
                reformed << std::fixed;
                reformed.precision(1);
                reformed << x.reformed_ms << " (" << x.reformed_size << ")";
                each << std::fixed;
                each.precision(1);
                double cpu_max = 0;
                for (std::size_t i = 0; i < x.cpu_pct.size(); ++i) {
                  each << (i ? " " : "") << x.cpu_pct[i];
                  cpu_max = std::max(cpu_max, x.cpu_pct[i]);
                }
                const double target = static_cast<double>(step_deadline.count()) + 2000.0;
                std::ostringstream ratio;
                ratio << std::fixed;
                ratio.precision(2);
                ratio << x.next_commit_ms / target;
                t.add({n,
                       mib,
                       options,
                       has_step_timeout ? bench::cell{std::int64_t{step_deadline.count()}} : bench::cell{"none"},
                       std::int64_t{base.gloo_timeout_s},
                       x.step_ms,
                       x.stop_into_step_ms,
                       x.stopped_s,
                       x.detect_ms,
                       reformed.str(),
                       x.next_commit_ms,
                       has_step_timeout ? bench::cell{target} : bench::cell{"-"},
                       has_step_timeout ? bench::cell{ratio.str()} : bench::cell{"-"},
                       cpu_max,
                       each.str(),
                       x.wait_cpu_pct,
                       x.resumed_ms,
                       std::string(x.healed ? "yes" : "no"),
                       x.heal_ms,
                       std::int64_t{x.discarded}});
                std::cout << "# done: " << n << " replicas, " << mib << " MiB, " << options << " (stall->commit "
                          << x.next_commit_ms << " ms)" << std::endl;
              }
            }
          }
        }
      }
      t.print(std::cout);
      if (auto csv = args.csv()) {
        std::ofstream out(*csv);
        t.write_csv(out);
      }
      return 0;
    }

    bench::table t({{"replicas"},
                    {"state MiB"},
                    {"options"},
                    {"step ms", 1},
                    {"kill at ms", 1},
                    {"detect ms", 1},
                    {"re-formed ms (size)"},
                    {"restarted up ms", 1},
                    {"joined ms", 1},
                    {"heal ms", 1},
                    {"heal GB/s", 2},
                    {"allreduce busbw GB/s", 2},
                    {"heal/busbw", 2},
                    {"T_healed ms", 1},
                    {"T_full ms", 1},
                    {"target ms", 1},
                    {"healed/target", 2},
                    {"full/target", 2},
                    {"discarded"}});
    std::cout << "# fault_recovery_bench: " << (base.on_hosts ? "one replica per test host" : "one machine")
              << ", gloo + file store; compute " << base.compute_ms << " ms/step, gradient " << (base.grad_bytes >> 20)
              << " MiB; kill after step " << base.kill_step << "; full speed = intervals <= " << base.factor
              << " x median before" << std::endl;
    for (const auto n : replica_counts) {
      for (const auto mib : sizes) {
        for (const auto& preset : presets) {
          for (const auto buckets : bucket_counts) {
            for (int r = 0; r < reps; ++r) {
              config c = base;
              c.replicas = static_cast<int>(n);
              c.state_bytes = static_cast<std::size_t>(mib) << 20;
              c.preset = preset;
              c.buckets = buckets;
              const std::string options = options_of(preset, buckets);
              const result x = run_once(c, rng);
              if (stop_requested) {
                std::cout << "# interrupted" << std::endl;
                return 130;
              }
              if (!x.ok) {
                std::cout << "# " << n << " replicas, " << mib << " MiB, " << options << ": FAILED: " << x.why
                          << std::endl;
                continue;
              }
              const double gbs = x.heal_ms > 0 ? static_cast<double>(x.heal_bytes) / (x.heal_ms * 1e6) : 0.0;
              const double target = 2000.0 + x.heal_ms;  // 2 s + bytes / this heal's bandwidth
              std::ostringstream reformed;
              reformed << std::fixed;
              reformed.precision(1);
              reformed << x.reformed_ms << " (" << x.reformed_size << ")";
              t.add({n, mib, options, x.step_ms, x.kill_into_step_ms, x.detect_ms, reformed.str(), x.ready_ms,
                     x.joined_ms, x.heal_ms, gbs, x.busbw_gbs, x.busbw_gbs > 0 ? gbs / x.busbw_gbs : 0.0, x.healed_ms,
                     x.full_ms, target, x.healed_ms / target, x.full_ms / target, std::int64_t{x.discarded}});
              std::cout << "# done: " << n << " replicas, " << mib << " MiB, " << options << " (T_full " << x.full_ms
                        << " ms)" << std::endl;
            }
          }
        }
      }
    }
    t.print(std::cout);
    if (auto csv = args.csv()) {
      std::ofstream out(*csv);
      t.write_csv(out);
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "fault_recovery_bench: " << e.what() << "\n";
    return 1;
  }
}
