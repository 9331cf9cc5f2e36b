// Fuzz target: `enroll` (stores/membership.hpp) over a store holding whatever other
// processes, dead ones or garbage, left in the group's namespace. Input layout:
//   bytes 0-7   arrivals already counted in `members/arrivals` (int64, little endian)
//   byte  8     max_members - 1 (mod 4)
//   bytes 9-    the value of `members/closed` (not set if empty)
// The store is a memory_store; every wait has a zero timeout, so nothing blocks.
//
// Properties: enroll either admits this process, at a rank whose id is this process's, or
// fails with a communication_error (timeout_error included): no crash, UB or other exception.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <ddp/error.hpp>
#include <ddp/store.hpp>
#include <ddp/stores/codec.hpp>
#include <ddp/stores/membership.hpp>
#include <ddp/stores/memory_store.hpp>

#include "fuzz_check.hpp"

using namespace std::chrono_literals;
namespace st = ddp::stores;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 9) return 0;
  const auto arrived_before = static_cast<std::int64_t>(st::detail::get_u64(reinterpret_cast<const std::byte*>(data)));
  const int max_members = 1 + data[8] % 4;
  const std::string_view closed = fuzz::text(data + 9, size - 9);

  st::memory_store s;
  s.add("members/arrivals", arrived_before);
  if (!closed.empty()) s.set("members/closed", ddp::as_bytes(closed));
  try {
    const st::membership m =
        st::enroll(s, "fuzz-me", {.min_members = 1, .max_members = max_members, .settle = 0ms, .timeout = 0ms});
    FUZZ_CHECK(m.rank >= 0 && m.rank < m.size());
    FUZZ_CHECK(m.members[static_cast<std::size_t>(m.rank)] == "fuzz-me");
  } catch (const ddp::communication_error&) {
  }
  return 0;
}
