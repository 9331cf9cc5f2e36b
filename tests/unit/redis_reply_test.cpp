// What the Redis store decodes from the server, without a server: byte streams go through
// hiredis's parser, configured as the store configures it, then through the store's decoders.
// Each case named "(fuzz: redis_reply)" guards a bug that fuzz target found (tests/fuzz,
// docs/fuzzing.md).

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <hiredis/hiredis.h>

#include <catch2/catch.hpp>
#include <ddp/error.hpp>
#include <ddp/stores/codec.hpp>
#include <ddp/stores/redis_store.hpp>

namespace st = ddp::stores::detail;

namespace {

struct reply_deleter {
  void operator()(redisReply* r) const noexcept { freeReplyObject(r); }
};
using reply_ptr = std::unique_ptr<redisReply, reply_deleter>;

// The first reply parsed from `wire`, or nothing if the parser refused it (reader error).
std::optional<reply_ptr> parse(const std::string& wire) {
  std::unique_ptr<redisReader, decltype(&redisReaderFree)> reader(redisReaderCreate(), &redisReaderFree);
  REQUIRE(reader);
  st::cap_reply_arrays(*reader);
  REQUIRE(redisReaderFeed(reader.get(), wire.data(), wire.size()) == REDIS_OK);
  void* out = nullptr;
  if (redisReaderGetReply(reader.get(), &out) != REDIS_OK) return std::nullopt;
  REQUIRE(out != nullptr);
  return reply_ptr(static_cast<redisReply*>(out));
}

std::string bulk(const std::string& s) { return "$" + std::to_string(s.size()) + "\r\n" + s + "\r\n"; }

const std::string where = "redis test:0";

template <class F>
bool throws_communication_error(F&& f) {
  try {
    f();
  } catch (const ddp::communication_error&) {
    return true;
  }
  return false;
}

}  // namespace

TEST_CASE("redis replies: counters are what Redis accepts as integers (fuzz: redis_reply)", "[store][redis_reply]") {
  // Before: std::stoll also took " 5", "+5" and "05", which INCRBY on the server refuses.
  const auto counter = [](const std::string& text) {
    auto r = parse(bulk(text));
    REQUIRE(r);
    return st::decode_counter_reply(**r, "test", where);
  };
  CHECK(counter("42") == 42);
  CHECK(counter("-7") == -7);
  CHECK(counter("-9223372036854775808") == INT64_MIN);
  for (const char* bad : {" 5", "+5", "05", "-0", "5 ", "", "9223372036854775808", "x"}) {
    INFO("'" << bad << "'");
    CHECK(throws_communication_error([&] { (void)counter(bad); }));
  }
  auto nil = parse("$-1\r\n");
  REQUIRE(nil);
  CHECK(st::decode_counter_reply(**nil, "test", where) == 0);
}

TEST_CASE("redis replies: SCAN pages hold only the store's keys under the prefix (fuzz: redis_reply)",
          "[store][redis_reply]") {
  // Before: any element was taken as a key to DEL: an integer or nil element became the empty
  // key, and keys outside the prefix (or not the store's) were deleted too.
  const auto page = [](const std::string& cursor, const std::string& keys_wire, int n) {
    return "*2\r\n" + bulk(cursor) + "*" + std::to_string(n) + "\r\n" + keys_wire;
  };
  auto good = parse(page("17", bulk("v:job/a") + bulk("c:job/n"), 2));
  REQUIRE(good);
  const auto p = st::decode_scan_reply(**good, "job/", where);
  CHECK(p.cursor == "17");
  CHECK(p.keys == std::vector<std::string>{"v:job/a", "c:job/n"});
  for (const auto& bad :
       {page("0", ":5\r\n", 1), page("0", "$-1\r\n", 1), page("0", "*0\r\n", 1), page("0", bulk("v:other/a"), 1),
        page("0", bulk("x:job/a"), 1), page("0", bulk("v:job/a b"), 1), page("zero", "", 0), page("", "", 0),
        std::string(":1\r\n"), std::string("*1\r\n:1\r\n")}) {
    INFO(bad);
    auto r = parse(bad);
    REQUIRE(r);
    CHECK(throws_communication_error([&] { (void)st::decode_scan_reply(**r, "job/", where); }));
  }
}

TEST_CASE("redis replies: an array announcing 2^31 elements allocates nothing (fuzz: redis_reply)",
          "[store][redis_reply]") {
  // Before: hiredis allocated the element vector from the announced count: 13 bytes from the
  // server cost 16 GB. Now the reader refuses (the store's command fails, the connection is dropped).
  CHECK_FALSE(parse("*2000000000\r\n").has_value());
  CHECK_FALSE(parse("*9223372036854775807\r\n").has_value());
  CHECK_FALSE(parse("*" + std::to_string(st::max_reply_elements + 1) + "\r\n").has_value());
  // Nested arrays count together.
  const std::string half = "*" + std::to_string(st::max_reply_elements / 2) + "\r\n";
  CHECK_FALSE(parse("*3\r\n" + half + half + half).has_value());
  // Within the cap: parsed (the elements have not arrived, so no reply yet, but no error either).
  std::unique_ptr<redisReader, decltype(&redisReaderFree)> reader(redisReaderCreate(), &redisReaderFree);
  st::cap_reply_arrays(*reader);
  const std::string ok = "*2\r\n:1\r\n:2\r\n";
  REQUIRE(redisReaderFeed(reader.get(), ok.data(), ok.size()) == REDIS_OK);
  void* out = nullptr;
  REQUIRE(redisReaderGetReply(reader.get(), &out) == REDIS_OK);
  REQUIRE(out != nullptr);
  CHECK(static_cast<redisReply*>(out)->elements == 2);
  freeReplyObject(out);
}

TEST_CASE("redis replies: values are framed bytes within the limit", "[store][redis_reply]") {
  const auto frame = st::encode_frame(ddp::as_bytes("payload"));
  auto r = parse(bulk(std::string(reinterpret_cast<const char*>(frame.data()), frame.size())));
  REQUIRE(r);
  const auto v = st::decode_get_reply(**r, "k", 100, where);
  REQUIRE(v);
  CHECK(ddp::to_text(*v) == "payload");
  CHECK(throws_communication_error([&] { (void)st::decode_get_reply(**r, "k", 3, where); }));
  auto nil = parse("$-1\r\n");
  REQUIRE(nil);
  CHECK_FALSE(st::decode_get_reply(**nil, "k", 100, where).has_value());
  auto integer = parse(":3\r\n");
  REQUIRE(integer);
  CHECK(throws_communication_error([&] { (void)st::decode_get_reply(**integer, "k", 100, where); }));
  auto error = parse("-ERR nope\r\n");
  REQUIRE(error);
  CHECK(throws_communication_error([&] { st::throw_if_error_reply(**error, "op", where); }));
}
