// Fuzz target: the frame every stored value is wrapped in (stores/codec.hpp) and the counters
// stored in frames, as the file and Redis stores read them back. The input is the raw stored
// bytes.
//
// Properties: a malformed value is a communication_error, never a crash, another exception or a
// huge allocation; what decodes is within the limit and is exactly what encode_frame writes for
// its payload (decode(encode(x)) == x and the frame is canonical); any payload survives
// encode-then-decode.

#include <cstddef>
#include <cstdint>

#include <ddp/error.hpp>
#include <ddp/stores/codec.hpp>

#include "fuzz_check.hpp"

namespace st = ddp::stores::detail;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto raw = fuzz::bytes(data, size);

  // The stored bytes as a value, under several limits.
  for (const std::size_t limit : {std::size_t{0}, std::size_t{8}, std::size_t{100}, ddp::default_max_value_bytes}) {
    try {
      const ddp::store_value payload = st::decode_frame(raw, "fuzz/key", limit, "fuzz");
      FUZZ_CHECK(payload.size() <= limit);
      FUZZ_CHECK(fuzz::same_bytes(st::encode_frame(payload), raw));
    } catch (const ddp::communication_error&) {
      // malformed: the expected outcome for most inputs
    }
  }

  // The stored bytes as a counter.
  try {
    const std::int64_t v = st::decode_counter(raw, "fuzz/counter", "fuzz");
    FUZZ_CHECK(fuzz::same_bytes(st::encode_counter(v), raw));
  } catch (const ddp::communication_error&) {
  }

  // The input as a payload: framing it and reading it back gives it back.
  const auto framed = st::encode_frame(raw);
  FUZZ_CHECK(fuzz::same_bytes(st::decode_frame(framed, "fuzz/key", size, "fuzz"), raw));
  return 0;
}
