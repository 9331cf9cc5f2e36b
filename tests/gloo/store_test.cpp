// Rendezvous stores: the contract of the concept over the file store and a real Redis server,
// hostile values, generation namespaces and group membership. Ranks are forked processes.
// Cases tagged [other_user] run part of themselves as uid 65534 (a co-tenant of the node) and
// print "SKIP: not root" where the tests cannot switch user.

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

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

#include <cstdlib>
#include <filesystem>
#include <optional>

#include <ddp/stores/redis_store.hpp>
#endif

#include "../common/other_user.hpp"
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

std::uintmax_t frame_size_of(const std::string& payload) {
  return st::detail::encode_frame(ddp::as_bytes(payload)).size();
}

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
  SECTION("set_if_absent keeps the first value and returns it") {
    STATIC_REQUIRE(ddp::first_write_store<S>);
    CHECK(text_of(s.set_if_absent("once/a", ddp::as_bytes("first"))) == "first");
    CHECK(text_of(s.set_if_absent("once/a", ddp::as_bytes("second"))) == "first");
    CHECK(text_of(s.get("once/a")) == "first");
    s.set("once/b", ddp::as_bytes("set"));
    CHECK(text_of(s.set_if_absent("once/b", ddp::as_bytes("later"))) == "set");
    CHECK(s.set_if_absent("once/empty", {}).empty());
    // Through a type-erased reference and a namespace, too.
    ddp::store_ref ref(s);
    REQUIRE(ref.has_set_if_absent());
    st::prefix_store<ddp::store_ref> ns(ref, "once/");
    CHECK(text_of(ns.set_if_absent("a", ddp::as_bytes("third"))) == "first");
    CHECK(text_of(ns.set_if_absent("c", ddp::as_bytes("third"))) == "third");
    CHECK(usage_error_of([&] { (void)s.set_if_absent("a b", ddp::as_bytes("x")); }).find("outside") !=
          std::string::npos);
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
  SECTION("set_if_absent from 4 processes at once: every one gets the first value written") {
    process_group g(4, [&](int rank, const reporter& rep) {
      auto s = make();
      std::string seen;
      for (int i = 0; i < 20; ++i) {
        const std::string key = "first/" + std::to_string(i);
        seen += ddp::to_text(s.set_if_absent(key, ddp::as_bytes("rank " + std::to_string(rank)))) + ";";
      }
      rep.set("seen", seen);
    });
    const auto outs = g.wait_all(20s);
    for (const auto& o : outs) {
      REQUIRE(o.ok());
      CHECK(o.value("seen") == outs.front().value("seen"));  // the same winner of every key, everywhere
    }
    auto s = make();
    std::string stored;
    for (int i = 0; i < 20; ++i) stored += text_of(s.get("first/" + std::to_string(i))) + ";";
    CHECK(stored == outs.front().value("seen"));
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

namespace {
namespace fs = std::filesystem;

unsigned mode_of(const fs::path& p) {
  struct stat st {};
  REQUIRE(::lstat(p.c_str(), &st) == 0);
  return static_cast<unsigned>(st.st_mode & 07777);
}

// The names in a store's directory that start with `kind` ("l." lock files, "t." temporaries).
std::vector<std::string> entries_of_kind(const fs::path& dir, const std::string& kind) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const auto name = e.path().filename().string();
    if (name.rfind(kind, 0) == 0) out.push_back(name);
  }
  return out;
}

// A directory at `p` with exactly `mode` and owner `uid` (root only for another uid).
void make_dir(const fs::path& p, unsigned mode, uid_t uid = ::geteuid(), gid_t gid = ::getegid()) {
  REQUIRE(::mkdir(p.c_str(), 0700) == 0);
  REQUIRE(::chown(p.c_str(), uid, gid) == 0);
  REQUIRE(::chmod(p.c_str(), static_cast<mode_t>(mode)) == 0);
}

bool skip_unless_other_user() {
  if (other_user::can_switch_user()) return false;
  std::cout << "SKIP: not root: cannot run a process as uid 65534; cases with a second user not run\n";
  return true;
}

// A 256-byte key: `/`-separated, ending in `tail`.
std::string long_key(char fill, const std::string& tail) {
  std::string k = "job/g1/";
  while (k.size() + tail.size() < ddp::max_key_bytes) k += (k.size() % 50 == 0) ? '/' : fill;
  return k + tail;
}
}  // namespace

