#include <array>
#include <chrono>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/local/communicator.hpp>

#include "../../common/ranks.hpp"
#include "bucketer_cases.hpp"

using test_ranks::on_ranks;
using test_ranks::require_on_ranks;

TEST_CASE("Bucketer over local ranks: averages, layouts, hooks, unused, no_sync, rebuild, errors",
          "[local][bucketer]") {
  require_on_ranks(1, 4, [](ddp::communicator_ref c) { bucketer_cases::run_all(c); });
}

TEST_CASE("Bucketer: a user-written layout policy", "[local][bucketer]") {
  struct one_per_gradient {
    ddp::bucket_layout layout(std::span<const ddp::gradient_info> g) const {
      ddp::bucket_layout l;
      for (const auto& x : g) l.buckets.push_back({x.index});
      return l;
    }
  };
  REQUIRE_NOTHROW(on_ranks(3, [](ddp::communicator_ref c) {
    std::vector<std::vector<float>> g(5, std::vector<float>(4));
    ddp::Bucketer<one_per_gradient> b(c);
    for (auto& x : g) b.add(x);
    for (auto& x : g) std::fill(x.begin(), x.end(), static_cast<float>(c.rank()));
    for (std::size_t i = 0; i < 5; ++i) b.mark_ready(i);
    b.finalize();
    SUITE_EXPECT(b.layout().size() == 5, "one bucket per gradient");
    for (auto& x : g) SUITE_EXPECT(x[0] == 1.0f, "mean of 0,1,2");
  }));
}

TEST_CASE("Bucketer: ten re-creations over new communicators leave nothing attached", "[local][bucketer]") {
  for (int n : {2, 3}) {
    std::vector<ddp::local::world> worlds;
    for (int c = 0; c <= 10; ++c) worlds.emplace_back(n);
    std::vector<std::thread> threads;
    std::vector<std::string> errors(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        try {
          bucketer_cases::recreate_ten_times(
              r, [&](int cycle) { return worlds[static_cast<std::size_t>(cycle)].rank(r); });
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(r)] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (const auto& e : errors) CHECK(e.empty());
  }
}

TEST_CASE("Bucketer: a failed step does not hang and the Bucketer can be destroyed", "[local][bucketer][fault]") {
  ddp::local::options opts;
  opts.timeout = std::chrono::seconds(5);
  opts.faults = {ddp::local::fault::fail_at(1, 2)};  // rank 1 dies at its third collective
  std::atomic<int> errors{0};
  ddp::local::run(
      3,
      [&](ddp::local::communicator& c) {
        std::vector<std::vector<float>> g(6, std::vector<float>(100, 1.0f));
        ddp::Bucketer b(c, ddp::bucketing::size_capped{.cap_bytes = 400, .small_bucket_bytes = 400});
        for (auto& x : g) b.add(x);
        try {
          for (int it = 0; it < 3; ++it) {
            for (std::size_t i = 0; i < g.size(); ++i) b.mark_ready(i);
            b.finalize();
          }
        } catch (const ddp::communication_error&) {
          ++errors;
        }
      },
      opts);
  CHECK(errors == 3);
}

TEST_CASE("Bucketer: a peer that leaves costs finalize() one timeout, and the error says what and how long",
          "[local][bucketer][fault][timeout]") {
  // 4 buckets (one per gradient); rank 1 leaves at its first bucket's allreduce (its collective
  // number 1, after build()'s layout check), so rank 0 has every bucket in flight and none completes.
  constexpr auto timeout = std::chrono::milliseconds(400);
  ddp::local::options opts;
  opts.timeout = timeout;
  opts.faults = {ddp::local::fault::leave_at(1, 1)};
  std::string message;
  double elapsed_ms = -1;
  std::array<std::size_t, 2> buckets{};  // checked after run(): Catch2's macros are not thread-safe
  ddp::local::run(
      2,
      [&](ddp::local::communicator& c) {
        std::vector<std::vector<float>> g(4, std::vector<float>(100, 1.0f));
        ddp::Bucketer b(c, ddp::bucketing::size_capped{.cap_bytes = 400, .small_bucket_bytes = 400});
        for (auto& x : g) b.add(x);
        b.build();
        buckets[static_cast<std::size_t>(c.rank())] = b.layout().size();
        for (std::size_t i = 0; i < g.size(); ++i) b.mark_ready(i);  // rank 1 leaves in here
        const auto start = std::chrono::steady_clock::now();
        try {
          b.finalize();
        } catch (const ddp::timeout_error& e) {
          elapsed_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
          message = e.what();
        }
      },
      opts);
  INFO(message);
  CHECK(buckets == std::array<std::size_t, 2>{4, 4});
  REQUIRE(elapsed_ms >= 0);  // rank 0 got a timeout_error
  CHECK(elapsed_ms >= 0.95 * timeout.count());
  CHECK(elapsed_ms < 2.5 * timeout.count());                              // one deadline for the whole finalize()
  CHECK_THAT(message, Catch::Contains("allreduce #1 (sum, f32 x 100)"));  // the first bucket that did not complete
  CHECK_THAT(message, Catch::Contains("400 ms timeout"));
  CHECK_THAT(message, Catch::Matches(".*waited [0-9]+ ms.*"));
  CHECK_THAT(message, Catch::Contains("3 other"));  // and says the other buckets were pending too
  CHECK_THAT(message, !Catch::Contains("within 0 ms"));
}
