#include <array>
#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/checked.hpp>
#include <ddp/local/communicator.hpp>

#include "../common/collective_suite.hpp"

using namespace std::chrono_literals;

TEST_CASE("local: the backend-generic collective suite", "[local]") {
  for (int n : {1, 2, 3, 4}) {
    INFO("ranks " << n);
    REQUIRE_NOTHROW(ddp::local::run(n, [](ddp::local::communicator& c) { suite::run_all(c); }));
  }
}

TEST_CASE("local: allreduce larger than 64 MiB", "[local][large]") {
  REQUIRE_NOTHROW(ddp::local::run(2, [](ddp::local::communicator& c) { suite::large_allreduce(c); }));
}

TEST_CASE("local: single-tensor allreduce and broadcast through a const communicator_ref", "[local]") {
  std::array<std::atomic<double>, 2> got{};
  ddp::local::run(2, [&](ddp::local::communicator& c) {
    const ddp::communicator_ref ref = c;  // the const forms of ddp::single_tensor_calls
    std::vector<double> v(3, c.rank() + 1.0);
    ref.allreduce(v, ddp::reduce_op::sum).wait();  // 1 + 2
    ddp::tensor_view t = ddp::view(v);
    if (c.rank() == 1) v[0] = 10.0;
    ref.broadcast(t, 1).wait();
    got[static_cast<std::size_t>(c.rank())] = v[0] + v[1];
  });
  CHECK(got[0] == 13.0);
  CHECK(got[1] == 13.0);
}

TEST_CASE("local: mismatched collectives fail on every rank, naming each call", "[local]") {
  std::atomic<int> mismatches{0};
  ddp::local::run(2, [&](ddp::local::communicator& c) {
    std::vector<std::int64_t> v(4, 1);
    try {
      if (c.rank() == 0) {
        c.allreduce(std::span<const ddp::tensor_view>(std::array{ddp::view(v)}), ddp::reduce_op::sum).wait();
      } else {
        c.barrier().wait();
      }
    } catch (const ddp::mismatch_error& e) {
      const std::string what = e.what();
      if (what.find("rank 0 called allreduce #0 (sum, i64 x 4)") != std::string::npos &&
          what.find("rank 1 called barrier #0") != std::string::npos) {
        ++mismatches;
      }
    }
  });
  CHECK(mismatches == 2);
}

TEST_CASE("local: dtype or count mismatch is detected", "[local]") {
  std::atomic<int> mismatches{0};
  ddp::local::run(3, [&](ddp::local::communicator& c) {
    std::vector<float> f(c.rank() == 2 ? 5 : 4);
    try {
      ddp::communicator_ref(c).allreduce(f, ddp::reduce_op::sum).wait();
    } catch (const ddp::mismatch_error&) {
      ++mismatches;
    }
  });
  CHECK(mismatches == 3);
}

TEST_CASE("local: a rank that stops calling makes the others time out, not hang", "[local]") {
  std::atomic<int> timeouts{0};
  ddp::local::options opts;
  opts.timeout = 200ms;
  const auto start = std::chrono::steady_clock::now();
  ddp::local::run(
      2,
      [&](ddp::local::communicator& c) {
        if (c.rank() == 1) return;  // ran out of data, no join
        std::vector<float> v(3);
        try {
          ddp::communicator_ref(c).allreduce(v, ddp::reduce_op::sum).wait();
        } catch (const ddp::timeout_error& e) {
          if (std::string(e.what()).find("allreduce #0") != std::string::npos) ++timeouts;
        }
      },
      opts);
  CHECK(timeouts == 1);
  CHECK(std::chrono::steady_clock::now() - start < 5s);
}