TEST_CASE("file store: a new directory is 0700 and its files 0600; no lock file stays", "[store][file]") {
  temp_dir dir("fstore");
  const auto path = dir.path() / "new" / "store";
  st::file_store s(path);
  CHECK(mode_of(path) == 0700);
  s.set("job/key", ddp::as_bytes("secret"));
  CHECK(s.add("job/count", 2) == 2);
  CHECK(mode_of(path / "v.job%key") == 0600);
  CHECK(mode_of(path / "c.job%count") == 0600);
  CHECK(entries_of_kind(path, "l.").empty());
  CHECK(entries_of_kind(path, "t.").empty());

  const auto shared = dir.path() / "group-job";
  st::file_store g(shared, {.group_access = true});
  CHECK(mode_of(shared) == 0770);
  g.set("k", ddp::as_bytes("v"));
  CHECK(g.add("n", 1) == 1);
  CHECK(mode_of(shared / "v.k") == 0660);
  CHECK(mode_of(shared / "c.n") == 0660);
}

TEST_CASE("file store: a directory writable by group or others is refused unless group_access allows it",
          "[store][file]") {
  temp_dir dir("fstore");
  const auto open = dir.path() / "open";
  make_dir(open, 0777);
  std::string what = communication_error_of([&] { st::file_store s(open); });
  INFO(what);
  CHECK(what.find("'" + open.string() + "'") != std::string::npos);
  CHECK(what.find("mode 0777") != std::string::npos);
  CHECK(what.find("writable by other users") != std::string::npos);
  what = communication_error_of([&] { st::file_store s(open, {.group_access = true}); });
  CHECK(what.find("writable by other users") != std::string::npos);  // never allowed

  const auto group = dir.path() / "group";
  make_dir(group, 0770);
  what = communication_error_of([&] { st::file_store s(group); });
  INFO(what);
  CHECK(what.find("mode 0770") != std::string::npos);
  CHECK(what.find("writable by its group") != std::string::npos);
  CHECK(what.find("group_access") != std::string::npos);
  // Ours and of our group: a group job's shared directory.
  st::file_store shared(group, {.group_access = true});
  shared.set("k", ddp::as_bytes("v"));
  CHECK(text_of(shared.get("k")) == "v");
  CHECK(mode_of(group / "v.k") == 0660);
  CHECK(mode_of(group) == 0770);  // an existing directory's mode is left alone

  const auto readable = dir.path() / "readable";  // mkdir's usual 0755: others may list, not write
  make_dir(readable, 0755);
  st::file_store fine(readable);
  fine.set("k", ddp::as_bytes("v"));
  CHECK(mode_of(readable / "v.k") == 0600);
}

TEST_CASE("file store: another user's directory or link is refused", "[store][file][other_user]") {
  if (skip_unless_other_user()) return;
  temp_dir dir("fstore");
  // A directory a co-tenant made first under the name the job would use, open to everyone.
  const auto planted = dir.path() / "planted";
  make_dir(planted, 0777, other_user::uid, other_user::gid);
  std::string what = communication_error_of([&] { st::file_store s(planted); });
  INFO(what);
  CHECK(what.find("refusing directory '" + planted.string() + "'") != std::string::npos);
  CHECK(what.find("owner uid 65534") != std::string::npos);
  CHECK(what.find("mode 0777") != std::string::npos);
  CHECK(what.find("owned by another user") != std::string::npos);
  // Closed to others but still the co-tenant's: it can read and replace everything in it.
  const auto theirs = dir.path() / "theirs";
  make_dir(theirs, 0700, other_user::uid, other_user::gid);
  CHECK(communication_error_of([&] { st::file_store s(theirs); }).find("owned by another user") != std::string::npos);
  // group_access: another user's directory is accepted only with one of our groups.
  CHECK(communication_error_of([&] {
          st::file_store s(theirs, {.group_access = true});
        }).find("one of this process's") != std::string::npos);
  // A link the co-tenant planted under the name, to a directory of ours.
  const auto ours = dir.path() / "ours";
  make_dir(ours, 0700);
  const auto link = dir.path() / "link";
  fs::create_symlink(ours, link);
  REQUIRE(::lchown(link.c_str(), other_user::uid, other_user::gid) == 0);
  what = communication_error_of([&] { st::file_store s(link); });
  INFO(what);
  CHECK(what.find("symbolic link owned by uid 65534") != std::string::npos);
  const auto our_link = dir.path() / "our-link";  // a link of our own is followed
  fs::create_symlink(ours, our_link);
  st::file_store via_link(our_link);
  via_link.set("k", ddp::as_bytes("v"));
  CHECK(fs::exists(ours / "v.k"));
}

