#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/local/communicator.hpp>

#include "../../common/ranks.hpp"
#include "join_cases.hpp"

using namespace std::chrono_literals;

using test_ranks::on_ranks;
using test_ranks::require_on_ranks;

namespace {
// Runs one uneven-input configuration on n ranks; returns each rank's error text ("" = finished).
std::vector<std::string> run_case(int n, join_cases::train_options o, bool checked) {
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  on_ranks(
      n,
      [&](ddp::communicator_ref c) {
        ddp::checked_communicator chk(c, {.timeout = 400ms});
        try {
          if (checked) {
            (void)join_cases::train(chk, o);
          } else {
            (void)join_cases::train(c, o);
          }
        } catch (const ddp::error& e) {
          errors[static_cast<std::size_t>(c.rank())] = e.what();
        }
      },
      400ms);
  return errors;
}
}  // namespace

TEST_CASE("JoinContext over local ranks", "[local][join]") {
  require_on_ranks(1, 4, [](ddp::communicator_ref c) { join_cases::run_all(c); });
}

TEST_CASE("JoinContext: a Bucketer and a BufferReducer in one context, in both registration orders",
          "[local][join][order]") {
  require_on_ranks(1, 4, [](ddp::communicator_ref c) { join_cases::bucketer_and_buffers(c); });
}

TEST_CASE("JoinContext: the issue order learned survives an iteration in which one joinable is silent",
          "[local][join][order]") {
  require_on_ranks(1, 4, [](ddp::communicator_ref c) { join_cases::order_learned_across_no_sync(c); });
}

TEST_CASE("JoinContext: training ranks that issue their joinables in different orders get mismatch_error",
          "[local][join][order]") {
  require_on_ranks(2, 4, [](ddp::communicator_ref c) { join_cases::order_disagreement(c); });
}

TEST_CASE("JoinContext: a rank without data shadows round 0 in the hinted order", "[local][join][order]") {
  require_on_ranks(1, 4, [](ddp::communicator_ref c) { join_cases::rank_without_data(c); });
}

TEST_CASE("JoinContext: what the context learns about the issue order", "[local][join][order]") {
  require_on_ranks(1, 3, [](ddp::communicator_ref c) { join_cases::learned_order(c); });
}

TEST_CASE("JoinContext: a wrong round-0 guess is an error on every rank, not a hang", "[local][join][order]") {
  // Rank 0 has no data and the buffers sync after backward: the hinted order (buffers first) is
  // wrong for round 0, and nothing has been observed yet.
  for (int n : {2, 3}) {
    INFO("ranks " << n);
    std::vector<std::string> errors(static_cast<std::size_t>(n));
    const auto start = std::chrono::steady_clock::now();
    on_ranks(
        n,
        [&](ddp::communicator_ref c) {
          join_cases::loop_shape shape;
          shape.sync_after_backward = true;
          shape.base_batches = 0;
          try {
            (void)join_cases::train_with_buffers(c, shape);
          } catch (const ddp::error& e) {
            errors[static_cast<std::size_t>(c.rank())] = e.what();
          }
        },
        1s);
    CHECK(std::chrono::steady_clock::now() - start < 10s);
    for (const auto& e : errors) {
      INFO(e);
      CHECK(e.find("different collectives") != std::string::npos);
    }
  }
}

TEST_CASE("JoinContext works through the checked communicator too", "[local][join]") {
  REQUIRE_NOTHROW(on_ranks(3, [](ddp::communicator_ref c) {
    ddp::checked_communicator chk(c);
    join_cases::join_uneven_inputs(chk);
  }));
}

TEST_CASE("uneven inputs, case 4: a barrier inside the join loop is a mismatch on every rank",
          "[local][join][seed004]") {
  for (int n : {2, 3}) {
    for (bool checked : {true, false}) {
      INFO("ranks " << n << (checked ? " checked" : " local backend's own check"));
      join_cases::train_options o;
      o.barrier_in_loop = true;
      const auto start = std::chrono::steady_clock::now();
      const auto errors = run_case(n, o, checked);
      CHECK(std::chrono::steady_clock::now() - start < 10s);
      for (const auto& e : errors) {
        INFO(e);
        CHECK(e.find("different collectives") != std::string::npos);
        CHECK(e.find("barrier") != std::string::npos);
        CHECK(e.find("allreduce") != std::string::npos);
      }
    }
  }
}

TEST_CASE("uneven inputs, cases 2, 3, 5: without join, fail clearly instead of hanging", "[local][join][seed004]") {
  for (int n : {2, 3}) {
    for (int c : {2, 3, 5}) {
      INFO("ranks " << n << ", case " << c);
      join_cases::train_options o;
      o.use_join = false;
      o.barrier_in_loop = c == 3;
      o.barrier_after = c == 5;
      const auto start = std::chrono::steady_clock::now();
      const auto errors = run_case(n, o, true);
      CHECK(std::chrono::steady_clock::now() - start < 10s);
      // The rank with the most data is left waiting: it must get an error naming the pending call.
      const std::string& last = errors.back();
      INFO(last);
      CHECK(
          (last.find("did not reach") != std::string::npos || last.find("different collectives") != std::string::npos));
      CHECK((last.find("allreduce") != std::string::npos || last.find("barrier") != std::string::npos));
    }
  }
}

TEST_CASE("JoinContext: forgetting finish() is a clear error", "[local][join]") {
  // Exercised in a child process by join_forgotten_finish (see CMakeLists): here only the
  // non-fatal paths: abandon() and exceptions in flight do not terminate.
  REQUIRE_NOTHROW(on_ranks(2, [](ddp::communicator_ref c) {
    std::vector<float> g(2);
    ddp::Bucketer b(c);
    b.add(g);
    ddp::JoinContext join({}, b);
    join.notify();
    join.abandon();
  }));
  CHECK_THROWS_AS(on_ranks(1,
                           [](ddp::communicator_ref c) {
                             std::vector<float> g(2);
                             ddp::Bucketer b(c);
                             b.add(g);
                             ddp::JoinContext join({}, b);
                             join.notify();
                             throw std::runtime_error("trainer failed");
                           }),
                  std::runtime_error);
}

TEST_CASE("JoinContext: joinables on different communicators are rejected", "[local][join]") {
  REQUIRE_NOTHROW(on_ranks(1, [](ddp::communicator_ref c) {
    ddp::checked_communicator other(c);
    std::vector<float> g1(2), g2(2);
    ddp::Bucketer a(c), b(other);
    a.add(g1);
    b.add(g2);
    bool threw = false;
    try {
      ddp::JoinContext join({}, a, b);
    } catch (const ddp::usage_error& e) {
      threw = std::string(e.what()).find("same communicator") != std::string::npos;
    }
    SUITE_EXPECT(threw, "different communicators must be rejected");
  }));
}
