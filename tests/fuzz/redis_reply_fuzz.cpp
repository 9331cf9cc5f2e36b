// Fuzz target: what the Redis store decodes from the server (stores/redis_store.hpp). The input
// is the byte stream a server sent; hiredis's parser (configured as the store configures it)
// turns it into replies, and each reply goes through every decoder of the store: error replies,
// GET of a value (framed bytes), GET of a counter (decimal text), SCAN pages, integer replies.
//
// Properties: whatever the server sends, the store gets a value, nothing, or a
// communication_error: no crash, no UB, no huge allocation (hiredis allocates an array's element
// vector from the announced count before reading the elements). Decoded values round-trip
// through the encoder; counters are what Redis itself accepts as integers (canonical decimal);
// SCAN keys are keys of the store under the prefix asked for.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <hiredis/hiredis.h>

#include <ddp/error.hpp>
#include <ddp/stores/codec.hpp>
#include <ddp/stores/redis_store.hpp>

#include "fuzz_check.hpp"

namespace st = ddp::stores::detail;

namespace {

const std::string where = "redis fuzz:0";

void decode_every_way(const redisReply& r) {
  try {
    st::throw_if_error_reply(r, "fuzz", where);
  } catch (const ddp::communication_error&) {
    return;  // command() throws here: nothing else sees an error reply
  }
  for (const std::size_t limit : {std::size_t{100}, ddp::default_max_value_bytes}) {
    try {
      const std::optional<ddp::store_value> v = st::decode_get_reply(r, "job/key", limit, where);
      if (v) {
        FUZZ_CHECK(r.type == REDIS_REPLY_STRING && v->size() <= limit);
        FUZZ_CHECK(
            fuzz::same_bytes(st::encode_frame(*v), fuzz::bytes(reinterpret_cast<const std::uint8_t*>(r.str), r.len)));
      } else {
        FUZZ_CHECK(r.type == REDIS_REPLY_NIL);
      }
    } catch (const ddp::communication_error&) {
    }
  }
  try {
    const std::int64_t c = st::decode_counter_reply(r, "fuzz", where);
    if (r.type != REDIS_REPLY_NIL) FUZZ_CHECK(std::to_string(c) == std::string(r.str, r.len));
  } catch (const ddp::communication_error&) {
  }
  try {
    const st::scan_page page = st::decode_scan_reply(r, "job/", where);
    FUZZ_CHECK(!page.cursor.empty() &&
               std::all_of(page.cursor.begin(), page.cursor.end(), [](char c) { return c >= '0' && c <= '9'; }));
    for (const auto& k : page.keys) {
      FUZZ_CHECK(k.starts_with("v:job/") || k.starts_with("c:job/"));
      FUZZ_CHECK(st::is_valid_key(std::string_view(k).substr(2)));
    }
  } catch (const ddp::communication_error&) {
  }
  try {
    st::expect_reply(r, REDIS_REPLY_INTEGER, "fuzz", where);
  } catch (const ddp::communication_error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  redisReader* reader = redisReaderCreate();
  FUZZ_CHECK(reader != nullptr);
  st::cap_reply_arrays(*reader);  // as redis_store configures its connection's reader
  redisReaderFeed(reader, reinterpret_cast<const char*>(data), size);
  for (int i = 0; i < 64; ++i) {
    void* reply = nullptr;
    if (redisReaderGetReply(reader, &reply) != REDIS_OK || reply == nullptr) break;
    decode_every_way(*static_cast<const redisReply*>(reply));
    freeReplyObject(reply);
  }
  redisReaderFree(reader);
  return 0;
}
