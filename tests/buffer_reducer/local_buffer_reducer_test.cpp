// BufferReducer over the local backend (ranks as threads), 1 to 4 ranks. The checks themselves
// live in buffer_reducer_suite.hpp and run unchanged over MPI (mpi_buffer_reducer_test.cpp).

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/buffer_reducer.hpp>
#include <ddp/local/communicator.hpp>
#include <ddp/strategies/allreduce.hpp>

#include "../common/ranks.hpp"
#include "buffer_reducer_suite.hpp"

/// A trainer's own tensor type: type-erased dtype, plugged in through ddp::tensor_traits.
namespace trainer {
struct Tensor {
  std::vector<std::byte> storage;
  ddp::dtype type;
  std::size_t numel;
  Tensor(ddp::dtype t, std::size_t n) : storage(n * ddp::size_of(t)), type(t), numel(n) {}
};
}  // namespace trainer

template <>
struct ddp::tensor_traits<trainer::Tensor> {
  static void* data(trainer::Tensor& t) { return t.storage.data(); }
  static std::size_t size(const trainer::Tensor& t) { return t.numel; }
  static ddp::dtype dtype(const trainer::Tensor& t) { return t.type; }
  static ddp::device device(const trainer::Tensor&) { return ddp::device::host(); }
};

using test_ranks::require_on_ranks;

TEST_CASE("local: counts allreduced and a running mean broadcast, in exactly 2 collectives",
          "[local][buffer_reducer]") {
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    std::array<std::atomic<int>, 4> issued{};
    std::array<std::int64_t, 4> positives{};
    std::array<float, 4> mean0{};
    REQUIRE_NOTHROW(ddp::local::run(n, [&](ddp::local::communicator& comm) {
      // example-begin quick-start
      std::vector<std::int64_t> seen{0, 0};  // positives, negatives seen by this rank
      std::vector<float> running_mean(16);
      ddp::BufferReducer buffers(comm);  // default strategy: broadcast from rank 0
      buffers.add(seen, ddp::strategies::allreduce_sum{});
      buffers.add(running_mean);
      buffers.build();
      // ... a step: this rank saw rank + 1 positive examples, and updated its running mean
      seen[0] += comm.rank() + 1;
      running_mean[0] = static_cast<float>(comm.rank());
      buffers.sync();  // every rank: global counts, rank 0's running mean
      // example-end quick-start
      const auto r = static_cast<std::size_t>(comm.rank());
      issued[r] = static_cast<int>(comm.issued()) - 1;  // minus build()'s layout check
      positives[r] = seen[0];
      mean0[r] = running_mean[0];
      if (buffers.stats().last_sync_collectives != 2) throw std::runtime_error("stats count differs");
    }));
    for (std::size_t r = 0; r < static_cast<std::size_t>(n); ++r) {
      CHECK(issued[r] == 2);
      CHECK(positives[r] == n * (n + 1) / 2);
      CHECK(mean0[r] == 0.0f);
    }
  }
  // and the full check, both paths
  require_on_ranks(1, 4, [](ddp::communicator_ref c) { br_suite::counts_and_running_mean(c, false); });
  require_on_ranks(1, 4, [](ddp::communicator_ref c) { br_suite::counts_and_running_mean(c, true); });
}

TEST_CASE("local: every strategy, every dtype, copy and view paths", "[local][buffer_reducer]") {
  require_on_ranks(1, 4, [](ddp::communicator_ref c) { br_suite::every_strategy(c); });
}

TEST_CASE("local: mixed strategies and dtypes coalesce into one collective per group", "[local][buffer_reducer]") {
  require_on_ranks(1, 4, [](ddp::communicator_ref c) { br_suite::mixed_groups(c); });
  require_on_ranks(1, 4, [](ddp::communicator_ref c) { br_suite::many_buffers_one_collective(c); });
}

