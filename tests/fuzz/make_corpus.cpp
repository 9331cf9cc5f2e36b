// Writes the seed corpus of every fuzz target with the library's own encoders:
//   fuzz_make_corpus <dir>        (normally tests/fuzz/corpus; creates <dir>/<target>/<seed>)
// Seeds are a few small valid values and a few damaged ones, so that each fuzzer starts from
// inputs that pass its decoder's checks (a checksum is hard to guess) and from the ways they fail.
// Crash inputs found by fuzzing are kept beside them (named regression-*) and are not written here.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iostream>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/checkpoint/format.hpp>
#include <ddp/manager/exchange.hpp>
#include <ddp/manager/record.hpp>
#include <ddp/shm/layout.hpp>
#include <ddp/shm/posix_segment.hpp>
#include <ddp/store.hpp>
#include <ddp/stores/codec.hpp>
#include <ddp/stores/membership.hpp>

#include "shm_input.hpp"

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

// shm_layout, shm_names, shm_descriptors: the bytes shm/layout.hpp, shm/posix_segment.hpp and
// shm/node_engine.hpp read (input layouts in the targets' comments and shm_input.hpp).
void put_le(bytes& b, std::uint64_t v, int n) {
  for (int i = 0; i < n; ++i) b.push_back(static_cast<std::byte>(v >> (8 * i)));
}
template <class T>
void put_raw(bytes& b, const T& v) {
  const auto* p = reinterpret_cast<const std::byte*>(&v);
  b.insert(b.end(), p, p + sizeof v);
}

