// Bucketer, BufferReducer and JoinContext over device memory (the emulated device) at 1-4
// thread ranks.
#include <catch2/catch.hpp>
#include <ddp/local/communicator.hpp>

#include "../common/ranks.hpp"
#include "device_cases.hpp"

using test_ranks::require_on_ranks;

TEST_CASE("device components over local ranks: Bucketer, BufferReducer, JoinContext", "[local][device]") {
  require_on_ranks(1, 4, [](ddp::communicator_ref c) { device_cases::run_all(c); });
}

TEST_CASE("device components over local ranks through the staged communicator (host copies behind gates)",
          "[local][device][staged]") {
  require_on_ranks(1, 4, [](ddp::communicator_ref c) { device_cases::run_all<device_cases::staged_rig>(c); });
}