TEST_CASE("file store: links planted under a key's names are refused, never followed", "[store][file]") {
  temp_dir dir("fstore");
  st::file_store s(dir.path());
  const auto elsewhere = dir.path() / "elsewhere";
  make_dir(elsewhere, 0700);
  // The lock file: opening it with O_CREAT through the link would create the target.
  fs::create_symlink(elsewhere / "created-by-add", dir.path() / "l.job%n");
  std::string what = communication_error_of([&] { (void)s.add("job/n", 1); });
  INFO(what);
  CHECK(what.find("lock file l.job%n") != std::string::npos);
  CHECK(what.find("symbolic link") != std::string::npos);
  CHECK_FALSE(fs::exists(elsewhere / "created-by-add"));
  CHECK_FALSE(fs::exists(dir.path() / "c.job%n"));
  // A value: a link to a valid frame would have been read as the value.
  {
    const auto frame = st::detail::encode_frame(ddp::as_bytes("planted"));
    std::ofstream(elsewhere / "frame", std::ios::binary)
        .write(reinterpret_cast<const char*>(frame.data()), static_cast<std::streamsize>(frame.size()));
  }
  fs::create_symlink(elsewhere / "frame", dir.path() / "v.job%addr");
  what = communication_error_of([&] { (void)s.get("job/addr"); });
  INFO(what);
  CHECK(what.find("v.job%addr is a symbolic link") != std::string::npos);
  const std::vector<std::string> keys{"job/addr"};
  s.wait(keys, 100ms);                       // the entry exists: get says what is wrong with it
  s.set("job/addr", ddp::as_bytes("ours"));  // rename replaces the link itself
  CHECK(text_of(s.get("job/addr")) == "ours");
  CHECK(fs::file_size(elsewhere / "frame") == frame_size_of("planted"));
  // A counter file.
  fs::create_symlink(elsewhere / "frame", dir.path() / "c.job%m");
  CHECK(communication_error_of([&] { (void)s.add("job/m", 1); }).find("symbolic link") != std::string::npos);
  CHECK(entries_of_kind(dir.path(), "l.").size() == 1);  // only the planted one
}

TEST_CASE("file store: a co-tenant cannot read values, nor plant links in a group job's directory",
          "[store][file][other_user]") {
  if (skip_unless_other_user()) return;
  temp_dir dir("fstore");
  REQUIRE(::chmod(dir.path().c_str(), 0711) == 0);  // others may pass through, as in /tmp
  const auto path = dir.path() / "store";
  st::file_store s(path);
  s.set("job/secret", ddp::as_bytes("nccl unique id"));
  const auto value = path / "v.job%secret";
  const auto try_read = [&] {
    return other_user::run([&] {
      const int fd = ::open(value.c_str(), O_RDONLY);
      if (fd >= 0) return 1;
      return errno == EACCES ? 0 : 2;
    });
  };
  CHECK(try_read() == 0);  // the directory is 0700
  REQUIRE(::chmod(path.c_str(), 0755) == 0);
  st::file_store still_ours(path);  // readable by others is allowed: the files are 0600
  CHECK(try_read() == 0);

  // A group job's directory, owned by the co-tenant (a member of the job) and of our group: it can
  // plant links, which are refused, not followed.
  const auto shared = dir.path() / "shared";
  make_dir(shared, 0770, other_user::uid, ::getegid());
  st::file_store g(shared, {.group_access = true});
  const auto target = dir.path() / "target-of-link";
  REQUIRE(other_user::run([&] {
            return ::symlink(target.c_str(), (shared / "l.job%n").c_str()) == 0 &&
                           ::symlink(target.c_str(), (shared / "v.job%k").c_str()) == 0
                       ? 0
                       : 1;
          }) == 0);
  CHECK(communication_error_of([&] { (void)g.add("job/n", 1); }).find("symbolic link") != std::string::npos);
  CHECK(communication_error_of([&] { (void)g.get("job/k"); }).find("symbolic link") != std::string::npos);
  CHECK_FALSE(fs::exists(target));
}

