// Fuzz target: the records a Manager reads back from the store (ddp/manager/record.hpp): the
// quorum record under "current" (written by the last quorum's rank 0) and the heartbeats under
// "hb/<id>". The input is the stored text, decoded as both.
//
// Properties: a malformed record is a communication_error (not a usage_error, a crash or UB); a
// record that decodes is one a Manager could have written (generation >= 1 and below the
// maximum, so that the next generation does not wrap to 0; join count >= 0; at least one member;
// valid ids), and decode(encode(record)) == record. A heartbeat decodes to a time >= 0 whose
// decimal form is the text.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include <ddp/error.hpp>
#include <ddp/manager/record.hpp>

#include "fuzz_check.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto text = fuzz::text(data, size);

  try {
    const ddp::detail::quorum_record q = ddp::detail::decode_quorum_record(text, 0);
    FUZZ_CHECK(q.generation >= 1 && q.generation < std::numeric_limits<std::uint64_t>::max());
    FUZZ_CHECK(q.joins >= 0);
    FUZZ_CHECK(!q.members.empty());
    for (const auto& id : q.members) FUZZ_CHECK(ddp::stores::detail::is_valid_key(id));
    FUZZ_CHECK(ddp::detail::decode_quorum_record(ddp::detail::encode_quorum_record(q), 0) == q);
  } catch (const ddp::communication_error&) {
  }

  const std::optional<std::int64_t> t = ddp::detail::decode_heartbeat(text);
  if (t) {
    FUZZ_CHECK(*t >= 0);
    FUZZ_CHECK(std::to_string(*t) == text);
  }
  return 0;
}
