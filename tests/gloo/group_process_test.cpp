// GroupManager over real processes, gloo and the file store (issue #30): three replica groups of
// two processes; one process SIGKILLs itself mid-training. Its group-mate stops (shared fate), the
// other groups commit the next steps without the group and without a hang; the group restarts as
// two fresh processes, heals by shard (each rank from the same-index ranks of the others) and
// ends with the survivors' bits. Checked from the records: one state and one member list per
// committed step over every rank of every group, and the job reached its last step with all three.
// And (issue #43) a rank stopped by SIGSTOP, not killed, under the ReproducibleReducer: the other
// groups lose one step, the stopped rank's group leaves, restarts and heals.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/stores/file_store.hpp>

#include "group_trainer.hpp"
#include "process_group.hpp"

using namespace std::chrono_literals;
using gloo_test::temp_dir;

namespace {

void check_rank_killed(ddp::heal_transport heal_over, int killed_index) {
  temp_dir dir("group-kill");
  constexpr std::int64_t kill_at = 6, restart_after = 10, end_at = 24;
  const auto done = [](std::int64_t s, const std::vector<std::string>& members) {
    return s >= end_at && members.size() == 3;
  };
  gloo_test::trainer_setup setup{.records = dir.path(), .min_replicas = 2, .quorum_timeout = 20s};
  setup.heal_over = heal_over;
  // Children 0-5: groups g0, g1, g2 of two ranks; 6-7: g1 restarted.
  gloo_test::process_group job(8, [&](int child, const gloo_test::reporter& out) {
    ddp::stores::file_store store(dir.path());
    const int restarted = child >= 6 ? 1 : 0;
    const gloo_test::group_rank me{.group = "g" + std::to_string(restarted ? 1 : child / 2),
                                   .index = restarted ? child - 6 : child % 2,
                                   .group_size = 2,
                                   .incarnation = restarted};
    const bool doomed = me.group == "g1" && !restarted;
    try {
      gloo_test::train_group_rank(store, setup, me, restarted ? restart_after : 0, done, [&](std::int64_t s) {
        if (doomed && me.index == killed_index && s == kill_at) ::raise(SIGKILL);
      });
    } catch (const ddp::error& e) {
      if (!doomed) throw;
      out.set("left", e.what());  // its group-mate died: this rank stops too
    }
  });
  const auto outs = job.wait_all(60s);
  INFO(gloo_test::describe_all(outs));
  const int killed = 2 + killed_index, mate = 2 + (1 - killed_index);
  CHECK((!outs[killed].exited && outs[killed].signal == SIGKILL));
  CHECK(outs[mate].ok());
  CHECK_FALSE(outs[mate].value("left").empty());
  for (const int c : {0, 1, 4, 5, 6, 7}) CHECK(outs[c].ok());
  gloo_test::check_records(dir.path(), {"g0.0", "g0.1", "g1.0", "g1.1", "g2.0", "g2.1"}, end_at, 60);
  // The others committed steps without g1, and the restarted g1 committed the last one with them.
  ddp::stores::file_store records(dir.path());
  bool without = false;
  for (std::int64_t s = kill_at; s < end_at && !without; ++s) {
    const auto v = gloo_test::text_of(records.get("c/" + std::to_string(s) + "/g0.0"));
    without = v.rfind("g1,", 0) == std::string::npos && v.find(",g1,") == std::string::npos && !v.empty();
  }
  CHECK(without);
  const auto last = gloo_test::text_of(records.get("c/" + std::to_string(end_at - 1) + "/g1.1"));
  CHECK(last == gloo_test::text_of(records.get("c/" + std::to_string(end_at - 1) + "/g0.1")));
}

}  // namespace

TEST_CASE("GroupManager over gloo processes: a follower SIGKILLed takes its group out; it restarts and heals",
          "[gloo][groups][file]") {
  check_rank_killed(ddp::heal_transport::source_routes, 1);
}

