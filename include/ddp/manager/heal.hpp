#pragma once
/// @file manager/heal.hpp
/// @brief How a `Manager` (ddp/manager.hpp) moves the committed state to the members of a quorum
/// that are behind: the state tensors in transfers of up to a chunk (large ones sliced, small ones
/// coalesced) broadcast from all sources at once (transfer k from source k mod sources), all in
/// flight together; each member hashes every transfer as it lands (XXH64); then the scalars and
/// the sources' step, and the state hashes allgathered to prove every member holds the same bits.
/// Host or device state (device state needs a communicator with a device queue). Not for users;
/// see docs/fault-tolerance.md ("The protocol", "Over NCCL").

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <ddp/any_communicator.hpp>
#include <ddp/communicator.hpp>
#include <ddp/detail/device_buffer.hpp>
#include <ddp/device_runtime.hpp>
#include <ddp/error.hpp>
#include <ddp/progress.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>
#include <ddp/detail/xxh64.hpp>

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

/// A replica with a device queue (`manager_options::device_queue`) needs each quorum's
/// communicator on that stream and device: its Bucketer's device buckets and events live there.
/// @throws state_placement_error naming both queues, if the communicator runs elsewhere
inline void check_device_queue(const device_queue& replica, const any_communicator& comm, int rank,
                               std::uint64_t generation) {
  if (replica.runtime == nullptr) return;
  const device_queue built = comm.device_queue();
  if (built.runtime != nullptr && built.stream == replica.stream && built.where == replica.where &&
      built.runtime->name() == replica.runtime->name()) {
    return;
  }
  const std::string got =
      built.runtime == nullptr
          ? std::string("has no device queue (host collectives)")
          : "runs on " + std::string(built.runtime->name()) + " " + built.where.str() +
                (built.stream == replica.stream ? std::string(", the same stream") : std::string(", another stream"));
  throw state_placement_error(rank, "Manager quorum " + std::to_string(generation),
                              "manager_options::device_queue names a stream of " +
                                  std::string(replica.runtime->name()) + " on " + replica.where.str() +
                                  ", but the communicator the factory built " + got +
                                  ": build each quorum's communicator on the replica's stream (nccl: "
                                  "manager_factory(replica_stream, ...); the emulated device: options::stream)");
}

/// The state's transfers, in order: tensors of up to `chunk_bytes` (a larger one in slices of at
/// most `chunk_bytes`, at least one element), runs of smaller ones of one placement coalesced
/// into one transfer. Empty tensors move nothing. The same on every member (same state layout,
/// same `heal_chunk_bytes`), which is what lets each member hash transfer by transfer.
[[nodiscard]] inline std::vector<std::vector<tensor_view>> plan_transfers(std::span<const tensor_view> tensors,
                                                                          std::size_t chunk_bytes) {
  const std::size_t limit = std::max<std::size_t>(1, chunk_bytes);
  std::vector<std::vector<tensor_view>> groups(1);
  std::size_t group_bytes = 0;
  auto close = [&] {
    if (groups.back().empty()) return;
    groups.emplace_back();
    group_bytes = 0;
  };
  for (const auto& t : tensors) {
    if (t.count == 0) continue;
    const bool other_placement = !groups.back().empty() && groups.back().front().where != t.where;
    if (other_placement || group_bytes + t.bytes() > limit) close();
    if (t.bytes() <= limit) {
      groups.back().push_back(t);
      group_bytes += t.bytes();
      continue;
    }
    const std::size_t per_chunk = std::max<std::size_t>(1, limit / size_of(t.type));
    for (std::size_t off = 0; off < t.count; off += per_chunk) {
      groups.back().push_back(t.slice(off, std::min(per_chunk, t.count - off)));
      close();
    }
  }
  if (groups.back().empty()) groups.pop_back();
  return groups;
}

/// Hashes one transfer's bytes (XXH64, each tensor continuing from the previous one's hash):
/// host bytes where they lie, device bytes copied to the host first on `comm`'s device queue
/// (behind the healing broadcasts on that stream, so it reads what they wrote).
class transfer_hasher {
 public:
  explicit transfer_hasher(const any_communicator& comm) : comm_(&comm) {}

