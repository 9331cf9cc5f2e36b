// Bucketer, BufferReducer and JoinContext over device memory (the emulated device) at 1-4
// thread ranks.
#include <chrono>

#include <catch2/catch.hpp>
#include <ddp/local/communicator.hpp>

#include "device_cases.hpp"

namespace {
template <class F>
void on_ranks(int n, F&& f) {
  ddp::local::options opts;
  opts.timeout = std::chrono::seconds(20);
  ddp::local::run(
      n, [&](ddp::local::communicator& c) { f(ddp::communicator_ref(c)); }, opts);
}
}  // namespace

TEST_CASE("device components over local ranks: Bucketer, BufferReducer, JoinContext", "[local][device]") {
  for (int n : {1, 2, 3, 4}) {
    INFO("ranks " << n);
    REQUIRE_NOTHROW(on_ranks(n, [](ddp::communicator_ref c) { device_cases::run_all(c); }));
  }
}
