// Fuzz target: what a peer on the same node writes into the shared segment and another rank
// reads: the segment header (checked by `segment_layout::check` when a rank maps the segment),
// the abort word, and the chunk descriptors of its control record (`node_engine`, shm/
// node_engine.hpp). One node of two ranks over private memory: this process runs node rank
// `me`'s engine; the peer is simulated, its counters say it finished every step, its descriptors
// and the header come from the input (layout: shm_input.hpp). Nothing waits.
//
// Properties: a header other than the one this rank would write is a usage_error; then the
// allreduce completes, or fails with a communication_error (mismatch_error for a descriptor of
// another call, plain for an aborted segment or an offset outside the peer's memory): no read or
// write outside the segment (ASan), no UB, no other exception. When it completes, the peer's
// descriptors were the ones an honest peer writes, apart from the offset, which lay in the
// peer's slot or arena.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <ddp/error.hpp>
#include <ddp/shm/layout.hpp>
#include <ddp/shm/node_engine.hpp>
#include <ddp/shm/tensor_group.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

#include "fuzz_check.hpp"
#include "shm_input.hpp"

namespace shm = ddp::shm;
namespace in = fuzz::shm_input;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  std::vector<std::uint8_t> input(data, data + size);
  if (input.size() < in::header_at) input.resize(in::header_at);  // missing bytes are zero
  const in::shape sh = in::decode(input[0]);
  const int peer = 1 - sh.me;
  const auto l = in::layout();

  // Exactly the segment's size, so ASan sees any access past it.
  auto* base = static_cast<std::byte*>(std::aligned_alloc(shm::page_bytes, l.total_bytes()));
  FUZZ_CHECK(base != nullptr);
  std::memset(base, 0, l.total_bytes());
  l.initialise(base);
  if (input.size() >= in::header_at + in::header_bytes) {
    std::memcpy(base, input.data() + in::header_at, in::header_bytes);
    try {
      l.check(base, sh.me);
    } catch (const ddp::usage_error&) {
      std::free(base);
      return 0;
    }
  }
  auto* h = reinterpret_cast<shm::segment_header*>(base);
  std::memcpy(&h->aborted_by, input.data() + 1, 4);
  std::memcpy(&h->abort_reason, input.data() + 5, 4);
  auto& pc = *reinterpret_cast<shm::rank_control*>(base + l.control(peer));
  pc.staged = pc.reduced = pc.copied = std::uint64_t{1} << 40;
  std::memcpy(&pc.desc[0], input.data() + in::descriptors_at, 2 * sizeof(shm::chunk_descriptor));

  // This rank's tensor: private memory, or the start of its arena (zero copy).
  const std::size_t bytes = sh.total * ddp::size_of(sh.type);
  std::vector<std::byte> own(bytes);
  shm::tensor_group g;
  g.type = sh.type;
  if (sh.zero_copy) {
    g.add(ddp::tensor_view{base + l.arena(sh.me), sh.total, sh.type});
    g.zero_copy_offset = l.arena(sh.me);
  } else {
    g.add(ddp::tensor_view{own.data(), sh.total, sh.type});
  }
  ddp::op_info info;
  info.rank = sh.me;
  info.name = "allreduce";
  info.seq = in::op_seq;
  info.type = sh.type;
  info.count = sh.total;
  info.timeout = std::chrono::milliseconds(1000);

  shm::node_engine engine(base, l, sh.me, {0, 1}, 0, in::single_phase_bytes);
  bool done = false;
  try {
    engine.run(sh.phase, g, 0, ddp::reduce_op::sum, 1, info, ddp::clock::now() + std::chrono::seconds(5));
    done = true;
  } catch (const ddp::mismatch_error&) {
  } catch (const ddp::timeout_error&) {
    FUZZ_CHECK(false);  // nothing waits: the peer's counters are past every chunk
  } catch (const ddp::communication_error&) {
  }
  if (done) {
    const bool reads_peer = !(sh.phase == shm::node_phase::broadcast && sh.me == 0);
    const auto honest = in::descriptors(sh, peer);
    const std::size_t chunks = (bytes + in::chunk_bytes - 1) / in::chunk_bytes;
    for (std::size_t p = 0; reads_peer && p < chunks; ++p) {
      const shm::chunk_descriptor& d = pc.desc[p];
      FUZZ_CHECK(h->aborted_by == 0);
      FUZZ_CHECK(d.op_seq == honest[p].op_seq && d.first == honest[p].first && d.count == honest[p].count &&
                 d.total == honest[p].total && d.type == honest[p].type && d.phase == honest[p].phase);
      FUZZ_CHECK(l.in_own_region(peer, p, d.offset, static_cast<std::size_t>(d.count) * ddp::size_of(sh.type)));
    }
  }
  std::free(base);
  return 0;
}
