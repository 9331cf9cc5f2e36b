#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/work.hpp>

namespace {
// A controllable backend state: completes after `polls_needed` polls, or fails.
struct fake_state final : ddp::work_state {
  int polls_needed;
  bool fail;
  int* abandoned;
  fake_state(int n, bool f, int* ab) : ddp::work_state(make_info()), polls_needed(n), fail(f), abandoned(ab) {}
  static ddp::op_info make_info() {
    ddp::op_info i;
    i.rank = 3;
    i.name = "allreduce";
    i.seq = 7;
    i.count = 10;
    i.timeout = std::chrono::milliseconds(50);
    return i;
  }
  bool poll() override {
    if (fail) throw ddp::communication_error(3, "allreduce #7", "peer died");
    return --polls_needed <= 0;
  }
  void abandon() noexcept override { ++*abandoned; }
};
}  // namespace

TEST_CASE("work: test drives progress and runs continuations once", "[work]") {
  int abandoned = 0;
  int ran = 0;
  ddp::work w(std::make_unique<fake_state>(3, false, &abandoned));
  w.then([&] { ++ran; });
  CHECK_FALSE(w.test());
  CHECK_FALSE(w.test());
  CHECK(w.test());
  CHECK(ran == 1);
  CHECK(w.test());
  CHECK(ran == 1);
  CHECK(w.done());
  CHECK(abandoned == 0);
}

TEST_CASE("work: errors are rethrown every time and continuations skipped", "[work]") {
  int abandoned = 0;
  int ran = 0;
  ddp::work w(std::make_unique<fake_state>(1, true, &abandoned));
  w.then([&] { ++ran; });
  CHECK_THROWS_AS(w.test(), ddp::communication_error);
  CHECK_THROWS_WITH(w.wait(), Catch::Contains("peer died") && Catch::Contains("rank 3"));
  CHECK(w.failed());
  CHECK(ran == 0);
  CHECK(abandoned == 1);
}

TEST_CASE("work: wait times out with an error naming the operation", "[work]") {
  int abandoned = 0;
  ddp::work w(std::make_unique<fake_state>(1 << 30, false, &abandoned));
  CHECK_THROWS_AS(w.wait(), ddp::timeout_error);
  CHECK_THROWS_WITH(w.wait(), Catch::Contains("allreduce #7") && Catch::Contains("50 ms"));
  CHECK(abandoned == 1);
}

TEST_CASE("work: destroying a pending handle abandons it", "[work]") {
  int abandoned = 0;
  { ddp::work w(std::make_unique<fake_state>(5, false, &abandoned)); }
  CHECK(abandoned == 1);
}

TEST_CASE("work: a throwing continuation becomes the error", "[work]") {
  int abandoned = 0;
  ddp::work w(std::make_unique<fake_state>(1, false, &abandoned));
  w.then([] { throw std::runtime_error("copy-back failed"); });
  CHECK_THROWS_WITH(w.wait(), "copy-back failed");
  CHECK(w.failed());
}

TEST_CASE("work::all completes when every part has", "[work]") {
  int abandoned = 0;
  std::vector<ddp::work> parts;
  parts.emplace_back(std::make_unique<fake_state>(2, false, &abandoned));
  parts.emplace_back(std::make_unique<fake_state>(4, false, &abandoned));
  parts.push_back(ddp::work::ready());
  auto all = ddp::work::all(std::move(parts));
  CHECK_FALSE(all.test());
  all.wait();
  CHECK(all.done());
  CHECK(ddp::work::all({}).done());
}

// ---- waiting on several handles: one deadline, round-robin, honest messages (issues #13, #16) ----

namespace {
using namespace std::chrono_literals;

// A state that never completes on its own, with its own sequence number and timeout.
struct stuck_state final : ddp::work_state {
  int* abandoned;
  stuck_state(std::uint64_t seq, std::chrono::milliseconds timeout, int* ab)
      : ddp::work_state(make_info(seq, timeout)), abandoned(ab) {}
  static ddp::op_info make_info(std::uint64_t seq, std::chrono::milliseconds timeout) {
    ddp::op_info i;
    i.rank = 1;
    i.name = "allreduce";
    i.seq = seq;
    i.count = 4;
    i.timeout = timeout;
    return i;
  }
  bool poll() override { return false; }
  void abandon() noexcept override { ++*abandoned; }
};

// Two states that complete only together, after each was polled `needed` times: like two ring
// allreduces that advance only while their own handle is tested. Waiting on one alone never ends.
struct paired_state final : ddp::work_state {
  int polls = 0;
  int needed;
  const paired_state** partner;
  paired_state(std::uint64_t seq, int n, const paired_state** p)
      : ddp::work_state(stuck_state::make_info(seq, 300ms)), needed(n), partner(p) {}
  bool poll() override {
    ++polls;
    return polls >= needed && *partner != nullptr && (*partner)->polls >= needed;
  }
};

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}
}  // namespace