  [[nodiscard]] std::uint64_t operator()(std::span<const tensor_view> group) {
    std::uint64_t h = 0;
    if (group.empty() || group.front().where.is_host()) {
      for (const tensor_view& t : group) h = xxh64({t.byte_data(), t.bytes()}, h);
      return h;
    }
    const ddp::device_queue q = comm_->device_queue();  // present: check_state_placement()
    if (!done_.get()) done_ = device_event_owner(*q.runtime, q.where);
    std::size_t bytes = 0;
    for (const tensor_view& t : group) bytes += t.bytes();
    host_.resize(bytes);
    regions_.clear();
    for (std::size_t off = 0; const tensor_view& t : group) {  // one placement per transfer
      regions_.push_back({host_.data() + off, t.byte_data(), t.bytes()});
      off += t.bytes();
    }
    q.runtime->copy(regions_, q.stream);
    q.runtime->record(done_.get(), q.stream);
    q.runtime->synchronize(done_.get());
    for (std::size_t off = 0; const tensor_view& t : group) {
      h = xxh64({host_.data() + off, t.bytes()}, h);
      off += t.bytes();
    }
    return h;
  }

 private:
  const any_communicator* comm_;
  std::vector<std::byte> host_;
  std::vector<copy_region> regions_;
  device_event_owner done_;
};

/// The state hash from the hashes of its transfers (`plan_transfers`, in order), the scalars and
/// `step`.
[[nodiscard]] inline std::uint64_t combine_state_hash(std::span<const std::uint64_t> transfers,
                                                      std::span<const std::int64_t> scalars, std::int64_t step) {
  std::uint64_t h = xxh64(std::as_bytes(transfers));
  h = xxh64(std::as_bytes(scalars), h);
  return xxh64(std::as_bytes(std::span<const std::int64_t>(&step, 1)), h);
}

/// The state hash, in one pass over the state as it is now: what `heal_state` computes as the
/// transfers land. Device tensors are copied to the host a transfer at a time.
[[nodiscard]] inline std::uint64_t state_hash(const state_view& state, std::int64_t step, const any_communicator& comm,
                                              std::size_t chunk_bytes) {
  transfer_hasher hash(comm);
  std::vector<std::uint64_t> hashes;
  for (const auto& group : plan_transfers(state.tensors, chunk_bytes)) hashes.push_back(hash(group));
  return combine_state_hash(hashes, state.scalars, step);
}

/// What a heal moved: tensor bytes, and the state hash of what this member holds afterwards.
struct healed_state {
  std::size_t moved = 0;   ///< tensor bytes moved
  std::uint64_t hash = 0;  ///< `state_hash` of the state after the transfer
};

/// Where transfer k travels: over `comm` from its rank `root`, for the lane k % lanes. A lane
/// without a communicator is one this member takes no part in: it is a source that holds the
/// lane's bytes and another source sends them (manager/heal_routes.hpp).
struct heal_lane {
  any_communicator* comm = nullptr;
  int root = 0;
};

/// The lanes of a heal over one communicator: transfer k broadcast from sources[k % sources].
[[nodiscard]] inline std::vector<heal_lane> quorum_lanes(any_communicator& comm, const std::vector<int>& sources) {
  std::vector<heal_lane> lanes;
  for (const int s : sources) lanes.push_back({&comm, s});
  return lanes;
}

