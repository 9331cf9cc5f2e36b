// Writes the seed corpus of every fuzz target with the library's own encoders:
//   fuzz_make_corpus <dir>        (normally tests/fuzz/corpus; creates <dir>/<target>/<seed>)
// Seeds are a few small valid values and a few damaged ones, so that each fuzzer starts from
// inputs that pass its decoder's checks (a checksum is hard to guess) and from the ways they fail.
// Crash inputs found by fuzzing are kept beside them (named regression-*) and are not written here.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/manager/record.hpp>
#include <ddp/store.hpp>
#include <ddp/stores/codec.hpp>
#include <ddp/stores/membership.hpp>

namespace fs = std::filesystem;
namespace st = ddp::stores::detail;
using bytes = std::vector<std::byte>;

namespace {

fs::path root;

void write(const std::string& target, const std::string& name, std::span<const std::byte> data) {
  const fs::path dir = root / target;
  fs::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary)
      .write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
}
void write(const std::string& target, const std::string& name, std::string_view text) {
  write(target, name, ddp::as_bytes(text));
}

bytes frame_of(std::string_view payload) { return st::encode_frame(ddp::as_bytes(payload)); }

// Valid frames, and frames damaged in each way the decoder checks.
std::vector<std::pair<std::string, bytes>> frames() {
  std::vector<std::pair<std::string, bytes>> v;
  v.emplace_back("frame-empty", frame_of(""));
  v.emplace_back("frame-payload", frame_of("payload"));
  v.emplace_back("frame-100-bytes", frame_of(std::string(100, 'x')));
  v.emplace_back("frame-101-bytes", frame_of(std::string(101, 'y')));
  v.emplace_back("counter-0", st::encode_counter(0));
  v.emplace_back("counter-minus-1", st::encode_counter(-1));
  v.emplace_back("counter-max", st::encode_counter(std::numeric_limits<std::int64_t>::max()));
  auto b = frame_of("payload");
  b.resize(10);
  v.emplace_back("bad-truncated-header", b);
  b = frame_of("payload");
  b.pop_back();
  v.emplace_back("bad-truncated-payload", b);
  b = frame_of("payload");
  b.push_back(std::byte{0});
  v.emplace_back("bad-trailing-byte", b);
  b = frame_of("payload");
  b[0] = std::byte{'X'};
  v.emplace_back("bad-magic", b);
  b = frame_of("payload");
  b[4] = std::byte{2};
  v.emplace_back("bad-version", b);
  b = frame_of("payload");
  b.back() ^= std::byte{1};
  v.emplace_back("bad-checksum", b);
  b = frame_of("payload");
  st::put_u64(b.data() + 8, std::uint64_t{1} << 40);
  v.emplace_back("bad-huge-length", b);
  return v;
}

// RESP (the Redis protocol) encodings of the replies the store reads.
std::string bulk(std::string_view s) { return "$" + std::to_string(s.size()) + "\r\n" + std::string(s) + "\r\n"; }
std::string bulk(const bytes& b) { return bulk(std::string_view(reinterpret_cast<const char*>(b.data()), b.size())); }

bytes le64(std::int64_t v) {
  bytes b(8);
  st::put_u64(b.data(), static_cast<std::uint64_t>(v));
  return b;
}
bytes enroll_input(std::int64_t arrived_before, int max_members, std::string_view closed) {
  bytes b = le64(arrived_before);
  b.push_back(static_cast<std::byte>(max_members - 1));
  for (char c : closed) b.push_back(static_cast<std::byte>(c));
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: fuzz_make_corpus <corpus-dir>\n";
    return 2;
  }
  root = argv[1];

  // codec and file_store: stored value bytes.
  for (const auto& [name, b] : frames()) {
    write("codec", name, b);
    write("file_store", name, b);
  }
  for (int kind = 0xF0; kind <= 0xF4; ++kind) {
    const std::byte k{static_cast<unsigned char>(kind)};
    write("file_store", "entry-kind-" + std::to_string(kind), std::span<const std::byte>(&k, 1));
  }

  // member_list: `members/closed`.
  write("member_list", "one", st::encode_members({{0, "a"}}));
  write("member_list", "three-by-id", st::encode_members({{2, "host-a:0"}, {0, "host-b:0"}, {1, "host-c/1"}}));
  write("member_list", "empty", "");
  write("member_list", "bad-no-newline", "0 a");
  write("member_list", "bad-no-space", "0\n");
  write("member_list", "bad-index", "x a\n");
  write("member_list", "bad-id", "0 a b\n");

  // enroll: [arrivals counted][max_members - 1][members/closed].
  write("enroll", "first-alone", enroll_input(0, 1, ""));
  write("enroll", "fourth-of-four",
        enroll_input(3, 4, st::encode_members({{0, "a"}, {1, "b"}, {2, "c"}, {3, "fuzz-me"}})));
  write("enroll", "closed-without-me", enroll_input(2, 2, st::encode_members({{0, "a"}, {1, "b"}})));
  write("enroll", "not-closed-yet", enroll_input(1, 2, ""));

  // manager_records: "current" records and heartbeats.
  write("manager_records", "record-one", ddp::detail::encode_quorum_record({1, 0, {"replica-0"}}));
  write("manager_records", "record-three",
        ddp::detail::encode_quorum_record({7, 3, {"replica-0", "replica-1", "host:2"}}));
  write("manager_records", "heartbeat", std::to_string(std::int64_t{1700000000000}));
  write("manager_records", "heartbeat-0", "0");
  write("manager_records", "bad-record", "1 x");
  write("manager_records", "bad-heartbeat", "12ms");

  // redis_reply: server byte streams.
  write("redis_reply", "get-nil", "$-1\r\n");
  write("redis_reply", "get-value", bulk(frame_of("payload")));
  write("redis_reply", "get-counter", bulk("42") + bulk("-7") + "$-1\r\n");
  write("redis_reply", "integer", ":5\r\n:0\r\n");
  write("redis_reply", "status-and-error", "+OK\r\n-ERR value is not an integer or out of range\r\n");
  write("redis_reply", "scan-page", "*2\r\n" + bulk("17") + "*2\r\n" + bulk("v:job/a") + bulk("c:job/n"));
  write("redis_reply", "scan-last", "*2\r\n" + bulk("0") + "*0\r\n");
  write("redis_reply", "bad-frame", bulk(std::string("ddpv\x01garbage")));
  std::cout << "seed corpus written under " << root << "\n";
  return 0;
}