TEST_CASE("local: 200 buffers in one group issue exactly one backend collective", "[local][buffer_reducer]") {
  std::atomic<int> wrong{0};
  ddp::local::run(3, [&](ddp::local::communicator& comm) {
    ddp::BufferReducer<ddp::strategies::allreduce_mean> buffers(comm);
    std::vector<std::vector<float>> bn(200);
    for (std::size_t k = 0; k < bn.size(); ++k) {
      bn[k].assign(64 + k, static_cast<float>(comm.rank()));
      buffers.add(bn[k]);
    }
    buffers.build();
    const auto before = comm.issued();
    buffers.sync();
    if (comm.issued() - before != 1) ++wrong;
    for (const auto& v : bn) {
      for (float x : v) {
        if (x != 1.0f) ++wrong;  // mean of 0, 1, 2
      }
    }
  });
  CHECK(wrong == 0);
}

TEST_CASE("local: period", "[local][buffer_reducer]") {
  require_on_ranks(1, 4, [](ddp::communicator_ref c) { br_suite::period(c); });
}

TEST_CASE("local: views and copies", "[local][buffer_reducer]") {
  require_on_ranks(1, 4, [](ddp::communicator_ref c) { br_suite::views_and_copies(c); });
}

TEST_CASE("local: non-blocking sync", "[local][buffer_reducer]") {
  require_on_ranks(1, 4, [](ddp::communicator_ref c) { br_suite::async_sync(c); });
}

TEST_CASE("local: a dropped pending sync frees the reducer for the next one", "[local][buffer_reducer]") {
  REQUIRE_NOTHROW(ddp::local::run(1, [](ddp::local::communicator& comm) {
    ddp::BufferReducer<ddp::strategies::allreduce_sum> buffers(comm);
    std::vector<float> a(4, 1.0f), b(4, 1.0f);
    buffers.add(a);
    buffers.add(b);
    { [[maybe_unused]] ddp::work dropped = buffers.sync_async(); }
    buffers.sync();
  }));
}

TEST_CASE("local: custom strategies", "[local][buffer_reducer]") {
  require_on_ranks(1, 4, [](ddp::communicator_ref c) { br_suite::custom_strategies(c); });
}

TEST_CASE("local: usage errors name the buffer and the rank", "[local][buffer_reducer]") {
  require_on_ranks(1, 4, [](ddp::communicator_ref c) { br_suite::local_errors(c); });
  require_on_ranks(2, 4, [](ddp::communicator_ref c) { br_suite::layout_mismatch(c); });
}

TEST_CASE("local: issue #13 (7): handle buffers are held by value, never as references", "[local][buffer_reducer]") {
  require_on_ranks(1, 4, [](ddp::communicator_ref c) { br_suite::handles_by_value(c); });
}

TEST_CASE("local: join hooks mirror every strategy with neutral data", "[local][buffer_reducer][join]") {
  require_on_ranks(2, 4, [](ddp::communicator_ref c) { br_suite::join_every_strategy(c); });
}

TEST_CASE("local: join hooks follow the period and restore its phase", "[local][buffer_reducer][join]") {
  require_on_ranks(2, 4, [](ddp::communicator_ref c) { br_suite::join_with_period(c); });
}

TEST_CASE("local: a joined rank that mirrors nothing makes the training ranks time out, not hang",
          "[local][buffer_reducer][join]") {
  using namespace std::chrono_literals;
  ddp::local::options opts;
  opts.timeout = 300ms;
  std::atomic<int> timeouts{0};
  ddp::local::run(
      2,
      [&](ddp::local::communicator& comm) {
        ddp::BufferReducer<ddp::strategies::allreduce_sum> buffers(comm);
        std::vector<float> a(3);
        buffers.add(a);
        buffers.build();
        if (comm.rank() == 1) return;  // ran out of data, and nobody runs its join hook
        try {
          buffers.sync();
        } catch (const ddp::timeout_error&) {
          ++timeouts;
        }
      },
      opts);
  CHECK(timeouts == 1);
}