/// Broadcasts the state's transfers (`plan_transfers`: 4096 small tensors cost a few calls),
/// transfer k over lanes[k % lanes] so that every source sends at once, all in flight together;
/// then the scalars and the step from the first source over `comm`, the quorum's communicator.
/// Each member hashes every host transfer as soon as it completes (the bytes it now holds, still
/// in cache, while later transfers are in flight), device transfers and those of lanes it takes
/// no part in afterwards. Up-to-date members receive bytes identical to their own, or none.
/// Collective over `comm` and each lane's communicator. `meter` counts bytes as they arrive.
/// @throws communication_error if a transfer fails, or the sources sent another step
inline healed_state heal_state(any_communicator& comm, std::span<const heal_lane> lanes, const state_view& state,
                               int first_source, std::int64_t step, std::size_t chunk_bytes, progress_meter& meter,
                               int rank) {
  const std::vector<std::vector<tensor_view>> groups = plan_transfers(state.tensors, chunk_bytes);
  healed_state out;
  std::vector<work> transfers;
  std::vector<std::size_t> transfer_group;  // transfers[i] moves groups[transfer_group[i]]
  for (std::size_t k = 0; k < groups.size(); ++k) {
    std::size_t n = 0;
    for (const tensor_view& t : groups[k]) n += t.bytes();
    out.moved += n;
    const heal_lane& lane = lanes[k % lanes.size()];
    if (lane.comm == nullptr) continue;
    transfers.push_back(lane.comm->broadcast(std::span<const tensor_view>(groups[k]), lane.root).then([&meter, n] {
      meter.add_bytes(n);
    }));
    transfer_group.push_back(k);
  }
  std::vector<std::uint64_t> hashes(groups.size());
  std::vector<bool> hashed(groups.size(), false);
  // A device transfer is read back on its lane's device queue, behind that lane's broadcasts.
  std::vector<std::unique_ptr<transfer_hasher>> lane_hash(lanes.size());
  const auto hasher = [&](std::size_t k) -> transfer_hasher& {
    const heal_lane& lane = lanes[k % lanes.size()];
    auto& h = lane_hash[k % lanes.size()];
    if (!h) h = std::make_unique<transfer_hasher>(lane.comm != nullptr ? *lane.comm : comm);
    return *h;
  };
  // Round-robin, one deadline, an error naming the first pending transfer.
  work::wait_all(transfers, [&](std::size_t i) {
    const std::size_t k = transfer_group[i];
    if (!groups[k].front().where.is_host()) return;  // its copy would wait for every broadcast queued
    hashes[k] = hasher(k)(groups[k]);
    hashed[k] = true;
  });
  for (std::size_t k = 0; k < groups.size(); ++k) {
    if (!hashed[k]) hashes[k] = hasher(k)(groups[k]);
  }
  std::vector<std::int64_t> scalars(state.scalars.begin(), state.scalars.end());
  scalars.push_back(step);
  communicator_ref(comm).broadcast(scalars, first_source).wait();
  std::copy(scalars.begin(), scalars.end() - 1, state.scalars.begin());
  if (scalars.back() != step) {
    throw communication_error(
        rank, "Manager healing",
        "the sources sent step " + std::to_string(scalars.back()) + ", expected " + std::to_string(step));
  }
  out.hash = combine_state_hash(hashes, state.scalars, step);
  return out;
}

/// `heal_state` over `comm` alone: transfer k broadcast from sources[k % sources] to every member.
inline healed_state heal_state(any_communicator& comm, const state_view& state, const std::vector<int>& sources,
                               std::int64_t step, std::size_t chunk_bytes, progress_meter& meter, int rank) {
  const std::vector<heal_lane> lanes = quorum_lanes(comm, sources);
  return heal_state(comm, lanes, state, sources.front(), step, chunk_bytes, meter, rank);
}

/// `heal_state` without the hash: returns the tensor bytes moved.
inline std::size_t broadcast_state(any_communicator& comm, const state_view& state, const std::vector<int>& sources,
                                   std::int64_t step, std::size_t chunk_bytes, progress_meter& meter, int rank) {
  return heal_state(comm, state, sources, step, chunk_bytes, meter, rank).moved;
}

/// Proof that every member of `comm` (named by `members`, in rank order) now holds the same
/// state, the sources': one allgather of state hashes, `hash` being this member's (from
/// `heal_state`, or `state_hash` at the sources' step). Collective.
/// @throws communication_error naming a member whose hash differs
inline void check_same_state(any_communicator& comm, std::uint64_t hash, const std::vector<std::string>& members,
                             int rank) {
  std::vector<std::int64_t> h{static_cast<std::int64_t>(hash)};
  std::vector<std::int64_t> all(members.size());
  comm.allgather(view(h), view(all)).wait();
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (all[r] != h[0]) {
      throw communication_error(rank, "Manager healing",
                                "replica " + members[r] + " holds a different state after healing");
    }
  }
}

/// `check_same_state` with the hash computed now, in a pass over the state at `step`.
inline void check_same_state(any_communicator& comm, const state_view& state, std::int64_t step,
                             std::size_t chunk_bytes, const std::vector<std::string>& members, int rank) {
  check_same_state(comm, state_hash(state, step, comm, chunk_bytes), members, rank);
}

}  // namespace ddp::detail
