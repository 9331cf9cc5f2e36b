// The Manager over real processes, gloo and the file store (issue #24): two fresh replicas
// joining three that train must not split the job; a healing source SIGKILLed after its first
// chunk must not leave a torn state in use. Children record every commit and membership in the
// store; the parent checks: one state per committed step, one member list per committed step and
// per generation, and the job reached its last step.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/stores/file_store.hpp>

#include "manager_trainer.hpp"
#include "process_group.hpp"

using namespace std::chrono_literals;
namespace st = ddp::stores;
using gloo_test::temp_dir;

namespace {

// One trainer whose Manager store is the file store of its records too.
void train(const std::filesystem::path& dir, const std::string& id, std::int64_t start_after,
           const std::function<bool(std::int64_t, const std::vector<std::string>&)>& done, int min_replicas,
           std::chrono::milliseconds quorum_timeout, std::function<void(int)> on_broadcast = {},
           ddp::heal_transport heal_over = ddp::heal_transport::quorum_broadcast) {
  st::file_store store(dir);
  gloo_test::trainer_setup setup{.records = dir,
                                 .min_replicas = min_replicas,
                                 .quorum_timeout = quorum_timeout,
                                 .on_broadcast = std::move(on_broadcast),
                                 .heal_over = heal_over};
  gloo_test::train(store, setup, id, start_after, done);
}

void check_store(const std::filesystem::path& dir, const std::vector<std::string>& ids, std::int64_t steps,
                 std::uint64_t generations) {
  gloo_test::check_records(dir, ids, steps, generations);
}

}  // namespace

TEST_CASE("Manager over gloo processes: two fresh replicas join three training ones; one job",
          "[gloo][manager][file]") {
  for (int run = 0; run < 2; ++run) {
    INFO("run " << run);
    temp_dir dir("manager-join");
    const std::vector<std::string> ids{"r0", "r1", "r2", "r3", "r4"};
    gloo_test::process_group group(5, [&](int rank, const gloo_test::reporter&) {
      train(
          dir.path(), ids[static_cast<std::size_t>(rank)], rank < 3 ? 0 : 3 + run,
          [](std::int64_t s, const std::vector<std::string>& members) { return s >= 25 && members.size() == 5; }, 2,
          15s);
    });
    const auto outs = group.wait_all(40s);
    INFO(gloo_test::describe_all(outs));
    for (const auto& o : outs) CHECK(o.ok());
    check_store(dir.path(), ids, 25, 60);
  }
}

namespace {

// "a" and "c" train; "b" joins fresh. a kills itself (SIGKILL) on its second healing broadcast
// as a source. b must heal from c, bit-identical, and never use the torn bytes.
void check_source_killed_mid_heal(ddp::heal_transport heal_over) {
  temp_dir dir("manager-heal");
  const std::vector<std::string> ids{"a", "b", "c"};
  const auto done = [](std::int64_t s, const std::vector<std::string>& members) {
    return s >= 20 && members == std::vector<std::string>{"b", "c"};
  };
  gloo_test::process_group group(3, [&](int rank, const gloo_test::reporter&) {
    if (rank == 0) {
      int sent = 0;
      train(
          dir.path(), "a", 0, done, 2, 15s,
          [&](int root) {
            if (root == 0 && st::file_store(dir.path()).get("b-started") && ++sent == 2) ::raise(SIGKILL);
          },
          heal_over);
    } else if (rank == 1) {
      st::file_store s(dir.path());
      while (s.add("progress", 0) < 5) std::this_thread::sleep_for(5ms);
      s.set("b-started", ddp::as_bytes(std::string_view("1")));
      train(dir.path(), "b", 5, done, 2, 15s, {}, heal_over);
    } else {
      train(dir.path(), "c", 0, done, 2, 15s, {}, heal_over);
    }
  });
  const auto outs = group.wait_all(40s);
  INFO(gloo_test::describe_all(outs));
  CHECK((!outs[0].exited && outs[0].signal == SIGKILL));
  CHECK(outs[1].ok());
  CHECK(outs[2].ok());
  check_store(dir.path(), ids, 20, 60);
}

}  // namespace

TEST_CASE("Manager over gloo processes: a healing source SIGKILLed after its first chunk", "[gloo][manager][file]") {
  check_source_killed_mid_heal(ddp::heal_transport::quorum_broadcast);
}

TEST_CASE("Manager over gloo processes: a healing source SIGKILLed on its route after its first chunk",
          "[gloo][manager][file]") {
  // Over source routes a's chunks travel on a's route to b alone; its death fails that route.
  check_source_killed_mid_heal(ddp::heal_transport::source_routes);
}

