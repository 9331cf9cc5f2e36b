// Fuzz target: the words the members of a new quorum gather from each other
// (ddp/manager/exchange.hpp), which another process wrote: what the Manager decides from them.
// Input: byte 0 = member count - 1 (mod 8), byte 1 = which members belonged to the previous
// quorum (a bit each; 0 = the job's start), 8 bytes of the store's step limit, then
// `member_report::words` int64 words per member (little-endian; missing bytes are zeros).
//
// Properties: no crash or UB for any words; a refused member is a member, and a refusal leaves
// nothing else decided; otherwise every source is a member of the previous quorum that is up to
// date, at the plan's step, which no other such member exceeds and which is within the step
// limit, and every member shares the sources' layout, state size and participation rules;
// refusal_for gives each rank an error; the first-heal plan names one member.

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <ddp/manager/exchange.hpp>

#include "fuzz_check.hpp"

namespace {

std::int64_t le64(const std::uint8_t* data, std::size_t size, std::size_t at) {
  std::array<std::uint8_t, 8> b{};
  for (std::size_t i = 0; i < 8 && at + i < size; ++i) b[i] = data[at + i];
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < 8; ++i) v |= std::uint64_t{b[i]} << (8 * i);
  std::int64_t s = 0;
  std::memcpy(&s, &v, sizeof(s));
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using ddp::detail::member_report;
  if (size < 2) return 0;
  const std::size_t n = 1 + data[0] % 8;
  const std::int64_t latest_formed = data[1] % 16;
  const std::int64_t step_limit = le64(data, size, 2);
  std::vector<std::int64_t> all(n * member_report::words);
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = le64(data, size, 10 + 8 * i);
  std::vector<std::string> members;
  for (std::size_t r = 0; r < n; ++r) members.push_back("replica-" + std::to_string(r));
  const auto word = [&](std::size_t r, std::size_t k) { return all[r * member_report::words + k]; };
  // A member that completed the latest generation formed (none before any formed: then
  // first_heal_plan decides).
  const auto holds = [&](std::size_t r) { return latest_formed > 0 && word(r, 1) >= latest_formed; };

  const ddp::detail::heal_plan plan = ddp::detail::plan_heal(all, members, latest_formed, step_limit);
  for (const auto& [r, why] : plan.refused) {
    FUZZ_CHECK(r >= 0 && static_cast<std::size_t>(r) < n);
    FUZZ_CHECK(why.find(members[static_cast<std::size_t>(r)]) != std::string::npos);
  }
  if (!plan.refused.empty()) {
    FUZZ_CHECK(plan.sources.empty() && plan.step == -1);
    for (int rank = 0; rank < static_cast<int>(n); ++rank) {
      const auto refusal = ddp::detail::refusal_for(plan.refused, rank, 7);
      FUZZ_CHECK(refusal.error != nullptr);
    }
  } else {
    for (int s : plan.sources) {
      FUZZ_CHECK(s >= 0 && static_cast<std::size_t>(s) < n);
      const auto r = static_cast<std::size_t>(s);
      FUZZ_CHECK(holds(r) && word(r, 4) == 0);
      FUZZ_CHECK(word(r, 0) == plan.step && plan.step >= 0 && plan.step <= step_limit);
    }
    for (std::size_t r = 0; r < n; ++r) {
      FUZZ_CHECK(word(r, 2) == word(0, 2) && word(r, 3) == word(0, 3));  // nobody refused: one layout
      FUZZ_CHECK(word(r, 5) == word(0, 5));                              // and one set of participation rules
      FUZZ_CHECK(word(r, 0) >= 0 && word(r, 1) >= 0 && (word(r, 4) == 0 || word(r, 4) == 1));
      if (holds(r) && word(r, 4) == 0) FUZZ_CHECK(word(r, 0) <= plan.step);
    }
    if (plan.sources.empty()) FUZZ_CHECK(plan.step == -1);
  }
  const ddp::detail::heal_plan first = ddp::detail::first_heal_plan(all);
  FUZZ_CHECK(first.sources.size() == 1 && first.sources[0] >= 0 && static_cast<std::size_t>(first.sources[0]) < n);
  FUZZ_CHECK(first.sources[0] == 0 || word(static_cast<std::size_t>(first.sources[0]), 4) == 0);
  return 0;
}
