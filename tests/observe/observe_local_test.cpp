// Observability over local ranks (threads): straggler attribution with an injected delay,
// timeline traces and their merge, progress reports of healing and rendezvous.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/bucketer.hpp>
#include <ddp/bucketing/fixed.hpp>
#include <ddp/local.hpp>
#include <ddp/manager.hpp>
#include <ddp/progress.hpp>
#include <ddp/stores/memory_store.hpp>
#include <ddp/stores/membership.hpp>
#include <ddp/straggler.hpp>
#include <ddp/timeline.hpp>

#include "../common/ranks.hpp"
#include "observe_cases.hpp"

using namespace std::chrono_literals;

namespace {

using test_ranks::on_ranks;
constexpr auto rank_timeout = 30s;  // per blocking wait: the delayed-rank cases sleep on purpose

std::filesystem::path fresh_dir(const std::string& name) {
  std::random_device rd;
  auto dir = std::filesystem::temp_directory_path() / ("ddp-" + name + "-" + std::to_string(rd()));
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace

TEST_CASE("attribute_straggler(): the rank with the shortest arrival wait is named", "[unit][straggler]") {
  auto words_of = [](std::vector<ddp::rank_timing> ts, std::uint64_t it = 7) {
    std::vector<std::int64_t> all;
    for (const auto& t : ts) {
      const auto w = ddp::timing_to_words(it, t);
      all.insert(all.end(), w.begin(), w.end());
    }
    return all;
  };
  ddp::rank_timing early{10, 30, 31, 0, false}, late{40, 0.5, 0.8, 0, false}, mid{25, 15, 16, 0, false};
  const auto rep = ddp::attribute_straggler(words_of({early, late, mid}));
  REQUIRE(rep.valid);
  CHECK(rep.iteration == 7);
  CHECK(rep.slowest_rank == 1);
  CHECK(rep.slowest_late_ms == Approx(30.2));
  CHECK(rep.ready_span_spread_ms == Approx(30));
  CHECK(rep.max_finalize_wait_ms == Approx(30));
  CHECK(rep.ranks[0].late_ms == Approx(0));
  CHECK(rep.ranks[2].late_ms == Approx(15));
  CHECK(rep.describe().find("slowest rank 1") != std::string::npos);

  SECTION("a shadowed (joined) rank is never named") {
    ddp::rank_timing joined{0, 0.1, 0.1, 0, true};
    const auto r2 = ddp::attribute_straggler(words_of({early, joined, mid}));
    CHECK(r2.slowest_rank == 2);
  }
  SECTION("ties go to the lowest rank") { CHECK(ddp::attribute_straggler(words_of({mid, mid})).slowest_rank == 0); }
  SECTION("unset words or another iteration: no report") {
    auto w = words_of({early, late});
    w[ddp::timing_words + 2] = ddp::timing_unset;
    CHECK_FALSE(ddp::attribute_straggler(w).valid);
    auto w2 = words_of({early, late});
    w2[ddp::timing_words] = 8;
    CHECK_FALSE(ddp::attribute_straggler(w2).valid);
    CHECK_FALSE(ddp::attribute_straggler({}).valid);
  }
}

TEST_CASE("straggler: the delayed rank is named (local ranks 2, 3, 4)", "[local][straggler]") {
  for (int n : {2, 3, 4}) {
    std::vector<observe_cases::straggler_result> results(static_cast<std::size_t>(n));
    REQUIRE_NOTHROW(on_ranks(
        n,
        [&](ddp::communicator_ref c) {
          results[static_cast<std::size_t>(c.rank())] = observe_cases::delayed_rank_is_named(c, 60ms, 4, 1);
        },
        rank_timeout));
    const auto& r = results[0];
    std::printf("local %d ranks: delayed rank named in %d of %d iterations (smallest lateness %.1f ms for 60 ms)\n", n,
                r.named, r.iterations, r.min_late_ms);
    CHECK(r.named >= r.iterations - n);
  }
}

TEST_CASE("straggler: exchange period and join", "[local][straggler]") {
  for (int n : {1, 2, 3}) {
    INFO("ranks " << n);
    REQUIRE_NOTHROW(on_ranks(
        n, [](ddp::communicator_ref c) { observe_cases::exchange_period(c); }, rank_timeout));
    REQUIRE_NOTHROW(on_ranks(
        n, [](ddp::communicator_ref c) { observe_cases::exchange_under_join(c); }, rank_timeout));
  }
}

TEST_CASE("timeline: per-rank traces parse, hold the expected events and merge (local ranks)", "[local][timeline]") {
  for (int n : {1, 3}) {
    INFO("ranks " << n);
    const auto dir = fresh_dir("timeline");
    REQUIRE_NOTHROW(on_ranks(
        n, [&](ddp::communicator_ref c) { observe_cases::timeline_of_training(c, dir); }, rank_timeout));
    std::filesystem::remove_all(dir);
  }
}

TEST_CASE("timeline::recorder: ring, pause, escaping, merge errors", "[unit][timeline]") {
  ddp::timeline::recorder rec(2, {.capacity = 4});
  const auto t0 = ddp::clock::now();
  for (int i = 0; i < 6; ++i)
    rec.instant("backward", "ready", t0 + std::chrono::microseconds(i), {{"gradient", static_cast<double>(i)}});
  CHECK(rec.size() == 4);
  CHECK(rec.dropped() == 2);
  CHECK(rec.events().front().args[0].value == 2);  // the oldest two were overwritten
  rec.pause();
  rec.span("manager", "quorum", t0, t0 + 1ms);
  CHECK(rec.size() == 4);
  rec.resume();
  rec.span({"bucket", 3}, "allreduce", t0, t0 + 1ms, {{"bytes", 4096}}, "a \"quoted\"\nline\t\x01");
  std::ostringstream os;
  rec.write(os);
  const auto s = observe_cases::summarize(os.str());
  CHECK(s.events.at(2).at("bucket 3/allreduce") == 1);
  CHECK(s.events.at(2).at("backward/ready") == 3);
  CHECK(s.tracks.at(2).size() == 2);

  const auto dir = fresh_dir("merge");
  {
    std::ofstream bad(dir / "bad.json");
    bad << "{\"traceEvents\":[]}";
  }
  std::vector<std::string> inputs{(dir / "bad.json").string()};
  std::ostringstream out;
  CHECK_THROWS_AS(ddp::timeline::merge(inputs, out), ddp::usage_error);
  inputs = {(dir / "missing.json").string()};
  CHECK_THROWS_AS(ddp::timeline::merge(inputs, out), ddp::usage_error);
  std::filesystem::remove_all(dir);
}

TEST_CASE("progress: meter and the default printer", "[unit][progress]") {
  std::vector<ddp::progress_update> got;
  ddp::progress_sink sink = [&](const ddp::progress_update& u) { got.push_back(u); };
  {
    ddp::progress_meter m(&sink, "heal", 0, 1000, "test", 0ms);
    m.add_bytes(250);
    std::this_thread::sleep_for(5ms);
    m.add_bytes(250);
    m.finish();
    m.finish();
  }
  REQUIRE(got.size() == 3);
  CHECK(got[1].done_bytes == 500);
  CHECK(got[1].rate_bytes_per_s > 0);
  CHECK(got[1].eta_s > 0);
  CHECK(got[2].finished);
  CHECK(got[1].describe().find("500 B of 1000 B (50%)") != std::string::npos);
  ddp::progress_update r;
  r.operation = "gloo connect";
  r.arrived = 2;
  r.expected = 3;
  r.elapsed_s = 4;
  r.missing = {"rank 2"};
  CHECK(r.describe() == "gloo connect: 2 of 3 members after 4.0 s; missing: rank 2");

  // The default printer: rank 0 only, quiet for short operations, rate-limited.
  std::FILE* f = std::tmpfile();
  REQUIRE(f);
  auto print = ddp::print_progress({.interval = 1000ms, .quiet = 2000ms, .all_ranks = false, .stream = f});
  ddp::progress_update u;
  u.operation = "heal";
  u.rank = 0;
  u.total_bytes = 100;
  u.elapsed_s = 1.0;
  print(u);  // quiet
  u.rank = 1;
  u.elapsed_s = 3.0;
  print(u);  // not rank 0
  u.rank = 0;
  print(u);  // printed
  print(u);  // rate-limited
  u.finished = true;
  print(u);  // final line, since it printed before
  ddp::progress_update quick;
  quick.operation = "rendezvous";
  quick.rank = 0;
  quick.finished = true;
  print(quick);  // a quick operation's final report: silent
  std::rewind(f);
  std::string text;
  for (int c; (c = std::fgetc(f)) != EOF;) text += static_cast<char>(c);
  std::fclose(f);
  INFO(text);
  CHECK(std::count(text.begin(), text.end(), '\n') == 2);
  CHECK(text.find("ddp rank 0: heal: 0 B of 100 B") != std::string::npos);
  CHECK(text.find("done in 3.0 s") != std::string::npos);
}

TEST_CASE("progress: a rendezvous names the members that have not arrived", "[local][progress]") {
  ddp::stores::memory_store store;
  std::mutex mu;
  std::vector<ddp::progress_update> got;
  ddp::stores::group_options g;
  g.min_members = 3;
  g.max_members = 3;
  g.timeout = 20s;
  g.expected = {"a", "b", "c"};
  g.progress = [&](const ddp::progress_update& u) {
    std::lock_guard lk(mu);
    got.push_back(u);
  };
  std::vector<int> ranks(3, -1);
  std::vector<std::thread> ts;
  ts.emplace_back([&] { ranks[0] = ddp::stores::enroll(store, "a", g).rank; });
  std::this_thread::sleep_for(50ms);  // "a" arrives first: it closes the group and reports
  ts.emplace_back([&] { ranks[1] = ddp::stores::enroll(store, "b", g).rank; });
  std::this_thread::sleep_for(1200ms);  // "c" is late
  ts.emplace_back([&] { ranks[2] = ddp::stores::enroll(store, "c", g).rank; });
  for (auto& t : ts) t.join();
  CHECK(ranks == std::vector<int>{0, 1, 2});
  std::lock_guard lk(mu);
  REQUIRE(!got.empty());
  bool named_c = false;
  for (const auto& u : got) {
    CHECK(std::string(u.operation) == "rendezvous");
    CHECK(u.rank == 0);
    if (!u.finished && u.missing == std::vector<std::string>{"c"}) named_c = true;
  }
  CHECK(named_c);
  CHECK(got.back().finished);
  CHECK(got.back().arrived == 3);
}

TEST_CASE("Manager: healing reports progress and records quorum, heal and commit votes",
          "[local][manager][progress][timeline]") {
  ddp::stores::memory_store store;
  ddp::local::fabric fabric(ddp::local::options{.timeout = 20s, .faults = {}});
  std::mutex mu;
  std::vector<ddp::progress_update> heal_updates;
  std::vector<std::vector<ddp::timeline::event>> recorded(2);
  constexpr std::size_t state_floats = 1 << 18;  // 1 MiB of state, healed in 64 KiB chunks
  auto replica = [&](int who) {
    std::vector<float> p(state_floats, static_cast<float>(who + 1)), g(state_floats, 0.0f);
    ddp::training_state state;
    state.add(p);
    ddp::manager_options o;
    o.replica_id = who == 0 ? "a" : "b";
    o.min_replicas = 2;
    o.quorum_timeout = 20s;
    o.heartbeat_interval = 10ms;
    o.settle = 50ms;
    o.heal_chunk_bytes = 64 << 10;
    o.progress = [&](const ddp::progress_update& u) {
      std::lock_guard lk(mu);
      if (std::string(u.operation) == "heal") heal_updates.push_back(u);
    };
    ddp::Manager m(
        store,
        [&](const ddp::quorum_info& q) {
          return ddp::any_communicator(fabric.connect("g" + std::to_string(q.generation), q.rank, q.size));
        },
        state, o);
    ddp::timeline::recorder rec(who);
    m.set_recorder(&rec);
    // straggler_every = 1 over a Manager: the exchange goes through the quorum's communicator.
    ddp::Bucketer<ddp::bucketing::fixed> grads(m, {}, {.check_layout = false, .straggler_every = 1});
    grads.add(p, g);
    grads.build();
    grads.set_recorder(&rec);
    for (int s = 0; s < 3; ++s) {
      m.start_quorum();
      grads.mark_ready(0);
      grads.finalize();
      if (!m.should_commit()) throw std::runtime_error("a step did not commit");
      const auto& rep = grads.last_step().straggler;
      if (!rep.valid || rep.ranks.size() != 2) throw std::runtime_error("no straggler report over the Manager");
    }
    recorded[static_cast<std::size_t>(who)] = rec.events();
  };
  std::thread t0(replica, 0), t1(replica, 1);
  t0.join();
  t1.join();
  {
    std::lock_guard lk(mu);
    REQUIRE(!heal_updates.empty());
    std::uint64_t finished = 0;
    for (const auto& u : heal_updates) {
      CHECK(u.total_bytes == state_floats * sizeof(float));
      CHECK(u.done_bytes <= u.total_bytes);
      if (u.finished) {
        ++finished;
        CHECK(u.done_bytes == u.total_bytes);
        CHECK(u.detail.find("state of step 0") != std::string::npos);
      }
    }
    CHECK(finished == 2);  // both members took part in the heal
  }
  for (const auto& evs : recorded) {
    std::map<std::string, int> count;
    for (const auto& e : evs) ++count[std::string(e.track.name) + "/" + e.name];
    CHECK(count["manager/quorum"] == 1);
    CHECK(count["manager/quorum formed"] == 1);
    CHECK(count["manager/heal (receive)"] + count["manager/heal (send)"] == 1);
    CHECK(count["manager/commit vote"] == 3);
    CHECK(count["bucket/allreduce"] == 3);
    CHECK(count["step/step"] == 3);
  }
}