TEST_CASE("local: injected failure reaches every peer as communication_error", "[local][fault]") {
  ddp::local::options opts;
  opts.timeout = 5s;
  opts.faults = {ddp::local::fault::fail_at(1, 2)};
  std::atomic<int> failed_ranks{0};
  std::atomic<int> named_peer{0};
  ddp::local::run(
      3,
      [&](ddp::local::communicator& c) {
        std::vector<float> v(10, 1.0f);
        try {
          for (int step = 0; step < 5; ++step) ddp::communicator_ref(c).allreduce(v, ddp::reduce_op::sum).wait();
        } catch (const ddp::communication_error& e) {
          ++failed_ranks;
          if (c.rank() != 1 && std::string(e.what()).find("rank 1 failed") != std::string::npos) ++named_peer;
        }
      },
      opts);
  CHECK(failed_ranks == 3);
  CHECK(named_peer == 2);
}

TEST_CASE("local: delay and leave faults", "[local][fault]") {
  ddp::local::options opts;
  opts.timeout = 300ms;
  opts.faults = {ddp::local::fault::delay_at(0, 0, 50ms), ddp::local::fault::leave_at(1, 1)};
  std::atomic<int> first_ok{0}, second_timeout{0};
  ddp::local::run(
      2,
      [&](ddp::local::communicator& c) {
        std::vector<float> v(1, 1.0f);
        ddp::communicator_ref(c).allreduce(v, ddp::reduce_op::sum).wait();
        if (v[0] == 2.0f) ++first_ok;
        try {
          ddp::communicator_ref(c).allreduce(v, ddp::reduce_op::sum).wait();
        } catch (const ddp::timeout_error&) {
          ++second_timeout;
        }
      },
      opts);
  CHECK(first_ok == 2);
  CHECK(second_timeout == 1);
}

TEST_CASE("local: abort fails pending work and forbids further use", "[local][fault]") {
  std::atomic<int> peer_error{0}, use_after_abort{0};
  ddp::local::options opts;
  opts.timeout = 5s;
  ddp::local::run(
      2,
      [&](ddp::local::communicator& c) {
        std::vector<float> v(4, 1.0f);
        ddp::communicator_ref ref(c);
        if (c.rank() == 0) {
          auto w = ref.allreduce(v, ddp::reduce_op::sum);  // rank 1 never joins this one
          try {
            w.wait();
          } catch (const ddp::communication_error& e) {
            if (std::string(e.what()).find("rank 1 aborted") != std::string::npos) ++peer_error;
          }
        } else {
          std::this_thread::sleep_for(20ms);
          c.abort();
          try {
            (void)ref.allreduce(v, ddp::reduce_op::sum);
          } catch (const ddp::usage_error& e) {
            if (std::string(e.what()).find("after abort") != std::string::npos) ++use_after_abort;
          }
        }
      },
      opts);
  CHECK(peer_error == 1);
  CHECK(use_after_abort == 1);
}

TEST_CASE("issue #13 (9): checked mode names its own fingerprint exchange, not an internal allgather",
          "[local][fault][checked]") {
  // Rank 1 dies in its third call on the wrapped communicator: the fingerprint allgather of the
  // caller's second allreduce (#1). Neither rank may report "allgather #2", which it never issued.
  ddp::local::options opts;
  opts.timeout = 5s;
  opts.faults = {ddp::local::fault::fail_at(1, 2)};
  std::array<std::string, 2> errors;
  ddp::local::run(
      2,
      [&](ddp::local::communicator& c) {
        ddp::checked_communicator checked(c);
        std::vector<float> v(4, 1.0f);
        try {
          for (int k = 0; k < 3; ++k) {
            checked.allreduce(std::span<const ddp::tensor_view>(std::array{ddp::view(v)}), ddp::reduce_op::sum).wait();
          }
        } catch (const ddp::communication_error& e) {
          errors[static_cast<std::size_t>(c.rank())] = e.what();
        }
      },
      opts);
  for (const std::string& e : errors) {
    INFO(e);
    CHECK(e.find("ddp checked-mode fingerprint exchange before allreduce #1 (sum, f32 x 4)") != std::string::npos);
    CHECK(e.find("allgather") == std::string::npos);
  }
  CHECK(errors[1].find("injected failure") != std::string::npos);
}
