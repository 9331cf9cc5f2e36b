#pragma once
/// @file nccl/manager_factory.hpp
/// @brief `ddp::nccl::manager_factory`: the fault-tolerant `Manager` over NCCL. For each quorum,
/// the NCCL unique id goes through the quorum's store namespace and a fresh NCCL communicator is
/// created for the quorum's members.
///
/// Failure and re-formation. When a collective fails, or before a new quorum forms, the Manager
/// calls `abort()` on the current communicator, which for NCCL is `ncclCommAbort` (it stops
/// kernels blocked on dead peers and frees the communicator), then builds the next quorum's
/// communicator through this factory: a new unique id, a new clique. `ncclCommRevoke` and
/// `ncclCommShrink` (`nccl::communicator::revoke` / `shrink`, under `DDP_NCCL_HAS_REVOKE` /
/// `DDP_NCCL_HAS_SHRINK`) are not used by the Manager: rebuilding works on every supported NCCL
/// version and also admits new replicas, which a shrink cannot.
///
/// @code
/// ddp::Manager m(store, ddp::nccl::manager_factory(local_gpu, {.timeout = 30s}), state, opts);
/// @endcode

#include <utility>

#include <ddp/any_communicator.hpp>
#include <ddp/manager.hpp>
#include <ddp/nccl/communicator.hpp>
#include <ddp/nccl/options.hpp>
#include <ddp/nccl/unique_id.hpp>

namespace ddp::nccl {

/// A `communicator_factory` for `ddp::Manager`: for each quorum, rank 0 of the quorum publishes a
/// fresh unique id under "nccl_unique_id" in `quorum_info::store` (a namespace of its own for
/// every generation), the others wait for it (up to `opts.timeout`, and no later than the quorum's
/// deadline), and every member calls
/// `communicator::create(id, q.rank, q.size, device, opts)`. The result keeps its device queue
/// through `any_communicator`, so the Manager heals and hashes device state on its stream. A
/// Bucketer over the Manager does not follow the stream: it reads `device_queue()` once, at
/// construction (bucketer/buckets.hpp), and the Manager's is empty between quorums and changes
/// with each one (`Manager::device_queue`); device gradients through a Manager's Bucketer are not
/// supported (docs/design.md, "Not implemented").
/// @param device  CUDA device ordinal of this replica
/// @param opts    options of every communicator created (a caller's `opts.stream` is shared by all)
[[nodiscard]] inline communicator_factory manager_factory(int device, options opts = {}) {
  return [device, opts = std::move(opts)](const quorum_info& q) -> any_communicator {
    const unique_id id = share_unique_id(q.store, q.rank, "nccl_unique_id", q.time_left(opts.timeout));
    return any_communicator(communicator::create(id, q.rank, q.size, device, opts));
  };
}

}  // namespace ddp::nccl
