#pragma once
/// @file manager/heal.hpp
/// @brief How a `Manager` (ddp/manager.hpp) moves the committed state to the members of a quorum
/// that are behind: the state tensors in transfers of up to a chunk (large ones sliced, small ones
/// coalesced) broadcast from the sources in turn, the scalars
/// and the sources' step, then a hash of the state allgathered to prove every member holds the
/// same bits. Host or device state (device state needs a communicator with a device queue). Not
/// for users; see docs/fault-tolerance.md ("The protocol", "Over NCCL").

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <span>
#include <string>
#include <vector>

#include <ddp/any_communicator.hpp>
#include <ddp/communicator.hpp>
#include <ddp/detail/device_buffer.hpp>
#include <ddp/detail/fnv1a.hpp>
#include <ddp/device_runtime.hpp>
#include <ddp/error.hpp>
#include <ddp/progress.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp::detail {

/// The state a Manager heals: its registered tensors and scalars (`transferable_state`).
struct state_view {
  std::span<const tensor_view> tensors;  ///< host or device tensors
  std::span<std::int64_t> scalars;       ///< host scalars
  /// Bytes of the tensors.
  [[nodiscard]] std::size_t tensor_bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& t : tensors) n += t.bytes();
    return n;
  }
};

/// A device state tensor without a device communicator to heal and hash it with. The same on
/// every attempt to form a quorum, so it ends the attempts at once.
class state_placement_error final : public usage_error {
 public:
  using usage_error::usage_error;
};

/// A device state tensor needs a device communicator: it is healed by the communicator's
/// collectives and read back for the hash through its device queue.
/// @throws state_placement_error naming the first device tensor, if `comm` has no device queue
inline void check_state_placement(std::span<const tensor_view> ts, const any_communicator& comm, int rank,
                                  std::uint64_t generation) {
  const auto on_device = std::find_if(ts.begin(), ts.end(), [](const tensor_view& t) { return !t.where.is_host(); });
  if (on_device == ts.end() || comm.device_queue().runtime != nullptr) return;
  throw state_placement_error(rank, "Manager quorum " + std::to_string(generation),
                              "state tensor " + std::to_string(on_device - ts.begin()) + " is on " +
                                  on_device->where.str() +
                                  ", but the communicator the factory built has no device queue (device_queue()) "
                                  "to heal and hash it with: build a device communicator, or register host tensors");
}

/// FNV-1a over the state's bytes, the scalars and `step`. Device tensors are copied to the host
/// first, `chunk_bytes` at a time, on `comm`'s device queue (after the healing broadcasts).
[[nodiscard]] inline std::uint64_t state_hash(const state_view& state, std::int64_t step, const any_communicator& comm,
                                              std::size_t chunk_bytes) {
  std::uint64_t h = fnv1a_offset_basis;
  std::vector<std::byte> host;
  for (const tensor_view& t : state.tensors) {
    if (t.where.is_host()) {
      h = fnv1a(std::span<const std::byte>(t.byte_data(), t.bytes()), h);
      continue;
    }
    const ddp::device_queue q = comm.device_queue();  // present: check_state_placement()
    const std::size_t chunk = std::max<std::size_t>(1, chunk_bytes);
    host.resize(std::min(chunk, t.bytes()));
    const device_event_owner done(*q.runtime, q.where);
    for (std::size_t off = 0; off < t.bytes(); off += chunk) {
      const std::size_t n = std::min(chunk, t.bytes() - off);
      const copy_region r{host.data(), t.byte_data() + off, n};
      q.runtime->copy(std::span<const copy_region>(&r, 1), q.stream);
      q.runtime->record(done.get(), q.stream);
      q.runtime->synchronize(done.get());
      h = fnv1a(std::span<const std::byte>(host.data(), n), h);
    }
  }
  h = fnv1a(std::as_bytes(state.scalars), h);
  return fnv1a_object(step, h);
}

/// Broadcasts the state of `step` from `sources` to every member of `comm` in transfers of at
/// most `chunk_bytes`: a larger tensor in slices, runs of smaller ones of one placement together
/// (one coalesced broadcast, not one per tensor: 4096 small tensors cost a few calls), transfer k
/// from sources[k % sources], so the sending load is spread, all in flight at once; then the
/// scalars and the step from the first source. Up-to-date members receive bytes identical to
/// their own. Collective. Returns the tensor bytes moved; `meter` counts them as they arrive.
/// @throws communication_error if a transfer fails, or the sources sent another step
inline std::size_t broadcast_state(any_communicator& comm, const state_view& state, const std::vector<int>& sources,
                                   std::int64_t step, std::size_t chunk_bytes, progress_meter& meter, int rank) {
  const std::size_t limit = std::max<std::size_t>(1, chunk_bytes);
  std::size_t moved = 0;
  std::vector<work> transfers;
  std::deque<std::vector<tensor_view>> groups(1);  // alive until the transfers completed
  std::size_t group_bytes = 0;
  auto send = [&] {
    if (groups.back().empty()) return;
    const int root = sources[(groups.size() - 1) % sources.size()];
    transfers.push_back(
        comm.broadcast(std::span<const tensor_view>(groups.back()), root).then([&meter, n = group_bytes] {
          meter.add_bytes(n);
        }));
    moved += group_bytes;
    groups.emplace_back();
    group_bytes = 0;
  };
  for (const auto& t : state.tensors) {
    if (t.count == 0) continue;
    const bool other_placement = !groups.back().empty() && groups.back().front().where != t.where;
    if (other_placement || group_bytes + t.bytes() > limit) send();
    if (t.bytes() <= limit) {
      groups.back().push_back(t);
      group_bytes += t.bytes();
      continue;
    }
    const std::size_t per_chunk = std::max<std::size_t>(1, limit / size_of(t.type));
    for (std::size_t off = 0; off < t.count; off += per_chunk) {
      const tensor_view slice = t.slice(off, std::min(per_chunk, t.count - off));
      groups.back().push_back(slice);
      group_bytes += slice.bytes();
      send();
    }
  }
  send();
  work::wait_all(transfers);  // round-robin, one deadline, an error naming the first pending chunk
  std::vector<std::int64_t> scalars(state.scalars.begin(), state.scalars.end());
  scalars.push_back(step);
  communicator_ref(comm).broadcast(scalars, sources.front()).wait();
  std::copy(scalars.begin(), scalars.end() - 1, state.scalars.begin());
  if (scalars.back() != step) {
    throw communication_error(
        rank, "Manager healing",
        "the sources sent step " + std::to_string(scalars.back()) + ", expected " + std::to_string(step));
  }
  return moved;
}

/// Proof that every member of `comm` (named by `members`, in rank order) now holds the same
/// state, the sources' (hashed at the sources' `step`): one allgather of state hashes. Collective.
/// @throws communication_error naming a member whose hash differs
inline void check_same_state(any_communicator& comm, const state_view& state, std::int64_t step,
                             std::size_t chunk_bytes, const std::vector<std::string>& members, int rank) {
  std::vector<std::int64_t> h{static_cast<std::int64_t>(state_hash(state, step, comm, chunk_bytes))};
  std::vector<std::int64_t> all(members.size());
  comm.allgather(view(h), view(all)).wait();
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (all[r] != h[0]) {
      throw communication_error(rank, "Manager healing",
                                "replica " + members[r] + " holds a different state after healing");
    }
  }
}

}  // namespace ddp::detail