TEST_CASE("work: a timeout says how long the wait really took", "[work][timeout]") {
  int abandoned = 0;
  ddp::work w(std::make_unique<stuck_state>(5, 200ms, &abandoned));
  const auto start = std::chrono::steady_clock::now();
  try {
    w.wait();
    FAIL("completed");
  } catch (const ddp::timeout_error& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK_THAT(what, Catch::Contains("allreduce #5 (sum, f32 x 4)"));
    CHECK_THAT(what, Catch::Contains("200 ms timeout"));
    CHECK_THAT(what, Catch::Contains("waited"));
    CHECK_THAT(what, !Catch::Contains("within 0 ms"));
  }
  CHECK(ms_since(start) >= 199);
  CHECK(abandoned == 1);
}

TEST_CASE("work::all: one deadline from the parts' timeouts, naming the pending collective", "[work][timeout]") {
  int abandoned = 0;
  std::vector<ddp::work> parts;
  for (std::uint64_t seq : {3u, 4u, 5u}) parts.emplace_back(std::make_unique<stuck_state>(seq, 300ms, &abandoned));
  auto all = ddp::work::all(std::move(parts));
  REQUIRE(all.timeout() == 300ms);  // not the 5-minute default
  const auto start = std::chrono::steady_clock::now();
  try {
    all.wait();
    FAIL("completed");
  } catch (const ddp::timeout_error& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK_THAT(what, Catch::Contains("allreduce #3 (sum, f32 x 4)"));  // the first pending part, not "group"
    CHECK_THAT(what, Catch::Contains("300 ms timeout"));
    CHECK_THAT(what, Catch::Contains("waited"));
    CHECK_THAT(what, Catch::Contains("allreduce #4") && Catch::Contains("allreduce #5"));
    CHECK(e.operation() == "allreduce #3 (sum, f32 x 4)");
  }
  const double ms = ms_since(start);
  CHECK(ms >= 299);
  CHECK(ms < 2.5 * 300);  // one timeout for the whole group, not one per part
  CHECK(abandoned == 3);
  CHECK(all.failed());
}

TEST_CASE("work::all waits round-robin: parts that advance only when tested complete together", "[work]") {
  const paired_state* a = nullptr;
  const paired_state* b = nullptr;
  auto sa = std::make_unique<paired_state>(1, 50, &b);
  auto sb = std::make_unique<paired_state>(2, 50, &a);
  a = sa.get();
  b = sb.get();
  std::vector<ddp::work> parts;
  parts.emplace_back(std::move(sa));
  parts.emplace_back(std::move(sb));
  auto all = ddp::work::all(std::move(parts));
  REQUIRE_NOTHROW(all.wait());  // waiting part by part would poll only the first, and time out
  CHECK(all.done());
}

TEST_CASE("work::all fails with the first error; the others are abandoned", "[work]") {
  int abandoned = 0;
  std::vector<ddp::work> parts;
  parts.emplace_back(std::make_unique<stuck_state>(1, 300ms, &abandoned));
  parts.emplace_back(std::make_unique<fake_state>(1, true, &abandoned));
  auto all = ddp::work::all(std::move(parts));
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(all.wait(), Catch::Contains("peer died"));
  CHECK(ms_since(start) < 250);  // an error is reported at once, not after the other part's timeout
  CHECK(abandoned == 2);
}

TEST_CASE("error: what() says rank and operation, message() only what was wrong", "[unit][error]") {
  const ddp::timeout_error e(3, "allreduce #12", "waited 400 ms");
  CHECK(std::string(e.what()) == "ddp: rank 3, allreduce #12: waited 400 ms");
  CHECK(e.message() == "waited 400 ms");
  CHECK(e.rank() == 3);
  CHECK(e.operation() == "allreduce #12");
  const ddp::usage_error unknown(-1, "", "no communicator yet");
  CHECK(std::string(unknown.what()) == "ddp: rank ?: no communicator yet");
  CHECK(unknown.message() == "no communicator yet");
}
