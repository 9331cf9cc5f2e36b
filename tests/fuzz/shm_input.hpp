#pragma once
// Shared by the shm_descriptors fuzz target and the seed corpus generator: the call the target
// runs for a given selector byte, and the chunk descriptors an honest peer would publish for it
// (so that the seeds pass the engine's checks and the fuzzer starts from valid records).
//
// Input of shm_descriptors:
//   byte  0        selector (below)
//   bytes 1-4      header `aborted_by` (u32, host order), bytes 5-8 `abort_reason`
//   bytes 9-136    the peer's `desc[0]`, `desc[1]` exactly as it stores them (2 x 64 bytes)
//   bytes 137-176  optional: the segment header's first 40 bytes (magic, node_size, chunk_bytes,
//                  arena_bytes, total_bytes); absent: the valid header
// Missing bytes are zero.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include <ddp/dtype.hpp>
#include <ddp/reduce_op.hpp>
#include <ddp/shm/layout.hpp>
#include <ddp/shm/node_engine.hpp>

namespace fuzz::shm_input {

namespace shm = ddp::shm;

/// The decoded selector byte.
struct shape {
  shm::node_phase phase;  // allreduce, reduce_to_leader, broadcast (allreduce_single: small allreduce)
  int me;                 // this process's node rank (0 or 1); the peer is 1 - me
  bool zero_copy;         // this rank's tensor lies in its arena
  ddp::dtype type;
  std::size_t total;  // elements
};

inline constexpr std::size_t chunk_bytes = 4096;
inline constexpr std::size_t arena_bytes = 3 * 4096;
inline constexpr std::size_t single_phase_bytes = 1024;
inline constexpr std::uint64_t op_seq = 7;
inline constexpr std::size_t descriptors_at = 9;
inline constexpr std::size_t header_at = descriptors_at + 2 * sizeof(shm::chunk_descriptor);
inline constexpr std::size_t header_bytes = 40;

inline shm::segment_layout layout() { return shm::segment_layout(2, chunk_bytes, arena_bytes); }

// bits 0-1: phase (3 = small allreduce), bit 2: node rank, bit 3: zero copy, bits 4-5: dtype,
// bit 6: two chunks instead of one.
inline shape decode(std::uint8_t s) {
  static constexpr ddp::dtype types[] = {ddp::dtype::f32, ddp::dtype::f64, ddp::dtype::i32, ddp::dtype::u8};
  shape out{};
  const unsigned p = s & 3u;
  out.phase = p == 1   ? shm::node_phase::reduce_to_leader
              : p == 2 ? shm::node_phase::broadcast
                       : shm::node_phase::allreduce;
  out.me = (s >> 2) & 1;
  out.zero_copy = ((s >> 3) & 1) != 0;
  out.type = types[(s >> 4) & 3u];
  const std::size_t bytes = p == 3 ? 400 : ((s >> 6) & 1) != 0 ? 6000 : 2400;
  out.total = bytes / ddp::size_of(out.type);
  return out;
}

/// The descriptors (by parity) that node rank `q` publishes for `sh`, as node_engine writes them.
inline std::vector<shm::chunk_descriptor> descriptors(const shape& sh, int q) {
  const auto l = layout();
  const std::size_t esz = ddp::size_of(sh.type);
  const std::size_t per_chunk = chunk_bytes / esz;
  const bool single = sh.phase == shm::node_phase::allreduce && sh.total * esz <= single_phase_bytes;
  std::vector<shm::chunk_descriptor> out(2);
  std::size_t parity = 0;
  for (std::size_t first = 0; first < sh.total; first += per_chunk, ++parity) {
    auto& d = out[parity];
    d.op_seq = op_seq;
    d.first = first;
    d.count = std::min(per_chunk, sh.total - first);
    d.total = sh.total;
    d.type = static_cast<std::uint32_t>(sh.type);
    d.op = static_cast<std::uint32_t>(ddp::reduce_op::sum);
    d.phase = static_cast<std::uint32_t>(single ? shm::node_phase::allreduce_single : sh.phase);
    d.offset = l.slot(q, parity);
  }
  return out;
}

}  // namespace fuzz::shm_input
