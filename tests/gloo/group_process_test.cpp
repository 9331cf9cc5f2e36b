// GroupManager over real processes, gloo and the file store (issue #30): three replica groups of
// two processes; one process SIGKILLs itself mid-training. Its group-mate stops (shared fate), the
// other groups commit the next steps without the group and without a hang; the group restarts as
// two fresh processes, heals by shard (each rank from the same-index ranks of the others) and
// ends with the survivors' bits. Checked from the records: one state and one member list per
// committed step over every rank of every group, and the job reached its last step with all three.
#include <signal.h>

#include <chrono>
#include <string>
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
