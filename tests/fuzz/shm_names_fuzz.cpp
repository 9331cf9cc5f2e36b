// Fuzz target: the records of the POSIX segment's set-up exchanges (shm/posix_segment.hpp), as
// peers send them over the wrapped communicator: the leader's segment name (first exchange) and
// every rank's step and errno (later ones). The input is the allgathered bytes: one 64-byte
// `posix_setup_record` per rank (1 to 16 ranks; a short last record is zero-filled).
//
// Properties: a record is accepted, or `check_setup_record` throws a communication_error naming
// its rank; an accepted name is one ddp creates ("/ddp-shm-" then hex digits and dashes, shorter
// than the record, so no path and no other object); `throw_first_failure` throws a usage_error,
// segment_error (with the errno the record carried) or communication_error exactly when some
// record reports a failure or is malformed.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <ddp/error.hpp>
#include <ddp/shm/posix_segment.hpp>
#include <ddp/shm/segment.hpp>

#include "fuzz_check.hpp"

namespace shm = ddp::shm;
namespace d = ddp::shm::detail;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::size_t rec = sizeof(d::posix_setup_record);
  if (size == 0 || size > 16 * rec) return 0;
  std::vector<d::posix_setup_record> records((size + rec - 1) / rec);
  std::memcpy(records.data(), data, size);

  bool any_bad = false, any_failed = false;
  for (std::size_t r = 0; r < records.size(); ++r) {
    const bool named = records[r].name[0] != '\0';
    any_failed = any_failed || records[r].failed != 0;
    try {
      const std::string name = d::check_setup_record(records[r], static_cast<int>(r), named, 0);
      FUZZ_CHECK(named == !name.empty());
      if (named) {
        FUZZ_CHECK(name.size() < sizeof(records[r].name) && name.rfind("/ddp-shm-", 0) == 0);
        FUZZ_CHECK(name.find('/', 1) == std::string::npos && name.find('.') == std::string::npos);
        FUZZ_CHECK(d::valid_segment_name(name));
      }
    } catch (const ddp::communication_error& e) {
      FUZZ_CHECK(std::string(e.what()).find("rank " + std::to_string(r)) != std::string::npos);
      // Only the name can be wrong where the step and errno are in range.
      any_bad = any_bad || records[r].failed < 0 || records[r].failed > shm::posix_segment::last_step ||
                records[r].error < 0 || records[r].error > 4095;
    }
  }
  bool threw = false;
  try {
    d::throw_first_failure(records, 0, 4096);
  } catch (const shm::segment_error& e) {
    threw = true;
    FUZZ_CHECK(e.errno_value() >= 0 && e.errno_value() <= 4095);
  } catch (const ddp::usage_error&) {
    threw = true;
  } catch (const ddp::communication_error&) {
    threw = true;
  }
  FUZZ_CHECK(threw == (any_bad || any_failed));
  return 0;
}