TEST_CASE("file store: keys of 256 bytes work; 257 bytes are a usage error", "[store][file]") {
  temp_dir dir("fstore");
  st::file_store s(dir.path());
  const std::string a = long_key('a', "/x1");
  const std::string b = long_key('a', "/y1");  // same start and length: only the hash tells them apart
  REQUIRE(a.size() == 256);
  REQUIRE(b.size() == 256);
  s.set(a, ddp::as_bytes("value a"));
  s.set(b, ddp::as_bytes("value b"));
  const std::vector<std::string> keys{a, b};
  s.wait(keys, 1s);
  CHECK(text_of(s.get(a)) == "value a");
  CHECK(text_of(s.get(b)) == "value b");
  CHECK(s.add(a, 5) == 5);
  CHECK(s.add(a, 1) == 6);
  CHECK(s.add(b, 0) == 0);
  for (const auto& e : fs::directory_iterator(dir.path())) CHECK(e.path().filename().string().size() <= 255);
  // A prefix longer than what the file names keep is checked against the key inside the file.
  CHECK(s.erase_prefix(a.substr(0, 255)) == 2);  // ".../x": a's value and counter
  CHECK_FALSE(s.get(a).has_value());
  CHECK(s.add(a, 0) == 0);
  CHECK(text_of(s.get(b)) == "value b");
  CHECK(s.erase_prefix("job/") == 1);  // a short prefix: decided by the name
  CHECK_FALSE(s.get(b).has_value());
  CHECK(fs::is_empty(dir.path()));
  // Another key's file under a's name (a hash collision, or planted) is not a's value.
  s.set(b, ddp::as_bytes("value b"));
  std::string b_name;
  for (const auto& e : fs::directory_iterator(dir.path())) b_name = e.path().filename().string();
  std::string a_name = b_name;
  const auto tilde = b_name.find('~');
  REQUIRE(tilde != std::string::npos);
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(ddp::detail::fnv1a(a)));
  a_name.replace(tilde + 1, 16, hex);
  fs::copy_file(dir.path() / b_name, dir.path() / a_name);
  const std::string what = communication_error_of([&] { (void)s.get(a); });
  INFO(what);
  CHECK(what.find("malformed value") != std::string::npos);
  CHECK(what.find("another key with the same hash") != std::string::npos);

  const std::string too_long = a + "z";
  const auto long_error = [](const std::string& e) { return e.find("longer than 256") != std::string::npos; };
  CHECK(long_error(usage_error_of([&] { s.set(too_long, ddp::as_bytes("x")); })));
  CHECK(long_error(usage_error_of([&] { (void)s.get(too_long); })));
  CHECK(long_error(usage_error_of([&] { (void)s.add(too_long, 1); })));
  CHECK(long_error(usage_error_of([&] { s.wait(std::vector<std::string>{too_long}, 10ms); })));
  CHECK(long_error(usage_error_of([&] { (void)s.erase_prefix(too_long); })));
}

TEST_CASE("file store: a failed add leaves no lock file", "[store][file]") {
  temp_dir dir("fstore");
  st::file_store s(dir.path(), {.lock_timeout = 200ms});
  std::ofstream(dir.path() / "c.bad", std::ios::binary) << "not a number";
  CHECK(communication_error_of([&] { (void)s.add("bad", 1); }).find("malformed") != std::string::npos);
  CHECK(entries_of_kind(dir.path(), "l.").empty());

  // A lock another process holds: add times out and leaves the holder's file to it.
  const auto lock_path = dir.path() / "l.held";
  const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::flock(fd, LOCK_EX) == 0);
  CHECK_THROWS_AS(s.add("held", 1), ddp::timeout_error);
  CHECK(fs::exists(lock_path));
  ::close(fd);  // the holder died: the next add uses the stale file, then removes it
  CHECK(s.add("held", 1) == 1);
  CHECK(entries_of_kind(dir.path(), "l.").empty());
}