TEST_CASE("local: issue #13 (8): BatchNorm statistics keep their scale while ranks join",
          "[local][buffer_reducer][join]") {
  require_on_ranks(2, 4, [](ddp::communicator_ref c) { br_suite::join_batchnorm_statistics(c); });
}

TEST_CASE("local: with the JoinContext, uneven inputs, periods 1 to 3", "[local][buffer_reducer][join]") {
  for (std::uint64_t period : {1u, 2u, 3u}) {
    INFO("period " << period);
    require_on_ranks(2, 4, [period](ddp::communicator_ref c) { br_suite::join_context_uneven(c, period); });
  }
}

TEST_CASE("local: buffers of the trainer's own tensor type, mixed dtypes", "[local][buffer_reducer]") {
  require_on_ranks(1, 4, [](ddp::communicator_ref comm) {
    ddp::BufferReducer<ddp::strategies::allreduce_sum> buffers(comm);
    std::vector<trainer::Tensor> tensors;
    tensors.reserve(4);  // the reducer keeps references to them
    for (ddp::dtype t : {ddp::dtype::f64, ddp::dtype::i32, ddp::dtype::f64, ddp::dtype::bf16}) {
      tensors.emplace_back(t, 11);
      buffers.add(tensors.back());
      br_suite::fill(ddp::view(tensors.back()), comm.rank());
    }
    buffers.sync();
    SUITE_EXPECT(buffers.stats().groups == 3 && buffers.stats().last_sync_collectives == 3, buffers.stats());
    for (auto& t : tensors) {
      for (std::size_t i = 0; i < t.numel; ++i) {
        br_suite::expect_close(
            br_suite::get(ddp::view(t), i),
            br_suite::expected_over(ddp::reduce_op::sum, t.type, br_suite::all_ranks(comm.size()), i, comm.size()),
            t.type, "trainer tensor");
      }
    }
  });
}

TEST_CASE("local: a peer that leaves costs sync() one timeout for all groups, and the error says what and how long",
          "[local][buffer_reducer][timeout]") {
  // Three groups (three dtypes), so one sync is three collectives; rank 1 leaves at the first
  // (its collective number 1, after build()'s fingerprint allgather).
  using namespace std::chrono_literals;
  constexpr auto timeout = 400ms;
  ddp::local::options opts;
  opts.timeout = timeout;
  opts.faults = {ddp::local::fault::leave_at(1, 1)};
  std::string message;
  double elapsed_ms = -1;
  std::array<std::size_t, 2> collectives{};  // checked after run(): Catch2's macros are not thread-safe
  ddp::local::run(
      2,
      [&](ddp::local::communicator& comm) {
        ddp::BufferReducer<ddp::strategies::allreduce_sum> buffers(comm);
        std::vector<float> a(5, 1.0f);
        std::vector<double> b(6, 1.0);
        std::vector<std::int32_t> c(7, 1);
        buffers.add(a);
        buffers.add(b);
        buffers.add(c);
        buffers.build();
        collectives[static_cast<std::size_t>(comm.rank())] = buffers.stats().collectives_per_sync;
        const auto start = std::chrono::steady_clock::now();
        try {
          buffers.sync();  // rank 1 leaves in here
        } catch (const ddp::timeout_error& e) {
          elapsed_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
          message = e.what();
        }
      },
      opts);
  INFO(message);
  CHECK(collectives == std::array<std::size_t, 2>{3, 3});
  REQUIRE(elapsed_ms >= 0);
  CHECK(elapsed_ms >= 0.95 * 400);
  CHECK(elapsed_ms < 2.5 * 400);  // the communicator's timeout, not work::all's 5-minute default
  CHECK_THAT(message, Catch::Contains("allreduce #1"));
  CHECK_THAT(message, Catch::Contains("400 ms timeout"));
  CHECK_THAT(message, Catch::Matches(".*waited [0-9]+ ms.*"));
}
