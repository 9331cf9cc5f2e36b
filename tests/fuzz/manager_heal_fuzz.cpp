// Fuzz target: the receiving side of Manager healing (ddp/manager/heal.hpp), whose bytes another
// process sent: the state broadcast in coalesced or sliced transfers, the scalars and the
// sources' step, and the state hashes every member contributes. A scripted communicator plays
// this rank (rank 1 of 2); everything rank 0 "sends" comes from the input.
// Input: byte 0 = tensor count (0-7), then per tensor 2 bytes (dtype index, element count 0-255),
// 2 bytes of chunk size (1-65536), 1 byte scalar count (0-3), then the stream the peer sends.
//
// Properties: no crash or UB; every byte of every state tensor is written exactly once, in
// transfers of at most the chunk size (a tensor larger than a chunk in slices, smaller ones
// coalesced), and the bytes moved are the state's; healing fails with communication_error
// exactly when the step the peer sent differs from the plan's; the state check fails exactly
// when the peer's hash word differs from this rank's hash of what it received.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include <ddp/any_communicator.hpp>
#include <ddp/manager/heal.hpp>

#include "fuzz_check.hpp"

namespace {

/// The peer's bytes, handed out in order (zeros once the input runs out).
struct peer_stream {
  std::span<const std::uint8_t> data;
  std::size_t at = 0;
  void fill(std::byte* out, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<std::byte>(at < data.size() ? data[at++] : 0);
  }
};

/// Rank 1 of 2: receives every broadcast from rank 0 and rank 0's allgather block from the stream.
class scripted_peer {
 public:
  scripted_peer(peer_stream& in, std::vector<int>& writes, std::vector<std::byte*>& bases,
                std::size_t& largest_transfer)
      : in_(&in), writes_(&writes), bases_(&bases), largest_(&largest_transfer) {}
  int rank() const { return 1; }
  int size() const { return 2; }
  ddp::work allreduce(std::span<const ddp::tensor_view>, ddp::reduce_op) { return ddp::work::ready(); }
  ddp::work broadcast(std::span<const ddp::tensor_view> ts, int root) {
    FUZZ_CHECK(root == 0);
    std::size_t bytes = 0;  // of state tensors (not the scalars' broadcast)
    for (const auto& t : ts) {
      in_->fill(t.byte_data(), t.bytes());
      if (note_writes(t.byte_data(), t.bytes())) bytes += t.bytes();
    }
    *largest_ = std::max(*largest_, bytes);
    return ddp::work::ready();
  }
  ddp::work allgather(ddp::tensor_view in, ddp::tensor_view out) {
    FUZZ_CHECK(out.bytes() == 2 * in.bytes());
    in_->fill(out.byte_data(), in.bytes());
    std::memcpy(out.byte_data() + in.bytes(), in.byte_data(), in.bytes());
    return ddp::work::ready();
  }
  ddp::work reduce_scatter(ddp::tensor_view, ddp::tensor_view, ddp::reduce_op) { return ddp::work::ready(); }
  ddp::work barrier() { return ddp::work::ready(); }
  void abort() noexcept {}

 private:
  // Counts writes per state byte (`bases_` holds each tensor's start; `writes_` is laid out the same).
  bool note_writes(std::byte* p, std::size_t n) {
    for (std::size_t t = 0, offset = 0; t + 1 < bases_->size(); ++t) {
      const std::size_t len = static_cast<std::size_t>((*bases_)[t + 1] - (*bases_)[t]);
      if (len > 0 && p >= (*bases_)[t] && p < (*bases_)[t] + len) {
        const auto first = offset + static_cast<std::size_t>(p - (*bases_)[t]);
        for (std::size_t i = 0; i < n; ++i) ++(*writes_)[first + i];
        return true;
      }
      offset += len;
    }
    return false;
  }
  peer_stream* in_;
  std::vector<int>* writes_;
  std::vector<std::byte*>* bases_;
  std::size_t* largest_;
};

constexpr ddp::dtype types[] = {ddp::dtype::f32, ddp::dtype::f64, ddp::dtype::i64, ddp::dtype::bf16, ddp::dtype::u8};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 4) return 0;
  std::size_t at = 0;
  const std::size_t ntensors = data[at++] % 8;
  if (size < at + 2 * ntensors + 3) return 0;
  // All state tensors live in one buffer, back to back, so that writes can be counted per byte.
  std::vector<ddp::dtype> dtypes;
  std::vector<std::size_t> counts;
  std::size_t total = 0;
  for (std::size_t i = 0; i < ntensors; ++i) {
    dtypes.push_back(types[data[at++] % std::size(types)]);
    counts.push_back(data[at++]);
    total += counts.back() * ddp::size_of(dtypes.back());
  }
  const std::size_t chunk = 1 + ((std::size_t{data[at]} << 8 | data[at + 1]) % 65536);
  at += 2;
  const std::size_t nscalars = data[at++] % 4;
  std::vector<std::byte> storage(total + 8);
  std::vector<ddp::tensor_view> tensors;
  std::vector<std::byte*> bases;
  std::size_t offset = 0;
  for (std::size_t i = 0; i < ntensors; ++i) {
    bases.push_back(storage.data() + offset);
    tensors.push_back(ddp::tensor_view{.data = storage.data() + offset, .count = counts[i], .type = dtypes[i]});
    offset += counts[i] * ddp::size_of(dtypes[i]);
  }
  bases.push_back(storage.data() + offset);
  std::vector<std::int64_t> scalars(nscalars, 5);
  peer_stream peer{std::span(data + at, size - at)};
  std::vector<int> writes(total, 0);
  std::size_t largest = 0;
  ddp::any_communicator comm(scripted_peer(peer, writes, bases, largest));
  const ddp::detail::state_view state{tensors, scalars};
  ddp::progress_meter meter(nullptr, "Manager healing", 1);
  constexpr std::int64_t step = 42;
  // The words the peer sends after the state: the scalars, then its step.
  std::vector<std::int64_t> sent(nscalars + 1, 0);
  peer_stream ahead = peer;
  ahead.at += total;
  ahead.fill(reinterpret_cast<std::byte*>(sent.data()), sent.size() * sizeof(std::int64_t));
  bool healed = false;
  try {
    const std::size_t moved = ddp::detail::broadcast_state(comm, state, {0}, step, chunk, meter, 1);
    FUZZ_CHECK(moved == total);
    healed = true;
  } catch (const ddp::communication_error&) {
  }
  for (int w : writes) FUZZ_CHECK(w == 1);
  FUZZ_CHECK(largest <= std::max(chunk, std::size_t{8}));  // a slice holds at least one element
  FUZZ_CHECK(healed == (sent.back() == step));
  FUZZ_CHECK(std::equal(scalars.begin(), scalars.end(), sent.begin()));
  if (!healed) return 0;
  const std::uint64_t own = ddp::detail::state_hash(state, step, comm, chunk);
  std::int64_t sent_hash = 0;
  peer_stream copy = peer;
  copy.fill(reinterpret_cast<std::byte*>(&sent_hash), sizeof(sent_hash));
  bool same = true;
  try {
    ddp::detail::check_same_state(comm, state, step, chunk, {"source", "me"}, 1);
  } catch (const ddp::communication_error&) {
    same = false;
  }
  FUZZ_CHECK(same == (static_cast<std::uint64_t>(sent_hash) == own));
  return 0;
}
