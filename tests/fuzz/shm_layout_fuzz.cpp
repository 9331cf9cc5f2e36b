// Fuzz target: the layout arithmetic of a node's segment (`segment_layout`, shm/layout.hpp)
// from options a caller passes, and the check of a peer's chunk descriptor against it
// (`in_own_region`). Input layout (little endian, missing bytes zero):
//   bytes 0-1    node_size (u16; 0 included)        bytes 2-9    chunk_bytes (u64)
//   bytes 10-17  arena_bytes (u64)                  byte  18     q (mod node_size), parity (bit 7)
//   bytes 19-26  a descriptor's offset (u64)        bytes 27-34  the bytes it would cover (u64)
//
// Properties: the layout is a usage_error naming the option, or every region is in bounds:
// pages aligned, header < control records < staging slots < arenas, in that order without
// overlap, the last arena ending at total_bytes <= max_total_bytes, chunk >= the option (and
// 4 KiB). A descriptor that passes `in_own_region` covers only the slot or arena of its rank.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include <ddp/error.hpp>
#include <ddp/shm/layout.hpp>

#include "fuzz_check.hpp"

namespace shm = ddp::shm;

namespace {

std::uint64_t le(const std::uint8_t* p, std::size_t n) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < n; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::uint8_t in[35] = {};
  std::memcpy(in, data, size < sizeof in ? size : sizeof in);
  const int n = static_cast<int>(le(in, 2));
  const std::size_t chunk = le(in + 2, 8);
  const std::size_t arena = le(in + 10, 8);
  shm::segment_layout l;
  try {
    l = shm::segment_layout(n, chunk, arena, 4);
  } catch (const ddp::usage_error& e) {
    const std::string what = e.what();
    FUZZ_CHECK(what.find("rank 4") != std::string::npos);
    FUZZ_CHECK(n < 1 || what.find("options::chunk_bytes") != std::string::npos ||
               what.find("options::arena_bytes") != std::string::npos || what.find("node size") != std::string::npos);
    return 0;
  }
  const std::size_t page = shm::page_bytes;
  FUZZ_CHECK(n >= 1 && l.node_size() == n);
  FUZZ_CHECK(l.chunk_bytes() >= chunk && l.chunk_bytes() >= page && l.chunk_bytes() % page == 0);
  FUZZ_CHECK(l.arena_bytes() >= arena && l.arena_bytes() % page == 0 && l.arena_bytes() - arena < page);
  FUZZ_CHECK(l.total_bytes() <= shm::segment_layout::max_total_bytes);
  FUZZ_CHECK(l.control(0) >= sizeof(shm::segment_header) && l.control(0) % shm::line_bytes == 0);
  const int last = n - 1;
  FUZZ_CHECK(l.control(last) + sizeof(shm::rank_control) <= l.slot(0, 0));
  FUZZ_CHECK(l.slot(0, 0) % page == 0 && l.slot(0, 1) == l.slot(0, 0) + l.chunk_bytes());
  FUZZ_CHECK(l.slot(last, 1) + l.chunk_bytes() == l.arena(0));
  FUZZ_CHECK(l.arena(last) + l.arena_bytes() == l.total_bytes());
  FUZZ_CHECK(l.arena(last) >= l.arena(0) && l.slot(last, 1) >= l.slot(0, 0));

  const int q = static_cast<int>(in[18] & 0x7f) % n;
  const std::size_t parity = in[18] >> 7;
  const std::uint64_t offset = le(in + 19, 8);
  const std::size_t bytes = le(in + 27, 8);
  if (l.in_own_region(q, parity, offset, bytes)) {
    const bool in_slot = offset == l.slot(q, parity) && bytes <= l.chunk_bytes();
    const bool in_arena = offset >= l.arena(q) && offset <= l.arena(q) + l.arena_bytes() &&
                          bytes <= l.arena(q) + l.arena_bytes() - offset;
    FUZZ_CHECK(in_slot || in_arena);
    FUZZ_CHECK(offset <= l.total_bytes() && bytes <= l.total_bytes() - offset);
  }
  return 0;
}