namespace {
// A store whose ids under "members/<n>" are slow to read, and whose arrival counter reads
// `phantoms` more arrivals than took a number (ones that never publish): reading every arrival's
// id takes phantoms x delay.
struct slow_ids_store {
  st::file_store& inner;
  int phantoms;
  std::chrono::milliseconds delay;
  void set(std::string_view k, std::span<const std::byte> v) { inner.set(k, v); }
  std::optional<ddp::store_value> get(std::string_view k) {
    if (k.starts_with("members/") && k != "members/closed") std::this_thread::sleep_for(delay);
    return inner.get(k);
  }
  void wait(std::span<const std::string> keys, std::chrono::milliseconds t) { inner.wait(keys, t); }
  std::int64_t add(std::string_view k, std::int64_t d) {
    const auto v = inner.add(k, d);
    return k == "members/arrivals" && d == 0 ? v + phantoms : v;
  }
  std::size_t erase_prefix(std::string_view p) { return inner.erase_prefix(p); }
};
}  // namespace

TEST_CASE("enroll: a slow store never holds a group past its deadline", "[store][file][membership]") {
  temp_dir dir("fstore");
  st::file_store fs_store(dir.path());
  slow_ids_store slow{fs_store, 60, 50ms};  // 3 s to read every id
  int reports = 0;
  st::group_options opts{.min_members = 100, .max_members = 100, .timeout = 1000ms, .expected = {"first", "second"}};
  opts.progress = [&](const ddp::progress_update&) { ++reports; };
  SECTION("enroll: the first arrival's progress report stops at the deadline") {
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_THROWS_AS(st::enroll(slow, "first", opts), ddp::timeout_error);
    const auto took = std::chrono::steady_clock::now() - t0;
    CHECK(took >= 1000ms);
    CHECK(took < 1700ms);  // the deadline plus one slow read, with margin for a loaded machine
    CHECK(reports >= 1);
  }
  SECTION("enroll_any: the scan of the arrivals stops at the deadline") {
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_THROWS_AS(st::enroll_any(slow, "first", opts), ddp::timeout_error);
    const auto took = std::chrono::steady_clock::now() - t0;
    CHECK(took >= 1000ms);
    CHECK(took < 1700ms);
  }
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

// Whether value key `key` exists in database `db`, as a plain client sees it.
bool raw_redis_exists(int port, int db, const std::string& key) {
  redisContext* c = redisConnect("127.0.0.1", port);
  REQUIRE(c != nullptr);
  REQUIRE(c->err == 0);
  freeReplyObject(redisCommand(c, "SELECT %d", db));
  auto* r = static_cast<redisReply*>(redisCommand(c, "EXISTS v:%s", key.c_str()));
  REQUIRE(r != nullptr);
  const bool found = r->type == REDIS_REPLY_INTEGER && r->integer == 1;
  freeReplyObject(r);
  redisFree(c);
  return found;
}

// A password file: `text` in a file with permissions `perms` (only its owner's by default).
std::filesystem::path write_password_file(const std::filesystem::path& path, const std::string& text,
                                          std::filesystem::perms perms = std::filesystem::perms::owner_read |
                                                                         std::filesystem::perms::owner_write) {
  std::ofstream(path, std::ios::binary) << text;
  std::filesystem::permissions(path, perms);
  return path;
}

// Sets (or, given nothing, unsets) an environment variable while it lives.
class scoped_env {
 public:
  scoped_env(std::string name, const std::optional<std::string>& value) : name_(std::move(name)) {
    if (const char* old = std::getenv(name_.c_str())) old_ = old;
    set(value);
  }
  scoped_env(const scoped_env&) = delete;
  scoped_env& operator=(const scoped_env&) = delete;
  ~scoped_env() { set(old_); }

 private:
  void set(const std::optional<std::string>& v) {
    if (v) {
      ::setenv(name_.c_str(), v->c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }
  std::string name_;
  std::optional<std::string> old_;
};

const std::string server_password = "test-pw-9f2c41";  // what `requirepass` asks for
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

TEST_CASE("redis store: requirepass, the password from a 0600 file", "[store][redis]") {
  const auto exe = redis_or_skip();
  if (!exe) return;
  temp_dir dir("redis");
  gloo_test::redis_server server(*exe, dir.path(), 0, {"requirepass " + server_password});
  const scoped_env no_env("DDP_REDIS_PASSWORD", "not-this-one");  // the file wins
  const auto file = write_password_file(dir.path() / "pw", server_password + "\n");
  st::redis_store s({.port = server.port(), .password_file = file});
  check_contract(s);
}

TEST_CASE("redis store: requirepass, the password from the environment", "[store][redis]") {
  const auto exe = redis_or_skip();
  if (!exe) return;
  temp_dir dir("redis");
  gloo_test::redis_server server(*exe, dir.path(), 0, {"requirepass " + server_password});
  SECTION("$DDP_REDIS_PASSWORD") {
    const scoped_env env("DDP_REDIS_PASSWORD", server_password);
    st::redis_store s({.port = server.port()});
    check_contract(s);
  }
  SECTION("a variable of the program's choosing") {
    const scoped_env env("DDP_REDIS_PASSWORD", std::nullopt);
    const scoped_env mine("MY_JOB_REDIS_PW", server_password);
    st::redis_store s({.port = server.port(), .password_env = "MY_JOB_REDIS_PW"});
    s.set("k", ddp::as_bytes("v"));
    CHECK(text_of(s.get("k")) == "v");
  }
}

TEST_CASE("redis store: requirepass, no or a wrong password is a clear error without the password", "[store][redis]") {
  const auto exe = redis_or_skip();
  if (!exe) return;
  temp_dir dir("redis");
  gloo_test::redis_server server(*exe, dir.path(), 0, {"requirepass " + server_password});
  const std::string at = "redis 127.0.0.1:" + std::to_string(server.port());
  const scoped_env no_env("DDP_REDIS_PASSWORD", std::nullopt);
  {
    const std::string what = communication_error_of([&] { st::redis_store s({.port = server.port()}); });
    INFO(what);
    CHECK(what.find(at + " requires a password, and none was given (NOAUTH") != std::string::npos);
    CHECK(what.find("password_file") != std::string::npos);
    CHECK(what.find("$DDP_REDIS_PASSWORD") != std::string::npos);
  }
  const std::string wrong = "wrong-pw-55e1";
  {
    const auto file = write_password_file(dir.path() / "wrong", wrong);
    const std::string what =
        communication_error_of([&] { st::redis_store s({.port = server.port(), .password_file = file}); });
    INFO(what);
    CHECK(what.find(at + " refused the default user with the password from password file '" + file.string() +
                    "' (WRONGPASS") != std::string::npos);
    CHECK(what.find(wrong) == std::string::npos);
    CHECK(what.find(server_password) == std::string::npos);
  }
  {
    const scoped_env env("DDP_REDIS_PASSWORD", wrong);
    const std::string what = communication_error_of([&] { st::redis_store s({.port = server.port()}); });
    INFO(what);
    CHECK(what.find("with the password from $DDP_REDIS_PASSWORD (WRONGPASS") != std::string::npos);
    CHECK(what.find(wrong) == std::string::npos);
  }
  {  // a password the server does not ask for is a configuration error too, said as such
    temp_dir open_dir("redis");
    gloo_test::redis_server open(*exe, open_dir.path());
    const scoped_env env("DDP_REDIS_PASSWORD", wrong);
    const std::string what = communication_error_of([&] { st::redis_store s({.port = open.port()}); });
    INFO(what);
    CHECK(what.find("refused AUTH as the default user with the password from $DDP_REDIS_PASSWORD") !=
          std::string::npos);
    CHECK(what.find(wrong) == std::string::npos);
  }
}

TEST_CASE("redis store: every reconnection authenticates and selects the database again", "[store][redis]") {
  const auto exe = redis_or_skip();
  if (!exe) return;
  temp_dir dir("redis");
  gloo_test::redis_server server(*exe, dir.path(), 0, {"requirepass " + server_password});
  const auto file = write_password_file(dir.path() / "pw", server_password);
  st::redis_store s(
      {.port = server.port(), .connect_timeout = 500ms, .command_timeout = 1s, .password_file = file, .database = 2});
  s.set("k", ddp::as_bytes("v"));
  server.crash();
  CHECK_FALSE(communication_error_of([&] { s.set("k", ddp::as_bytes("v2")); }).empty());
  std::filesystem::remove(file);  // read once, by the constructor
  server.start();
  s.set("k", ddp::as_bytes("v3"));  // would be NOAUTH without a new AUTH
  CHECK(text_of(s.get("k")) == "v3");
  st::redis_store db0({.port = server.port(), .password_file = write_password_file(file, server_password)});
  CHECK_FALSE(db0.get("k").has_value());  // set in database 2 again, not in 0
}

TEST_CASE("redis store: an ACL user restricted to its job's keys", "[store][redis]") {
  const auto exe = redis_or_skip();
  if (!exe) return;
  temp_dir dir("redis");
  const std::string alice_password = "alice-pw-0b7d";
  gloo_test::redis_server server(
      *exe, dir.path(), 0,
      {"requirepass " + server_password, "user alice on >" + alice_password + " ~v:job/* ~c:job/* +@all"});
  const std::string at = "redis 127.0.0.1:" + std::to_string(server.port());
  const scoped_env no_env("DDP_REDIS_PASSWORD", std::nullopt);
  const auto file = write_password_file(dir.path() / "alice", alice_password + "\n");
  SECTION("its keys work; others' are refused by the server") {
    st::redis_store s({.port = server.port(), .username = "alice", .password_file = file});
    s.set("job/a", ddp::as_bytes("1"));
    CHECK(text_of(s.get("job/a")) == "1");
    CHECK(s.add("job/n", 2) == 2);
    const std::vector<std::string> keys{"job/a"};
    s.wait(keys, 1s);
    auto view = st::prefix_store(s, "job/");
    CHECK(view.erase_prefix("") == 2);
    CHECK_FALSE(s.get("job/a").has_value());
    const std::string what = communication_error_of([&] { s.set("other/a", ddp::as_bytes("x")); });
    INFO(what);
    CHECK(what.find("NOPERM") != std::string::npos);
    CHECK(what.find(at) != std::string::npos);
  }
  SECTION("the user and the password from the environment") {
    const scoped_env user("DDP_REDIS_USERNAME", "alice");
    const scoped_env env("DDP_REDIS_PASSWORD", alice_password);
    st::redis_store s({.port = server.port()});
    s.set("job/a", ddp::as_bytes("2"));
    CHECK(text_of(s.get("job/a")) == "2");
    CHECK_FALSE(communication_error_of([&] { s.set("other/a", ddp::as_bytes("x")); }).empty());
  }
  SECTION("a wrong password names the user, not the password") {
    const scoped_env env("DDP_REDIS_PASSWORD", server_password);  // the default user's, not alice's
    const std::string what =
        communication_error_of([&] { st::redis_store s({.port = server.port(), .username = "alice"}); });
    INFO(what);
    CHECK(what.find(at + " refused user 'alice' with the password from $DDP_REDIS_PASSWORD (WRONGPASS") !=
          std::string::npos);
    CHECK(what.find(server_password) == std::string::npos);
  }
  SECTION("a user without a password is refused before connecting") {
    const std::string what = usage_error_of([&] { st::redis_store s({.port = server.port(), .username = "alice"}); });
    CHECK(what.find("ACL user 'alice' for " + at + " has no password") != std::string::npos);
  }
}

TEST_CASE("redis store: stores on different databases never see each other's keys", "[store][redis]") {
  const auto exe = redis_or_skip();
  if (!exe) return;
  temp_dir dir("redis");
  gloo_test::redis_server server(*exe, dir.path());
  const scoped_env no_env("DDP_REDIS_PASSWORD", std::nullopt);
  st::redis_store s0({.port = server.port()});
  st::redis_store s3({.port = server.port(), .database = 3});
  s0.set("k", ddp::as_bytes("zero"));
  CHECK_FALSE(s3.get("k").has_value());
  s3.set("k", ddp::as_bytes("three"));
  CHECK(s3.add("n", 7) == 7);
  CHECK(text_of(s0.get("k")) == "zero");
  CHECK(s0.add("n", 0) == 0);
  CHECK(s0.erase_prefix("k") == 1);
  CHECK(text_of(s3.get("k")) == "three");
  CHECK(raw_redis_exists(server.port(), 3, "k"));
  CHECK_FALSE(raw_redis_exists(server.port(), 0, "k"));
  const std::string what = communication_error_of([&] { st::redis_store s({.port = server.port(), .database = 99}); });
  INFO(what);
  CHECK(what.find("refused database 99") != std::string::npos);
  CHECK(what.find("out of range") != std::string::npos);
  CHECK(usage_error_of([&] {
          st::redis_store s({.port = server.port(), .database = -1});
        }).find("database -1 for redis 127.0.0.1:" + std::to_string(server.port()) + " is negative") !=
        std::string::npos);
}

TEST_CASE("redis store: a password file others may read, or not a password file, is refused", "[store][redis]") {
  // Checked before connecting: no server needed.
  temp_dir dir("redis");
  namespace fs = std::filesystem;
  const auto error_for = [&](const fs::path& file) {
    return usage_error_of([&] { st::redis_store s({.port = 1, .password_file = file}); });
  };
  const std::string secret = "secret-pw-31aa";
  const auto open = write_password_file(
      dir.path() / "open", secret,
      fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read | fs::perms::others_read);
  std::string what = error_for(open);
  CHECK(what.find("password file '" + open.string() + "' may be accessed by group or others (mode 0644)") !=
        std::string::npos);
  CHECK(what.find("chmod 600") != std::string::npos);
  CHECK(what.find(secret) == std::string::npos);
  const auto group = write_password_file(dir.path() / "group", secret, fs::perms::owner_read | fs::perms::group_read);
  CHECK(error_for(group).find("(mode 0440)") != std::string::npos);
  CHECK(error_for(dir.path() / "missing").find("cannot be opened: No such file or directory") != std::string::npos);
  CHECK(error_for(dir.path()).find("is not a regular file") != std::string::npos);
  CHECK(error_for(write_password_file(dir.path() / "empty", "\n")).find("is empty") != std::string::npos);
  what = error_for(write_password_file(dir.path() / "two", "user\n" + secret + "\n"));
  CHECK(what.find("holds more than one line") != std::string::npos);
  CHECK(what.find(secret) == std::string::npos);
  CHECK(error_for(write_password_file(dir.path() / "big", std::string(70000, 'x'))).find("is larger than 65536") !=
        std::string::npos);
  if (::geteuid() == 0) {  // only root can give a file away
    const auto theirs = write_password_file(dir.path() / "theirs", secret);
    REQUIRE(::chown(theirs.c_str(), 65534, 65534) == 0);
    CHECK(error_for(theirs).find("belongs to uid 65534, not to this user (uid 0)") != std::string::npos);
  }
  // 0400 is fine: the store goes on to connect (nobody listens on port 1).
  const auto ro = write_password_file(dir.path() / "ro", secret, fs::perms::owner_read);
  CHECK(communication_error_of([&] {
          st::redis_store s({.port = 1, .connect_timeout = 500ms, .password_file = ro});
        }).find("cannot connect to redis 127.0.0.1:1") != std::string::npos);
}

TEST_CASE("redis store: TLS asked for is refused, pointing at a tunnel", "[store][redis]") {
  const std::string what = usage_error_of([] { st::redis_store s({.port = 1, .tls = true}); });
  CHECK(what.find("TLS was requested for redis 127.0.0.1:1, but redis_store has no TLS") != std::string::npos);
  CHECK(what.find("TLS tunnel (stunnel or spiped)") != std::string::npos);
}

TEST_CASE("redis store: erase_prefix(\"\") is refused: it would erase every job's keys", "[store][redis]") {
  const auto exe = redis_or_skip();
  if (!exe) return;
  temp_dir dir("redis");
  gloo_test::redis_server server(*exe, dir.path());
  const scoped_env no_env("DDP_REDIS_PASSWORD", std::nullopt);
  st::redis_store s({.port = server.port()});
  s.set("other-job/k", ddp::as_bytes("theirs"));
  const std::string what = usage_error_of([&] { (void)s.erase_prefix(""); });
  CHECK(what.find("refusing an empty prefix: it would erase every ddp key on redis 127.0.0.1:" +
                  std::to_string(server.port())) != std::string::npos);
  CHECK(text_of(s.get("other-job/k")) == "theirs");
}
#else
TEST_CASE("redis store: not built", "[store][redis]") {
  std::cout << "SKIP: built without hiredis; Redis store tests not run\n";
}
#endif