TEST_CASE("Manager over gloo processes: a replica stopped by SIGSTOP costs the others one step; resumed, it heals",
          "[gloo][manager][file][hang]") {
  // c stops itself (SIGSTOP: its sockets stay open, nothing fails) at the start of step 5, after
  // its start_quorum(): never while it holds a file-store lock, which would fail the others' store
  // calls instead. gloo's own timeout is a minute, so only the step's deadline can end the others'
  // wait: they must commit step 5 and the next within step_timeout plus one quorum re-form, without
  // c. After SIGCONT, c finds itself out of the quorum, rejoins, heals, and every replica ends with
  // the same state. Steps are read from the commit records ("progress" may run ahead).
  using clock_type = std::chrono::steady_clock;
  temp_dir dir("manager-hang");
  const std::vector<std::string> ids{"a", "b", "c"};
  constexpr auto step_timeout = 1500ms;
  constexpr std::int64_t stop_at = 5;
  const auto done = [](std::int64_t s, const std::vector<std::string>& members) {
    return s >= 40 && members.size() == 3;
  };
  gloo_test::process_group group(3, [&](int rank, const gloo_test::reporter&) {
    gloo_test::trainer_setup setup{.records = dir.path(), .min_replicas = 2, .quorum_timeout = 20s};
    setup.gloo.timeout = 60s;
    setup.step_timeout = step_timeout;
    bool stopped = false;
    if (rank == 2) {
      setup.on_step = [&](std::int64_t s) {
        if (s == stop_at && !stopped) {
          stopped = true;
          ::raise(SIGSTOP);
        }
      };
    }
    st::file_store store(dir.path());
    gloo_test::train(store, setup, ids[static_cast<std::size_t>(rank)], 0, done);
  });
  REQUIRE(group.wait_stopped(2, 30s));
  const auto stopped = clock_type::now();
  st::file_store records(dir.path());
  bool moved_on = false;  // a and b committed steps stop_at and stop_at + 1 without c
  for (const auto until = stopped + 20s; !moved_on && clock_type::now() < until; std::this_thread::sleep_for(2ms)) {
    moved_on = gloo_test::first_uncommitted(records, ids) > stop_at + 1;
  }
  const auto stall = clock_type::now() - stopped;
  group.kill(2, SIGCONT);
  const auto outs = group.wait_all(60s);
  INFO(gloo_test::describe_all(outs));
  INFO("stall to the second commit after SIGSTOP: "
       << std::chrono::duration_cast<std::chrono::milliseconds>(stall).count() << " ms");
  CHECK(moved_on);
  // One step's deadline, one re-form (heartbeat_timeout 600 ms, settle), the next step: generous
  // for a busy machine, far below gloo's minute.
  CHECK(stall < step_timeout + 8s);
  CHECK(gloo_test::text_of(records.get("c/" + std::to_string(stop_at) + "/c")).empty());  // c missed it
  for (const auto& o : outs) CHECK(o.ok());
  check_store(dir.path(), ids, 40, 200);
  // c ended in the full quorum: it healed from a or b.
  CHECK(gloo_test::text_of(records.get("c/39/c")) == gloo_test::text_of(records.get("c/39/a")));
}

TEST_CASE(
    "Manager over gloo processes: a replica that dies after enrolling holds the others for the connect "
    "timeout, not the quorum's",
    "[gloo][manager][file]") {
  // d dies at step 5 (SIGKILL); a, b and c enroll in the next generation, and c dies as its factory
  // starts (before gloo publishes its address), as a replica on a host that is lost mid re-form.
  // gloo's own connect timeout is a minute and the quorum's deadline 20 s: the others must give up
  // on c after the Manager's connect timeout (5 s here), form without it and train on.
  using clock_type = std::chrono::steady_clock;
  temp_dir dir("manager-enrolled-dead");
  const std::vector<std::string> ids{"a", "b", "c", "d"};
  constexpr std::int64_t kill_at = 5;
  const auto done = [](std::int64_t s, const std::vector<std::string>&) { return s >= kill_at + 10; };
  gloo_test::process_group group(4, [&](int rank, const gloo_test::reporter&) {
    gloo_test::trainer_setup setup{.records = dir.path(), .min_replicas = 2, .quorum_timeout = 20s};
    setup.gloo.connect_timeout = 60s;
    if (rank == 3) {
      setup.on_step = [](std::int64_t s) {
        if (s == kill_at) ::raise(SIGKILL);
      };
    }
    if (rank == 2) {
      setup.on_connect = [](const ddp::quorum_info& q) {
        if (q.generation >= 2) ::_exit(3);
      };
    }
    st::file_store store(dir.path());
    gloo_test::train(store, setup, ids[static_cast<std::size_t>(rank)], 0, done);
  });
  const auto start = clock_type::now();
  const auto outs = group.wait_all(60s);
  const auto took = clock_type::now() - start;
  INFO(gloo_test::describe_all(outs));
  CHECK(outs[0].ok());
  CHECK(outs[1].ok());
  CHECK(!outs[2].ok());  // c did die in its factory
  st::file_store records(dir.path());
  // a and b formed generation 3 without c (generation 2 never connected) and committed on.
  CHECK(gloo_test::text_of(records.get("c/" + std::to_string(kill_at + 9) + "/a")) ==
        gloo_test::text_of(records.get("c/" + std::to_string(kill_at + 9) + "/b")));
  CHECK(gloo_test::text_of(records.get("c/" + std::to_string(kill_at + 9) + "/a")).rfind("a,b, ", 0) == 0);
  // Within the connect timeout and a re-form or two, far from the quorum deadline's 20 s.
  CHECK(took < 18s);
  check_store(dir.path(), ids, kill_at + 10, 10);
}
