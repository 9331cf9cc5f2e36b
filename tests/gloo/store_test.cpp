// Rendezvous stores: the contract of the concept over the file store and a real Redis server,
// hostile values, generation namespaces and group membership. Ranks are forked processes.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <set>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/store.hpp>
#include <ddp/stores/codec.hpp>
#include <ddp/stores/file_store.hpp>
#include <ddp/stores/membership.hpp>
#include <ddp/stores/prefix_store.hpp>
#if DDP_TEST_WITH_REDIS
#include <hiredis/hiredis.h>

#include <ddp/stores/redis_store.hpp>
#endif

#include "process_group.hpp"
#include "redis_server.hpp"

using namespace std::chrono_literals;
namespace st = ddp::stores;
using gloo_test::process_group;
using gloo_test::reporter;
using gloo_test::temp_dir;

namespace {

std::vector<std::byte> bytes_of(std::initializer_list<int> v) {
  std::vector<std::byte> out;
  for (int x : v) out.push_back(static_cast<std::byte>(x));
  return out;
}

std::string text_of(const std::optional<ddp::store_value>& v) { return v ? ddp::to_text(*v) : std::string("<none>"); }

template <class F>
std::string usage_error_of(F&& f) {
  try {
    f();
  } catch (const ddp::usage_error& e) {
    return e.what();
  }
  return "";
}
template <class F>
std::string communication_error_of(F&& f) {
  try {
    f();
  } catch (const ddp::usage_error&) {
    return "usage_error";
  } catch (const ddp::communication_error& e) {
    return e.what();
  }
  return "";
}

/// The contract of the store concept, on a fresh store.
template <class S>
void check_contract(S& s) {
  SECTION("set, get, overwrite, missing keys") {
    CHECK_FALSE(s.get("job/a").has_value());
    const auto bin = bytes_of({0, 1, 255, 0, 7});
    s.set("job/a", bin);
    CHECK(s.get("job/a") == bin);
    s.set("job/a", ddp::as_bytes("second"));
    CHECK(text_of(s.get("job/a")) == "second");
    s.set("job/empty", {});
    REQUIRE(s.get("job/empty").has_value());
    CHECK(s.get("job/empty")->empty());
  }
  SECTION("wait returns at once for set keys and times out naming the missing ones") {
    s.set("w/1", ddp::as_bytes("x"));
    s.set("w/2", ddp::as_bytes("y"));
    const std::vector<std::string> present{"w/1", "w/2", "w/1"};
    const auto t0 = std::chrono::steady_clock::now();
    s.wait(present, 1s);
    CHECK(std::chrono::steady_clock::now() - t0 < 500ms);
    const std::vector<std::string> some_missing{"w/1", "w/3"};
    std::string what;
    const auto t1 = std::chrono::steady_clock::now();
    try {
      s.wait(some_missing, 200ms);
    } catch (const ddp::timeout_error& e) {
      what = e.what();
    }
    const auto took = std::chrono::steady_clock::now() - t1;
    CHECK(what.find("'w/3'") != std::string::npos);
    CHECK(what.find("'w/1'") == std::string::npos);
    CHECK(took >= 200ms);
    CHECK(took < 3000ms);  // 200 ms, with margin for a loaded machine
  }
  SECTION("counters are atomic adds, separate from values") {
    CHECK(s.add("n/c", 0) == 0);
    CHECK(s.add("n/c", 5) == 5);
    CHECK(s.add("n/c", -2) == 3);
    CHECK(s.add("n/c", 0) == 3);
    CHECK_FALSE(s.get("n/c").has_value());
    s.set("n/c", ddp::as_bytes("value"));
    CHECK(s.add("n/c", 1) == 4);
    CHECK(text_of(s.get("n/c")) == "value");
  }
  SECTION("erase_prefix removes values and counters under the prefix only") {
    s.set("a/x", ddp::as_bytes("1"));
    s.set("a/y/z", ddp::as_bytes("2"));
    (void)s.add("a/n", 3);
    s.set("ab/x", ddp::as_bytes("3"));
    s.set("b/x", ddp::as_bytes("4"));
    CHECK(s.erase_prefix("a/") == 3);
    CHECK_FALSE(s.get("a/x").has_value());
    CHECK_FALSE(s.get("a/y/z").has_value());
    CHECK(s.add("a/n", 0) == 0);
    CHECK(text_of(s.get("ab/x")) == "3");
    CHECK(text_of(s.get("b/x")) == "4");
    CHECK(s.erase_prefix("nothing/") == 0);
  }
  SECTION("bad keys and oversized values are usage errors") {
    CHECK(usage_error_of([&] { s.set("", ddp::as_bytes("x")); }).find("empty key") != std::string::npos);
    CHECK(usage_error_of([&] { s.set("a b", ddp::as_bytes("x")); }).find("outside") != std::string::npos);
    CHECK(usage_error_of([&] { (void)s.get("a\nb"); }).find("outside") != std::string::npos);
    CHECK(usage_error_of([&] { (void)s.add("a*", 1); }).find("outside") != std::string::npos);
    CHECK(usage_error_of([&] { s.set(std::string(300, 'k'), ddp::as_bytes("x")); }).find("longer") !=
          std::string::npos);
    const std::vector<std::byte> big(ddp::default_max_value_bytes + 1);
    CHECK(usage_error_of([&] { s.set("big", big); }).find("larger than the store's limit") != std::string::npos);
    CHECK_FALSE(s.get("big").has_value());
  }
  SECTION("generation namespaces never see each other's keys") {
    auto g0 = st::generation_store(s, "job", 0);
    auto g1 = st::generation_store(s, "job", 1);
    auto g10 = st::generation_store(s, "job", 10);
    g0.set("gloo/0", ddp::as_bytes("dead address"));
    (void)g0.add("members/arrivals", 3);
    g10.set("gloo/0", ddp::as_bytes("other"));
    CHECK_FALSE(g1.get("gloo/0").has_value());
    CHECK(g1.add("members/arrivals", 0) == 0);
    g1.set("gloo/0", ddp::as_bytes("live address"));
    CHECK(text_of(g0.get("gloo/0")) == "dead address");
    CHECK(text_of(g1.get("gloo/0")) == "live address");
    CHECK(text_of(s.get("job/g1/gloo/0")) == "live address");
    CHECK(st::retire_generation(s, "job", 0) == 2);  // "job/g0/" does not match "job/g10/"
    CHECK_FALSE(g0.get("gloo/0").has_value());
    CHECK(text_of(g1.get("gloo/0")) == "live address");
    CHECK(text_of(g10.get("gloo/0")) == "other");
    CHECK(g1.erase_prefix("") == 1);
    CHECK_FALSE(g1.get("gloo/0").has_value());
  }
}

/// Waits for "late/key" in a child (throws on failure).
template <class S>
void wait_for_late_key(S& s) {
  const std::vector<std::string> keys{"late/key"};
  s.wait(keys, 5s);
  CHILD_CHECK(text_of(s.get("late/key")) == "here", "value read after wait");
}

/// `make()` builds a store in any process (the children build their own).
template <class Make>
void check_across_processes(Make make) {
  SECTION("concurrent adds from 4 processes hand out every value exactly once") {
    process_group g(4, [&](int, const reporter& rep) {
      auto s = make();
      std::string seen;
      for (int i = 0; i < 25; ++i) seen += std::to_string(s.add("count", 1)) + " ";
      rep.set("seen", seen);
    });
    const auto outs = g.wait_all(20s);
    std::multiset<int> all;
    for (const auto& o : outs) {
      REQUIRE(o.ok());
      std::istringstream in(o.value("seen"));
      for (int v; in >> v;) all.insert(v);
    }
    REQUIRE(all.size() == 100);
    for (int v = 1; v <= 100; ++v) CHECK(all.count(v) == 1);
    auto s = make();
    CHECK(s.add("count", 0) == 100);
  }
  SECTION("wait sees a key another process sets later") {
    process_group g(2, [&](int rank, const reporter&) {
      auto s = make();
      if (rank == 0) {
        std::this_thread::sleep_for(150ms);
        s.set("late/key", ddp::as_bytes("here"));
      } else {
        wait_for_late_key(s);
      }
    });
    const auto outs = g.wait_all(20s);
    INFO(gloo_test::describe_all(outs));
    CHECK(outs[0].ok());
    CHECK(outs[1].ok());
  }
  SECTION("three processes agree on a group, in id order") {
    process_group g(3, [&](int rank, const reporter& rep) {
      auto s = make();
      auto ns = st::generation_store(s, "grp", 4);
      const auto m =
          st::enroll(ns, "member-" + std::to_string(2 - rank), {.min_members = 3, .max_members = 3, .timeout = 10s});
      std::string list;
      for (const auto& id : m.members) list += id + ",";
      rep.set("rank", std::to_string(m.rank));
      rep.set("members", list);
    });
    const auto outs = g.wait_all(20s);
    INFO(gloo_test::describe_all(outs));
    for (int r = 0; r < 3; ++r) {
      REQUIRE(outs[static_cast<std::size_t>(r)].ok());
      CHECK(outs[static_cast<std::size_t>(r)].value("members") == "member-0,member-1,member-2,");
      CHECK(outs[static_cast<std::size_t>(r)].value("rank") == std::to_string(2 - r));
    }
  }
  SECTION("a group of at most 2: the third arrival is turned away") {
    process_group g(3, [&](int rank, const reporter& rep) {
      auto s = make();
      auto ns = st::generation_store(s, "grp", 5);
      if (rank == 2) std::this_thread::sleep_for(300ms);  // arrives after the group closed
      try {
        const auto m = st::enroll(ns, "p" + std::to_string(rank), {.min_members = 2, .max_members = 2, .timeout = 10s});
        rep.set("size", std::to_string(m.size()));
      } catch (const ddp::communication_error& e) {
        rep.set("refused", e.what());
      }
    });
    const auto outs = g.wait_all(20s);
    INFO(gloo_test::describe_all(outs));
    CHECK(outs[0].value("size") == "2");
    CHECK(outs[1].value("size") == "2");
    CHECK(outs[2].value("refused").find("after the group closed") != std::string::npos);
  }
  SECTION("a group that never reaches its minimum times out") {
    auto s = make();
    auto ns = st::generation_store(s, "grp", 6);
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_THROWS_AS(st::enroll(ns, "alone", {.min_members = 2, .timeout = 300ms}), ddp::timeout_error);
    CHECK(std::chrono::steady_clock::now() - t0 < 2s);
  }
}

/// A valid frame for "payload", to be damaged.
std::vector<std::byte> good_frame() { return st::detail::encode_frame(ddp::as_bytes("payload")); }

/// Damaged values: each must be rejected by get with a message saying what is wrong.
std::vector<std::pair<std::string, std::vector<std::byte>>> hostile_values(std::size_t limit) {
  std::vector<std::pair<std::string, std::vector<std::byte>>> v;
  auto truncated = good_frame();
  truncated.resize(truncated.size() - 3);
  v.emplace_back("truncated", truncated);
  auto header_only = good_frame();
  header_only.resize(10);
  v.emplace_back("truncated", header_only);
  v.emplace_back("bad magic", bytes_of({'h', 'e', 'l', 'l', 'o', ' ', 'w', 'o', 'r', 'l', 'd', '!', 0,
                                        0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0,   0}));
  auto flipped = good_frame();
  flipped.back() ^= std::byte{0x20};
  v.emplace_back("checksum mismatch", flipped);
  auto huge_claim = good_frame();
  st::detail::put_u64(huge_claim.data() + 8, std::uint64_t{1} << 40);
  v.emplace_back("more than the limit", huge_claim);
  auto trailing = good_frame();
  trailing.push_back(std::byte{0});
  v.emplace_back("trailing bytes", trailing);
  v.emplace_back("more than the limit", std::vector<std::byte>(limit + st::detail::frame_header_bytes + 1));
  return v;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// file store

TEST_CASE("file store: the store contract", "[store][file]") {
  temp_dir dir("fstore");
  st::file_store s(dir.path());
  check_contract(s);
}

TEST_CASE("file store: across processes", "[store][file]") {
  temp_dir dir("fstore");
  check_across_processes([&] { return st::file_store(dir.path()); });
}

TEST_CASE("file store: truncated, garbage and oversized values are rejected", "[store][file]") {
  temp_dir dir("fstore");
  const std::size_t limit = 1024;
  st::file_store s(dir.path(), {.max_value_bytes = limit});
  int i = 0;
  for (const auto& [expect, raw] : hostile_values(limit)) {
    const std::string key = "bad/" + std::to_string(i++);
    std::ofstream(dir.path() / ("v.bad%" + key.substr(4)), std::ios::binary)
        .write(reinterpret_cast<const char*>(raw.data()), static_cast<std::streamsize>(raw.size()));
    const std::string what = communication_error_of([&] { (void)s.get(key); });
    INFO(key << " expected '" << expect << "', got: " << what);
    CHECK(what.find("malformed value") != std::string::npos);
    CHECK(what.find(expect) != std::string::npos);
    CHECK(what.find("'" + key + "'") != std::string::npos);
  }
  // A corrupt counter is reported too, and a valid value still reads back.
  std::ofstream(dir.path() / "c.cnt", std::ios::binary) << "garbage!";
  CHECK(communication_error_of([&] { (void)s.add("cnt", 1); }).find("malformed") != std::string::npos);
  s.set("fine", ddp::as_bytes("ok"));
  CHECK(text_of(s.get("fine")) == "ok");
  // The directory holds no temporary files: writes are rename-atomic.
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    CHECK(e.path().filename().string().rfind("t.", 0) != 0);
  }
}

TEST_CASE("file store: an unusable directory is a communication error", "[store][file]") {
  temp_dir dir("fstore");
  std::ofstream(dir.path() / "plain-file") << "x";
  CHECK_THROWS_AS(st::file_store(dir.path() / "plain-file"), ddp::communication_error);
}

#if DDP_TEST_WITH_REDIS
// ---------------------------------------------------------------------------------------------
// Redis store (a real redis-server per test case)

namespace {
std::optional<std::string> redis_or_skip() {
  auto exe = gloo_test::find_redis_server();
  if (!exe) std::cout << "SKIP: redis-server not found on PATH; Redis store tests not run\n";
  return exe;
}

// Writes raw bytes under a value key, bypassing the store's framing.
void raw_redis_set(int port, const std::string& key, const std::vector<std::byte>& raw) {
  redisContext* c = redisConnect("127.0.0.1", port);
  REQUIRE(c != nullptr);
  REQUIRE(c->err == 0);
  const char* argv[] = {"SET", key.c_str(), reinterpret_cast<const char*>(raw.data())};
  const std::size_t len[] = {3, key.size(), raw.size()};
  freeReplyObject(redisCommandArgv(c, 3, argv, len));
  redisFree(c);
}
}  // namespace

TEST_CASE("redis store: the store contract", "[store][redis]") {
  const auto exe = redis_or_skip();
  if (!exe) return;
  temp_dir dir("redis");
  gloo_test::redis_server server(*exe, dir.path());
  st::redis_store s({.port = server.port()});
  check_contract(s);
}

TEST_CASE("redis store: across processes", "[store][redis]") {
  const auto exe = redis_or_skip();
  if (!exe) return;
  temp_dir dir("redis");
  gloo_test::redis_server server(*exe, dir.path());
  const int port = server.port();
  check_across_processes([port] { return st::redis_store({.port = port}); });
}

TEST_CASE("redis store: truncated, garbage and oversized values are rejected", "[store][redis]") {
  const auto exe = redis_or_skip();
  if (!exe) return;
  temp_dir dir("redis");
  gloo_test::redis_server server(*exe, dir.path());
  const std::size_t limit = 1024;
  st::redis_store s({.port = server.port(), .max_value_bytes = limit});
  int i = 0;
  for (const auto& [expect, raw] : hostile_values(limit)) {
    const std::string key = "bad/" + std::to_string(i++);
    raw_redis_set(server.port(), "v:" + key, raw);
    const std::string what = communication_error_of([&] { (void)s.get(key); });
    INFO(key << " expected '" << expect << "', got: " << what);
    CHECK(what.find("malformed value") != std::string::npos);
    CHECK(what.find(expect) != std::string::npos);
  }
  raw_redis_set(server.port(), "c:cnt", bytes_of({'x', 'y'}));
  CHECK(communication_error_of([&] { (void)s.add("cnt", 1); }).find("not an integer") != std::string::npos);
  s.set("fine", ddp::as_bytes("ok"));
  CHECK(text_of(s.get("fine")) == "ok");
}

TEST_CASE("redis store: a dead server is an error, not a crash; a restarted one is used again", "[store][redis]") {
  const auto exe = redis_or_skip();
  if (!exe) return;
  temp_dir dir("redis");
  gloo_test::redis_server server(*exe, dir.path());
  st::redis_store s({.port = server.port(), .connect_timeout = 500ms, .command_timeout = 1s});
  s.set("k", ddp::as_bytes("v"));
  server.crash();
  // Several calls: the first may fail on the write (EPIPE, no SIGPIPE), later ones on connect.
  for (int i = 0; i < 3; ++i) {
    const std::string what = communication_error_of([&] { s.set("k", ddp::as_bytes("v2")); });
    INFO(what);
    CHECK(what.find("redis 127.0.0.1:" + std::to_string(server.port())) != std::string::npos);
  }
  CHECK_THROWS_AS(st::redis_store({.port = server.port(), .connect_timeout = 500ms}), ddp::communication_error);
  server.start();
  s.set("k", ddp::as_bytes("v3"));  // reconnects
  CHECK(text_of(s.get("k")) == "v3");
}
#else
TEST_CASE("redis store: not built", "[store][redis]") {
  std::cout << "SKIP: built without hiredis; Redis store tests not run\n";
}
#endif