TEST_CASE("GroupManager over gloo processes: a leader SIGKILLed takes its group out; it restarts and heals",
          "[gloo][groups][file]") {
  check_rank_killed(ddp::heal_transport::quorum_broadcast, 0);
}

namespace {

// CPU time (user and system) process `pid` used so far, from /proc/<pid>/stat.
std::chrono::milliseconds cpu_time(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  const auto name_end = text.rfind(')');
  if (name_end == std::string::npos) return std::chrono::milliseconds(-1);
  std::istringstream fields(text.substr(name_end + 1));
  std::string field;
  long long ticks = 0;
  for (int i = 3; i <= 15 && fields >> field; ++i) {  // field 3: the state; 14: utime, 15: stime
    if (i >= 14) ticks += std::stoll(field);
  }
  return std::chrono::milliseconds(ticks * 1000 / ::sysconf(_SC_CLK_TCK));
}

// Issue #43 over replica groups: rank `stopped_index` of g1 stops (SIGSTOP: its sockets stay open,
// nothing fails) at the start of step 6, after its start_quorum(), the gradients averaged by a
// ReproducibleReducer (where the hang was first seen): it never calls the step's collectives. It
// raises the signal itself, so that it never stops holding a lock of the file store (a counter's:
// the others would fail at the store's lock timeout, not at the step's deadline). The cross
// communicators' own timeout is a minute, so only the step's deadline can end the other groups'
// wait: they must commit again within step_timeout plus one quorum re-form, without g1 (g1 writes
// no heartbeat: its leader is stopped, or waits inside the step). The stopped rank's group-mate
// waits for it over the inner communicator, costing it little CPU, up to the inner timeout
// (docs/fault-tolerance.md, "Replica groups": the inner timeout covers a quorum's forming; a dead
// rank is found by its broken connections, a hung one only by that timeout). Then:
// - `group_restarts`: the stop outlasts the inner timeout. The group-mate leaves at it; the
//   stopped rank, resumed (SIGCONT), finds its group broken and leaves too; g1 restarts as two
//   fresh processes, rejoins and heals.
// - otherwise the rank resumes before it: its group's step fails (its deadline passed, the others
//   aborted the cross communicators), and g1 as a whole rejoins and heals, no process lost.
// Either way every committed step has one state over every rank of every group.
void check_rank_stopped(int stopped_index, bool group_restarts) {
  using clock_type = std::chrono::steady_clock;
  const auto ms = [](clock_type::duration d) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
  };
  temp_dir dir("group-hang");
  constexpr auto step_timeout = 1500ms;
  constexpr auto quorum_timeout = 10s;
  constexpr auto inner_timeout = 12s;  // GroupManager's least: max(quorum_timeout, step_timeout + heartbeat_timeout)
  gloo_test::trainer_setup setup{.records = dir.path(), .min_replicas = 2, .quorum_timeout = quorum_timeout};
  setup.gloo.timeout = 60s;  // the cross communicators' own: a backstop the step's deadline must beat
  setup.step_timeout = step_timeout;
  const gloo_test::group_trainer_options extra{
      .reproducible = true, .micro_batches = 12, .inner_timeout = inner_timeout};
  const auto done = [](std::int64_t s, const std::vector<std::string>& members) {
    return s >= 12 && members.size() == 3;  // the others cannot end before g1 is back
  };
  ddp::stores::file_store records(dir.path());
  const auto flag = [&](const std::string& key) { return gloo_test::text_of(records.get(key)) == "1"; };
  // Children 0-5: groups g0, g1, g2 of two ranks; 6-7: g1 restarted once both of its first ranks ended.
  const int stopped = 2 + stopped_index, mate = 2 + (1 - stopped_index);
  constexpr std::int64_t stop_at = 6;
  gloo_test::process_group job(group_restarts ? 8 : 6, [&](int child, const gloo_test::reporter& out) {
    ddp::stores::file_store store(dir.path());
    const int restarted = child >= 6 ? 1 : 0;
    const gloo_test::group_rank me{.group = "g" + std::to_string(restarted ? 1 : child / 2),
                                   .index = restarted ? child - 6 : child % 2,
                                   .group_size = 2,
                                   .incarnation = restarted};
    const bool stops = me.group == "g1" && !restarted && me.index == stopped_index;
    const bool doomed = me.group == "g1" && !restarted && group_restarts;
    if (restarted) {
      const auto until = clock_type::now() + 120s;
      while (!flag("restart")) {
        CHILD_CHECK(clock_type::now() < until, "never told to restart");
        std::this_thread::sleep_for(5ms);
      }
    }
    const auto at_step = [&](std::int64_t s) {
      if (stops && s == stop_at) ::raise(SIGSTOP);  // until SIGCONT
      // While g1 is away the others pace their steps ("pace"), so that they do not run through
      // thousands of steps (and records) while the test waits for the stopped group to end.
      if (!doomed && flag("pace")) std::this_thread::sleep_for(40ms);
    };
    try {
      gloo_test::train_group_rank(store, setup, me, 0, done, at_step, extra);
    } catch (const ddp::error& e) {
      if (!doomed) throw;
      out.set("left", e.what());  // its group broke: this rank stops
    }
  });
  // From the commit records (every rank records its own; "progress" may run ahead of them).
  const std::vector<std::string> ids{"g0.0", "g0.1", "g1.0", "g1.1", "g2.0", "g2.1"};
  const auto committed = [&](std::int64_t s) { return !gloo_test::commit_of(records, s, ids).empty(); };
  REQUIRE(job.wait_stopped(stopped, 30s));
  const auto stopped_at = clock_type::now();
  records.set("pace", ddp::as_bytes(std::string("1")));
  const std::int64_t at_stop = gloo_test::first_uncommitted(records, ids);
  // The step g1 stopped in fails at its deadline; the quorum re-forms without g1 and commits it.
  const auto until = clock_type::now() + 30s;
  while (!committed(stop_at) && clock_type::now() < until) std::this_thread::sleep_for(1ms);
  const bool moved_on = committed(stop_at);
  const auto stall = clock_type::now() - stopped_at;
  // What the group-mate's wait costs (issue #43: every waiting rank spun a core): its CPU time
  // over 4 s of it, well before its inner timeout.
  const auto cpu_before = cpu_time(job.pid(mate));
  std::this_thread::sleep_for(4s);
  const auto cpu_used = cpu_time(job.pid(mate)) - cpu_before;
  const bool mate_still_waiting = clock_type::now() - stopped_at < inner_timeout - 1s;
  std::string story;  // what happened, as measured
  if (group_restarts) {
    // The group-mate leaves at the inner timeout (one wait: its first failed inner exchange ends it).
    const bool mate_left = job.wait_one(mate, inner_timeout + 20s);
    const auto mate_gone = clock_type::now() - stopped_at;
    job.kill(stopped, SIGCONT);
    const auto resumed = clock_type::now();
    const bool stopped_left = job.wait_one(stopped, 30s);
    const auto stopped_gone = clock_type::now() - resumed;
    CHECK(mate_left);
    CHECK(mate_gone < inner_timeout + 8s);
    CHECK(stopped_left);
    const auto why = [&](int child) {  // what it left with ("left=<error>")
      std::string text = job.output(child);
      if (text.rfind("left=", 0) == 0) text = text.substr(5);
      return text.substr(0, std::min<std::size_t>(text.find('\n'), 300));
    };
    story = "the group-mate left after " + std::to_string(ms(mate_gone)) + " ms: " + why(mate) +
            "; the stopped rank left " + std::to_string(ms(stopped_gone)) + " ms after SIGCONT: " + why(stopped) +
            "; restarted, ";
    records.set("restart", ddp::as_bytes(std::string("1")));
  } else {
    CHECK(mate_still_waiting);  // resumed before its group-mate's inner timeout
    job.kill(stopped, SIGCONT);
    story = "resumed " + std::to_string(ms(clock_type::now() - stopped_at)) + " ms after SIGSTOP, ";
  }
  const auto back_from = clock_type::now();
  records.set("pace", ddp::as_bytes(std::string("0")));
  // g1 (restarted, or as it was) rejoins, heals and commits.
  std::int64_t back = -1;
  for (const auto give_up = back_from + 60s; back < 0 && clock_type::now() < give_up;) {
    back = gloo_test::first_commit_of(records, "g1.1", stop_at, ids);
    if (back < 0) std::this_thread::sleep_for(2ms);
  }
  const auto rejoin = clock_type::now() - back_from;
  story += "g1 committed step " + std::to_string(back) + " " + std::to_string(ms(rejoin)) + " ms later";
  const auto outs = job.wait_all(90s);
  INFO(gloo_test::describe_all(outs));
  INFO("stall to the next commit after SIGSTOP: " << ms(stall) << " ms; " << story);
  CHECK(moved_on);
  // One step's deadline, one re-form (heartbeat_timeout 600 ms, settle), the next steps: generous
  // for a busy machine, far below the cross communicators' minute.
  CHECK(stall < step_timeout + 8s);
  CHECK(mate_still_waiting);
  CHECK(cpu_used < 400ms);  // 10 % of a core; the goal is a few percent
  CHECK(back > stop_at);
  for (const auto& o : outs) CHECK(o.ok());
  if (group_restarts) {
    CHECK_FALSE(outs[mate].value("left").empty());
    CHECK_FALSE(outs[stopped].value("left").empty());
  }
  const std::int64_t steps = gloo_test::first_uncommitted(records, ids);
  gloo_test::check_records(dir.path(), ids, steps, 400);
  // g1 stopped in step 6: the others committed it without g1.
  CHECK(at_stop <= stop_at);
  const auto after = gloo_test::commit_of(records, stop_at, ids);
  CHECK_FALSE(after.empty());
  CHECK(after.find("g1,") == std::string::npos);
  // g1 healed: its last commit has the others' bits, with all three groups.
  const std::string last = "c/" + std::to_string(steps - 1) + "/";
  std::string tail;  // the last steps' records, for a failure's message
  for (std::int64_t k = std::max<std::int64_t>(0, steps - 4); k <= steps; ++k) {
    for (const auto& id : ids) {
      tail += "c/" + std::to_string(k) + "/" + id + " = " +
              gloo_test::text_of(records.get("c/" + std::to_string(k) + "/" + id)) + "\n";
    }
  }
  INFO("the last steps' records:\n" << tail);
  CHECK(gloo_test::text_of(records.get(last + "g1.0")) == gloo_test::text_of(records.get(last + "g0.0")));
  CHECK(gloo_test::text_of(records.get(last + "g1.1")) == gloo_test::text_of(records.get(last + "g2.1")));
  CHECK(gloo_test::text_of(records.get(last + "g1.1")).find("g1,") != std::string::npos);
  WARN("group hang (" << (stopped_index == 0 ? "leader" : "follower") << " stopped): next commits " << ms(stall)
                      << " ms after SIGSTOP; the waiting group-mate used " << ms(cpu_used) << " ms of CPU in 4 s; "
                      << story);
}

}  // namespace

TEST_CASE(
    "GroupManager over gloo processes: a follower stopped by SIGSTOP costs the others one step; its group "
    "leaves at its inner timeout, restarts and heals",
    "[gloo][groups][file][hang]") {
  check_rank_stopped(1, true);
}

TEST_CASE(
    "GroupManager over gloo processes: a leader stopped by SIGSTOP costs the others one step; its group "
    "leaves at its inner timeout, restarts and heals",
    "[gloo][groups][file][hang]") {
  check_rank_stopped(0, true);
}

TEST_CASE(
    "GroupManager over gloo processes: a rank stopped by SIGSTOP and resumed within its group's inner timeout: "
    "the others lose one step, its group rejoins and heals as a whole",
    "[gloo][groups][file][hang]") {
  const int stopped_index = GENERATE(0, 1);
  INFO("g1." << stopped_index << " stopped");
  check_rank_stopped(stopped_index, false);
}
