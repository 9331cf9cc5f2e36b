// Decoders of bytes other processes wrote to a store: frames and counters, the member list of a
// group, the Manager's quorum record and heartbeats, and what file_store does with directory
// entries that are not files. Each case named "(fuzz: <target>)" guards a bug that fuzz target
// found (tests/fuzz, docs/fuzzing.md); its input is also kept in that target's corpus.

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/error.hpp>
#include <ddp/manager/record.hpp>
#include <ddp/store.hpp>
#include <ddp/stores/codec.hpp>
#include <ddp/stores/file_store.hpp>
#include <ddp/stores/membership.hpp>
#include <ddp/stores/memory_store.hpp>

using namespace std::chrono_literals;
namespace st = ddp::stores;
namespace fs = std::filesystem;

namespace {

// What a call throws: "communication_error: <what>", "usage_error: ...", other, or "" if nothing.
template <class F>
std::string thrown_by(F&& f) {
  try {
    f();
  } catch (const ddp::communication_error& e) {
    return std::string("communication_error: ") + e.what();
  } catch (const ddp::usage_error& e) {
    return std::string("usage_error: ") + e.what();
  } catch (const std::exception& e) {
    return std::string("other: ") + e.what();
  }
  return "";
}
bool is_communication_error(const std::string& thrown) { return thrown.rfind("communication_error: ", 0) == 0; }

class temp_dir {
 public:
  temp_dir() {
    std::string pattern = (fs::temp_directory_path() / "ddp-codec-test-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  [[nodiscard]] const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

}  // namespace

// ---- frames and numbers -----------------------------------------------------------------------

TEST_CASE("store codec: a frame with non-zero reserved header bytes is rejected (fuzz: codec)", "[store][codec]") {
  // Before: bytes 5-7 were ignored, so two different byte strings decoded to the same value.
  auto frame = st::detail::encode_frame(ddp::as_bytes("payload"));
  CHECK(st::detail::decode_frame(frame, "k", 100, "test") == std::vector<std::byte>(frame.begin() + 24, frame.end()));
  for (int i : {5, 6, 7}) {
    auto bad = frame;
    bad[static_cast<std::size_t>(i)] = std::byte{0x4f};
    const auto what = thrown_by([&] { (void)st::detail::decode_frame(bad, "k", 100, "test"); });
    CHECK(is_communication_error(what));
    CHECK(what.find("reserved header bytes") != std::string::npos);
  }
}

TEST_CASE("store codec: numbers read back parse only in canonical decimal form", "[store][codec]") {
  using st::detail::parse_decimal;
  CHECK(parse_decimal<std::int64_t>("0") == 0);
  CHECK(parse_decimal<std::int64_t>("42") == 42);
  CHECK(parse_decimal<std::int64_t>("-7") == -7);
  CHECK(parse_decimal<std::int64_t>("9223372036854775807") == std::numeric_limits<std::int64_t>::max());
  CHECK(parse_decimal<std::int64_t>("-9223372036854775808") == std::numeric_limits<std::int64_t>::min());
  CHECK(parse_decimal<std::uint64_t>("18446744073709551615") == std::numeric_limits<std::uint64_t>::max());
  for (const char* bad : {"", "-", "+1", " 1", "1 ", "01", "-0", "-01", "1x", "0x10", "9223372036854775808",
                          "99999999999999999999", "1e3"}) {
    INFO("'" << bad << "'");
    CHECK_FALSE(parse_decimal<std::int64_t>(bad).has_value());
  }
  CHECK_FALSE(parse_decimal<std::uint64_t>("-1").has_value());
  CHECK_FALSE(parse_decimal<std::uint64_t>("18446744073709551616").has_value());
}

// ---- the member list of a group ---------------------------------------------------------------

TEST_CASE("membership: arrival numbers past int64 are malformed, not UB (fuzz: member_list)", "[store][membership]") {
  // Before: the digits were accumulated into an int64 without a check (signed overflow).
  const auto what = thrown_by([] { (void)st::detail::decode_members("99999999999999999999 a\n"); });
  CHECK(is_communication_error(what));
  CHECK(is_communication_error(thrown_by([] { (void)st::detail::decode_members("-1 a\n"); })));
  CHECK(is_communication_error(thrown_by([] { (void)st::detail::decode_members("01 a\n"); })));
}

TEST_CASE("membership: a bad id in the stored list is a communication_error (fuzz: member_list)",
          "[store][membership]") {
  // Before: usage_error, as if the caller had passed a bad id.
  for (const char* bad : {"0 a b\n", "0 \n", "0 a\xff\n", "0 a\r\n"}) {
    INFO(bad);
    CHECK(is_communication_error(thrown_by([&] { (void)st::detail::decode_members(bad); })));
  }
}

TEST_CASE("membership: an arrival listed twice is malformed (fuzz: member_list)", "[store][membership]") {
  // Before: accepted; the process with that arrival number took the later rank, and the group
  // had one member more than processes.
  const auto what = thrown_by([] { (void)st::detail::decode_members("0 a\n1 b\n0 c\n"); });
  CHECK(is_communication_error(what));
  CHECK(what.find("listed twice") != std::string::npos);
}

TEST_CASE("membership: decode(encode(list)) == list", "[store][membership]") {
  const std::vector<st::detail::arrival> list{{2, "host-a:0"}, {0, "b"}, {1, "c/1"}};
  CHECK(st::detail::decode_members(st::detail::encode_members(list)) == list);
  CHECK(st::detail::decode_members("").empty());
  for (const char* bad : {"0 a", "0\n", "x a\n", " a\n"}) {
    INFO(bad);
    CHECK(is_communication_error(thrown_by([&] { (void)st::detail::decode_members(bad); })));
  }
}

TEST_CASE("membership: a list naming another id at this arrival is refused (fuzz: enroll)", "[store][membership]") {
  // Before: the process was admitted at the rank of whoever the list named (a list left by an
  // earlier group in a reused namespace).
  st::memory_store s;
  s.add("members/arrivals", 1);  // one arrival before us: we are arrival 1
  s.set("members/closed", ddp::as_bytes(st::detail::encode_members({{0, "a"}, {1, "someone-else"}})));
  const auto what = thrown_by(
      [&] { (void)st::enroll(s, "me", {.min_members = 1, .max_members = 2, .settle = 0ms, .timeout = 0ms}); });
  CHECK(is_communication_error(what));
  CHECK(what.find("someone-else") != std::string::npos);
}

TEST_CASE("membership: a garbage arrival counter is a communication_error, not UB (fuzz: enroll)",
          "[store][membership]") {
  // Before: memory_store::add overflowed (signed) at INT64_MAX + 1, and enroll computed
  // INT64_MIN - 1 from a wrapped counter.
  st::memory_store s;
  s.add("members/arrivals", std::numeric_limits<std::int64_t>::max());
  const auto what = thrown_by(
      [&] { (void)st::enroll(s, "me", {.min_members = 1, .max_members = 1, .settle = 0ms, .timeout = 0ms}); });
  CHECK(is_communication_error(what));
  CHECK(what.find("arrival counter") != std::string::npos);
}

TEST_CASE("memory_store: counters wrap around like the file store's (fuzz: enroll)", "[store][membership]") {
  st::memory_store s;
  CHECK(s.add("c", std::numeric_limits<std::int64_t>::max()) == std::numeric_limits<std::int64_t>::max());
  CHECK(s.add("c", 1) == std::numeric_limits<std::int64_t>::min());
  CHECK(s.add("c", -1) == std::numeric_limits<std::int64_t>::max());
}

// ---- the Manager's records --------------------------------------------------------------------

TEST_CASE("manager records: heartbeats past int64 are no heartbeat, not UB (fuzz: manager_records)",
          "[store][manager]") {
  // Before: the digits were accumulated into an int64 without a check (signed overflow).
  using ddp::detail::decode_heartbeat;
  CHECK(decode_heartbeat("1700000000000") == std::int64_t{1700000000000});
  CHECK(decode_heartbeat("0") == 0);
  for (const char* bad : {"99999999999999999999", "", "-5", "12ms", " 12", "012"}) {
    INFO("'" << bad << "'");
    CHECK_FALSE(decode_heartbeat(bad).has_value());
  }
}

TEST_CASE("manager records: quorum records a Manager cannot write are malformed (fuzz: manager_records)",
          "[store][manager]") {
  // Before: "-1" parsed as generation 2^64-1 (the next generation wrapped to 0), negative join
  // counts and records without members were accepted, and a bad id was a usage_error.
  using ddp::detail::decode_quorum_record;
  for (const char* bad : {"-1 0 a", "18446744073709551615 0 a", "0 0 a", "1 -5 a", "1 0", "1 0 ", "1  0 a", "1 0 a  b",
                          "1 0 a\tb", "1 0 a b\n", "1 0 a\xff", "01 0 a", "x 0 a", ""}) {
    INFO("'" << bad << "'");
    CHECK(is_communication_error(thrown_by([&] { (void)decode_quorum_record(bad, 0); })));
  }
  const ddp::detail::quorum_record q{7, 3, {"replica-0", "host:1", "r/2"}};
  CHECK(ddp::detail::encode_quorum_record(q) == "7 3 replica-0 host:1 r/2");
  CHECK(decode_quorum_record(ddp::detail::encode_quorum_record(q), 0) == q);
}

TEST_CASE("manager records: pending joins never overflow, whatever the counter holds", "[store][manager]") {
  using ddp::detail::pending_joins;
  constexpr auto lo = std::numeric_limits<std::int64_t>::min();
  constexpr auto hi = std::numeric_limits<std::int64_t>::max();
  CHECK(pending_joins(5, 3) == 2);
  CHECK(pending_joins(3, 5) == 0);
  CHECK(pending_joins(hi, lo) == (1 << 20));
  CHECK(pending_joins(lo, hi) == 0);
  CHECK(pending_joins(hi, 0) == (1 << 20));
}

// ---- file_store: directory entries that are not files ------------------------------------------

TEST_CASE("file store: a FIFO under a key is an error, not a hang (fuzz: file_store)", "[store][file]") {
  // Before: open(2) of a FIFO without a writer blocked get and add forever.
  temp_dir dir;
  st::file_store s(dir.path());
  REQUIRE(::mkfifo((dir.path() / "v.job%key").c_str(), 0644) == 0);
  REQUIRE(::mkfifo((dir.path() / "c.job%count").c_str(), 0644) == 0);
  const auto t0 = std::chrono::steady_clock::now();
  const auto get_error = thrown_by([&] { (void)s.get("job/key"); });
  CHECK(is_communication_error(get_error));
  CHECK(get_error.find("not a regular file") != std::string::npos);
  CHECK(is_communication_error(thrown_by([&] { (void)s.add("job/count", 1); })));
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
}

TEST_CASE("file store: directories, devices and links under a key are errors", "[store][file]") {
  temp_dir dir;
  st::file_store s(dir.path());
  fs::create_directory(dir.path() / "v.dir");
  fs::create_symlink("/dev/zero", dir.path() / "v.zero");
  fs::create_symlink(dir.path() / "v.loop", dir.path() / "v.loop");
  fs::create_symlink(dir.path() / "nowhere", dir.path() / "v.dangling");
  for (const char* key : {"dir", "zero", "loop"}) {
    INFO(key);
    CHECK(is_communication_error(thrown_by([&] { (void)s.get(key); })));
  }
  CHECK(is_communication_error(thrown_by([&] { (void)s.get("dangling"); })));  // a link: refused
  s.set("dangling", ddp::as_bytes("now set"));                                 // rename replaces the link
  CHECK(ddp::to_text(*s.get("dangling")) == "now set");
}