void shm_seeds() {
  namespace shm = ddp::shm;
  namespace in = fuzz::shm_input;
  const auto layout_input = [](std::uint64_t n, std::uint64_t chunk, std::uint64_t arena, std::uint8_t q,
                               std::uint64_t offset, std::uint64_t len) {
    bytes b;
    put_le(b, n, 2);
    put_le(b, chunk, 8);
    put_le(b, arena, 8);
    put_le(b, q, 1);
    put_le(b, offset, 8);
    put_le(b, len, 8);
    return b;
  };
  const shm::segment_layout l2(2, 4096, 8192);
  const auto max = std::numeric_limits<std::uint64_t>::max();
  write("shm_layout", "two-ranks-slot", layout_input(2, 4096, 8192, 1, l2.slot(1, 0), 4096));
  write("shm_layout", "two-ranks-arena", layout_input(2, 4096, 8192, 0x81, l2.arena(1) + 256, 1024));
  write("shm_layout", "defaults-8-ranks", layout_input(8, 256 << 10, 256 << 20, 3, 0, 0));
  write("shm_layout", "bad-chunk-max", layout_input(2, max, 0, 0, 0, 0));
  write("shm_layout", "bad-chunk-wraps-to-0", layout_input(2, max - 100, 0, 0, 0, 0));
  write("shm_layout", "bad-chunk-2-61", layout_input(4, std::uint64_t{1} << 61, 0, 0, 0, 0));
  write("shm_layout", "bad-arena-max", layout_input(2, 4096, max, 0, 0, 0));
  write("shm_layout", "bad-node-size-0", layout_input(0, 4096, 0, 0, 0, 0));
  write("shm_layout", "bad-offset-past-end", layout_input(2, 4096, 8192, 1, l2.total_bytes() - 16, 4096));

  using record = shm::detail::posix_setup_record;
  const auto records = [](std::initializer_list<record> rs) {
    bytes b;
    for (const auto& r : rs) put_raw(b, r);
    return b;
  };
  record named, plain, failed, bad;
  std::snprintf(named.name, sizeof named.name, "%s", "/ddp-shm-1f2e-0-0123456789abcdef");
  failed.failed = static_cast<std::int32_t>(shm::posix_segment::step::fallocate);
  failed.error = 28;  // ENOSPC
  write("shm_names", "leader-and-one", records({named, plain}));
  write("shm_names", "two-nodes", records({named, plain, named, plain}));
  write("shm_names", "fallocate-failed", records({failed, plain, plain}));
  bad = plain;
  bad.failed = static_cast<std::int32_t>(shm::posix_segment::step::config_mismatch);
  write("shm_names", "options-differ", records({plain, bad}));
  bad = named;
  std::snprintf(bad.name, sizeof bad.name, "%s", "/ddp-shm-../../dev/zero");
  write("shm_names", "bad-name-path", records({bad, plain}));
  bad = named;
  std::memset(bad.name, 'a', sizeof bad.name);
  write("shm_names", "bad-name-unterminated", records({bad, plain}));
  bad = plain;
  bad.failed = 1000;
  write("shm_names", "bad-step", records({plain, bad}));

  // shm_descriptors: an honest peer's descriptors for several calls (some with the header too),
  // then damaged ones.
  for (const int sel : {0x00, 0x40, 0x44, 0x03, 0x07, 0x01, 0x45, 0x02, 0x46, 0x48, 0x4d, 0x5c, 0x60, 0x70}) {
    const auto sh = in::decode(static_cast<std::uint8_t>(sel));
    bytes b{static_cast<std::byte>(sel)};
    put_le(b, 0, 8);  // not aborted
    for (const auto& d : in::descriptors(sh, 1 - sh.me)) put_raw(b, d);
    char name[32];
    std::snprintf(name, sizeof name, "call-%02x", sel);
    write("shm_descriptors", name, b);
    if (sel == 0x40 || sel == 0x46) {
      std::vector<std::byte> seg(4096);
      in::layout().initialise(seg.data());
      b.insert(b.end(), seg.begin(), seg.begin() + in::header_bytes);
      write("shm_descriptors", std::string(name) + "-header", b);
      b[in::header_at] ^= std::byte{1};
      write("shm_descriptors", std::string(name) + "-bad-magic", b);
    }
  }
  using descs = std::vector<shm::chunk_descriptor>;
  const auto damaged = [](const char* name, int sel, auto change) {
    const auto sh = in::decode(static_cast<std::uint8_t>(sel));
    descs ds = in::descriptors(sh, 1 - sh.me);
    std::uint32_t aborted = 0;
    change(ds, aborted);
    bytes b{static_cast<std::byte>(sel)};
    put_le(b, aborted, 4);
    put_le(b, 1, 4);
    for (const auto& d : ds) put_raw(b, d);
    write("shm_descriptors", name, b);
  };
  const auto l = in::layout();
  damaged("bad-offset-end", 0x40, [&](descs& ds, std::uint32_t&) { ds[1].offset = l.total_bytes() - 16; });
  damaged("bad-offset-huge", 0x00, [&](descs& ds, std::uint32_t&) { ds[0].offset = std::uint64_t{1} << 63; });
  damaged("bad-offset-other-rank", 0x00, [&](descs& ds, std::uint32_t&) { ds[0].offset = l.slot(0, 0); });
  damaged("bad-offset-control", 0x06, [&](descs& ds, std::uint32_t&) { ds[0].offset = l.control(0); });
  damaged("bad-other-call", 0x00, [&](descs& ds, std::uint32_t&) { ds[0].op_seq += 1; });
  damaged("bad-count", 0x44, [&](descs& ds, std::uint32_t&) { ds[1].count = 1 << 30; });
  damaged("aborted", 0x00, [&](descs&, std::uint32_t& a) { a = 2; });
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
  {  // a 256-byte key's value file (hashed name): the key, a newline, the frame; as in file_store_fuzz.cpp
    const std::string key = "job/" + std::string(ddp::max_key_bytes - 4, 'k');
    const auto frame = st::encode_frame(ddp::as_bytes("value of a long key"));
    write("file_store", "long-key-value",
          key + "\n" + std::string(reinterpret_cast<const char*>(frame.data()), frame.size()));
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

  // manager_exchange: member count, the latest formed generation, step limit, then each member's report.
  const auto exchange = [](std::uint8_t mask, std::int64_t limit, const std::vector<ddp::detail::member_report>& rs) {
    bytes b{static_cast<std::byte>(rs.size() - 1), static_cast<std::byte>(mask)};
    const auto put = [&b](std::int64_t v) {
      const bytes w = le64(v);
      b.insert(b.end(), w.begin(), w.end());
    };
    put(limit);
    for (const auto& r : rs) {
      for (std::int64_t w : r.encode()) put(w);
    }
    return b;
  };
  using report = ddp::detail::member_report;
  write(
      "manager_exchange", "start-3-fresh",
      exchange(0, 1024, {report{0, 0, 77, 4096, false}, report{0, 0, 77, 4096, false}, report{0, 0, 77, 4096, false}}));
  write(
      "manager_exchange", "three-up-to-date",
      exchange(4, 1024, {report{5, 4, 77, 4096, false}, report{5, 4, 77, 4096, false}, report{4, 4, 77, 4096, false}}));
  write(
      "manager_exchange", "one-joins",
      exchange(4, 1024, {report{9, 4, 77, 4096, false}, report{9, 4, 77, 4096, false}, report{0, 0, 77, 4096, false}}));
  write("manager_exchange", "layout-differs",
        exchange(4, 1024, {report{3, 4, 77, 4096, false}, report{3, 4, 78, 4096, false}}));
  write("manager_exchange", "rules-differ",
        exchange(4, 1024, {report{3, 4, 77, 4096, false, 1}, report{3, 4, 77, 4096, false, 5}}));
  write("manager_exchange", "ahead-of-limit",
        exchange(4, 10, {report{11, 4, 77, 4096, false}, report{3, 4, 77, 4096, false}}));
  write("manager_exchange", "part-healed",
        exchange(4, 1024, {report{6, 4, 77, 64, false}, report{6, 4, 77, 64, true}, report{6, 4, 77, 64, false}}));
  // manager_heal: tensors (dtype index, count), chunk size, scalar count, then what the source
  // sends: the state bytes, the scalars and its step (42 is the plan's; 41 is a wrong one).
  const auto heal = [](const std::vector<std::pair<int, int>>& tensors, int chunk, int scalars, std::int64_t step) {
    static constexpr std::size_t element_bytes[] = {4, 8, 8, 2, 1};  // f32, f64, i64, bf16, u8
    bytes b{static_cast<std::byte>(tensors.size())};
    std::size_t state = 0;
    for (const auto& [type, count] : tensors) {
      b.push_back(static_cast<std::byte>(type));
      b.push_back(static_cast<std::byte>(count));
      state += element_bytes[type] * static_cast<std::size_t>(count);
    }
    b.push_back(static_cast<std::byte>((chunk - 1) >> 8));
    b.push_back(static_cast<std::byte>((chunk - 1) & 0xff));
    b.push_back(static_cast<std::byte>(scalars));
    for (std::size_t i = 0; i < state; ++i) b.push_back(static_cast<std::byte>(i * 7));
    for (int i = 0; i < scalars; ++i) {
      const bytes w = le64(1000 + i);
      b.insert(b.end(), w.begin(), w.end());
    }
    const bytes w = le64(step);
    b.insert(b.end(), w.begin(), w.end());
    return b;
  };
  write("manager_heal", "three-tensors-coalesced", heal({{0, 10}, {1, 3}, {4, 200}}, 4096, 2, 42));
  write("manager_heal", "sliced-small-chunk", heal({{0, 100}, {3, 7}}, 24, 1, 42));
  write("manager_heal", "empty-tensors", heal({{0, 0}, {2, 5}, {4, 0}}, 16, 0, 42));
  write("manager_heal", "wrong-step", heal({{1, 9}}, 8, 3, 41));

  // checkpoint: whole files as checkpoint_dir::save writes them.
  const auto checkpoint = [](std::int64_t step, std::vector<ddp::detail::checkpoint_format::tensor_entry> ts,
                             std::vector<std::int64_t> scalars) {
    namespace f = ddp::detail::checkpoint_format;
    std::vector<std::byte> b = f::encode_header(step, ts, scalars);
    for (const auto& t : ts) {
      for (std::size_t i = 0; i < t.count * ddp::size_of(t.type); ++i) b.push_back(static_cast<std::byte>(i * 7));
    }
    const std::uint64_t sum = f::checksum(b);
    f::put(b, sum);
    return std::string(reinterpret_cast<const char*>(b.data()), b.size());
  };
  write("checkpoint", "two-tensors", checkpoint(15, {{ddp::dtype::f64, 5}, {ddp::dtype::f32, 3}}, {7, -1}));
  write("checkpoint", "empty-state", checkpoint(0, {}, {}));
  write("checkpoint", "zero-count", checkpoint(3, {{ddp::dtype::bf16, 0}, {ddp::dtype::i64, 2}}, {}));

  // redis_reply: server byte streams.
  write("redis_reply", "get-nil", "$-1\r\n");
  write("redis_reply", "get-value", bulk(frame_of("payload")));
  write("redis_reply", "get-counter", bulk("42") + bulk("-7") + "$-1\r\n");
  write("redis_reply", "integer", ":5\r\n:0\r\n");
  write("redis_reply", "status-and-error", "+OK\r\n-ERR value is not an integer or out of range\r\n");
  write("redis_reply", "scan-page", "*2\r\n" + bulk("17") + "*2\r\n" + bulk("v:job/a") + bulk("c:job/n"));
  write("redis_reply", "scan-last", "*2\r\n" + bulk("0") + "*0\r\n");
  write("redis_reply", "bad-frame", bulk(std::string("ddpv\x01garbage")));
  shm_seeds();
  std::cout << "seed corpus written under " << root << "\n";
  return 0;
}
