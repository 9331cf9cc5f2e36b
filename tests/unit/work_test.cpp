#include <stdexcept>

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
