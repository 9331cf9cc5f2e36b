#pragma once
/// @file groups/group_communicator.hpp
/// @brief `group_communicator`: the communicator of a job whose replicas are groups of ranks
/// (torchft's fault-tolerant HSDP shape): fast collectives inside a group over `Inner`, and across
/// the groups over `Cross`, one communicator per rank index joining the same-index ranks of every
/// group. An allreduce is a reduction inside the group, an allreduce of this rank's shard across
/// the groups and an allgather inside the group, so each rank sends 1/k of the data across
/// (k ranks a group) and a group's ranks use their links at once. It models `communicator`, so a
/// Bucketer runs over it unchanged. docs/replica-groups.md.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/backend_contract.hpp>
#include <ddp/communicator.hpp>
#include <ddp/detail/stage_sequencer.hpp>
#include <ddp/detail/staging_pool.hpp>
#include <ddp/error.hpp>
#include <ddp/shm/tensor_group.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp {

/// How an allreduce over groups reduces inside a group before its shard goes across.
enum class group_inner_reduction : unsigned char {
  /// One reduce-scatter: each rank reduces and receives only its shard (the least traffic inside).
  reduce_scatter,
  /// One allreduce of the whole buffer, then each rank sends its slice across: twice the traffic
  /// inside, but faster where the inner backend's allreduce beats its reduce-scatter (ddp's MPI and
  /// shared-memory backends on the test machine: 21-33 ms against 56-92 ms for 64 MiB).
  allreduce,
};

/// Options of a `group_communicator`.
struct group_options {
  std::chrono::milliseconds timeout = default_timeout;             ///< deadline of each collective's work, all stages
  group_inner_reduction inner = group_inner_reduction::allreduce;  ///< the allreduce's first stage
};

/// Ranks of a group job: rank = group * group_size + index in the group (group-major).
///
/// Every rank of group g must hold `Inner` over exactly the ranks of g (its rank there being its
/// index), and `Cross` over the ranks of its index in every group, in group order (its rank there
/// being g). Collectives are host memory (the staging is); what each one costs is in
/// docs/replica-groups.md.
template <communicator Inner, communicator Cross>
class group_communicator {
 public:
  /// @param inner   over the ranks of this rank's group (its rank there: its index in the group)
  /// @param cross   over the ranks of this index in every group, in group order (its rank: the group)
  /// @param options the timeout of each collective, and how an allreduce reduces inside a group
  group_communicator(Inner inner, Cross cross, group_options options = {})
      : p_(std::make_shared<parts>(parts{std::move(inner), std::move(cross)})), opts_(options) {}

  /// This rank in the job: group * group_size() + index in the group.
  [[nodiscard]] int rank() const { return p_->cross.rank() * p_->inner.size() + p_->inner.rank(); }
  /// Ranks of the job: groups * group_size().
  [[nodiscard]] int size() const { return p_->cross.size() * p_->inner.size(); }
  /// Ranks of a group (k).
  [[nodiscard]] int group_size() const { return p_->inner.size(); }
  /// This rank's group (its rank across the groups).
  [[nodiscard]] int group() const { return p_->cross.rank(); }
  /// The communicator inside this rank's group.
  [[nodiscard]] Inner& inner() noexcept { return p_->inner; }
  /// The communicator across the groups, of this rank's index.
  [[nodiscard]] Cross& cross() noexcept { return p_->cross; }

  /// In place over every rank of every group: per dtype (in order of first appearance), the
  /// tensors packed (padded to a multiple of k), reduced inside the group (`group_options::inner`:
  /// reduce-scattered, or allreduced and sliced), this rank's
  /// shard allreduced across the groups, allgathered inside the group, unpacked.
  work allreduce(std::span<const tensor_view> ts, reduce_op op) {
    const op_info info = contract::check_allreduce(caller(), ts, op);
    auto runs = std::make_shared<std::vector<dtype_run>>();
    for (const tensor_view& t : ts) {
      if (t.count == 0) continue;
      auto run = std::find_if(runs->begin(), runs->end(), [&](const dtype_run& r) { return r.group.type == t.type; });
      if (run == runs->end()) {
        run = runs->emplace(runs->end());
        run->group.type = t.type;
      }
      run->group.add(t);
    }
    const auto k = static_cast<std::size_t>(p_->inner.size());
    std::vector<detail::stage_sequencer::stage> stages;
    for (dtype_run& run : *runs) {
      const std::size_t n = run.group.total, shard = (n + k - 1) / k, elem = size_of(run.group.type);
      run.packed = detail::pooled_buffer(pool_, shard * k * elem);
      run.group.copy_out(0, n, run.packed.data());
      std::memset(run.packed.data() + n * elem, 0, (shard * k - n) * elem);  // the padding: reduced, then dropped
      const tensor_view packed{run.packed.data(), shard * k, run.group.type, device::host()};
      if (opts_.inner == group_inner_reduction::allreduce) {  // my shard is my slice of the reduced buffer
        const tensor_view mine = packed.slice(shard * static_cast<std::size_t>(p_->inner.rank()), shard);
        stages.emplace_back(
            [p = p_, packed, op] { return p->inner.allreduce(std::span<const tensor_view>(&packed, 1), op); });
        stages.emplace_back(
            [p = p_, mine, op] { return p->cross.allreduce(std::span<const tensor_view>(&mine, 1), op); });
        stages.emplace_back([p = p_, packed, mine] { return p->inner.allgather(mine, packed); });  // in place
        continue;
      }
      run.shard = detail::pooled_buffer(pool_, shard * elem);
      const tensor_view mine{run.shard.data(), shard, run.group.type, device::host()};
      stages.emplace_back([p = p_, packed, mine, op] { return p->inner.reduce_scatter(packed, mine, op); });
      stages.emplace_back(
          [p = p_, mine, op] { return p->cross.allreduce(std::span<const tensor_view>(&mine, 1), op); });
      stages.emplace_back([p = p_, packed, mine] { return p->inner.allgather(mine, packed); });
    }
    return order_->start(info, std::move(stages), [runs] {
      for (const dtype_run& run : *runs) run.group.copy_in(0, run.group.total, run.packed.data());
    });
  }

  /// From job rank `root`: inside root's group, then each rank index carries its 1/k of the bytes
  /// across from root's group, then the other groups allgather their shards inside.
  work broadcast(std::span<const tensor_view> ts, int root) {
    const op_info info = contract::check_broadcast(caller(), ts, root);
    const int k = p_->inner.size(), root_group = root / k;
    auto state = std::make_shared<broadcast_state>();
    state->bytes.type = dtype::u8;  // any dtypes: moved as bytes
    for (const tensor_view& t : ts) {
      if (t.count) state->bytes.add({t.data, t.bytes(), dtype::u8, t.where});
    }
    const std::size_t shard = (state->bytes.total + static_cast<std::size_t>(k) - 1) / static_cast<std::size_t>(k);
    state->packed = detail::pooled_buffer(pool_, shard * static_cast<std::size_t>(k));
    const tensor_view whole{state->packed.data(), state->packed.size(), dtype::u8, device::host()};
    const tensor_view mine = whole.slice(shard * static_cast<std::size_t>(p_->inner.rank()), shard);
    std::vector<detail::stage_sequencer::stage> stages;
    if (group() == root_group) {
      stages.emplace_back([p = p_, state, root, k] { return p->inner.broadcast(state->bytes.parts, root % k); });
      stages.emplace_back([p = p_, state, mine, root_group] {
        state->pack();  // the group holds the root's bytes now
        return p->cross.broadcast(std::span<const tensor_view>(&mine, 1), root_group);
      });
    } else {
      stages.emplace_back([p = p_, mine, root_group] {
        return p->cross.broadcast(std::span<const tensor_view>(&mine, 1), root_group);
      });
      stages.emplace_back([p = p_, mine, whole] { return p->inner.allgather(mine, whole); });
    }
    const bool unpack = group() != root_group;
    return order_->start(info, std::move(stages), [state, unpack] {
      if (unpack) state->unpack();
    });
  }

  /// Job rank r's `in` lands at `out[r * in.count]`: inside the group, then across the groups.
  work allgather(tensor_view in, tensor_view out) {
    const op_info info = contract::check_allgather(caller(), in, out);
    auto group =
        std::make_shared<detail::pooled_buffer>(pool_, in.bytes() * static_cast<std::size_t>(p_->inner.size()));
    const tensor_view mine_group{group->data(), in.count * static_cast<std::size_t>(p_->inner.size()), in.type,
                                 device::host()};
    // `in` may be this rank's block of `out` (the in-place form): the first stage reads it before
    // the second writes `out`.
    return order_->start(info, {[p = p_, in, mine_group, group] { return p->inner.allgather(in, mine_group); },
                                [p = p_, mine_group, out] { return p->cross.allgather(mine_group, out); }});
  }

  /// Job rank r gets block r of the reduction: the blocks regrouped by index in the group, reduced
  /// and scattered inside the group (index i holds blocks {g k + i} summed over the group), then
  /// reduced and scattered across the groups.
  work reduce_scatter(tensor_view in, tensor_view out, reduce_op op) {
    const op_info info = contract::check_reduce_scatter(caller(), in, out, op);
    const auto k = static_cast<std::size_t>(p_->inner.size()), groups = static_cast<std::size_t>(p_->cross.size());
    const std::size_t block = out.bytes();
    auto by_index = std::make_shared<detail::pooled_buffer>(pool_, in.bytes());
    auto column = std::make_shared<detail::pooled_buffer>(pool_, block * groups);
    for (std::size_t i = 0; i < k; ++i) {
      for (std::size_t g = 0; g < groups; ++g) {
        std::memcpy(by_index->data() + (i * groups + g) * block, in.byte_data() + (g * k + i) * block, block);
      }
    }
    const tensor_view regrouped{by_index->data(), in.count, in.type, device::host()};
    const tensor_view mine{column->data(), out.count * groups, in.type, device::host()};
    return order_->start(
        info, {[p = p_, regrouped, mine, op, by_index] { return p->inner.reduce_scatter(regrouped, mine, op); },
               [p = p_, mine, out, op, column] { return p->cross.reduce_scatter(mine, out, op); }});
  }

  /// Inside the group, across the groups, inside the group again (so no rank leaves before every
  /// rank of every group arrived).
  work barrier() {
    const op_info info = contract::check_barrier(caller());
    return order_->start(info, {[p = p_] { return p->inner.barrier(); }, [p = p_] { return p->cross.barrier(); },
                                [p = p_] { return p->inner.barrier(); }});
  }

  /// Aborts both communicators.
  void abort() noexcept {
    p_->inner.abort();
    p_->cross.abort();
  }

 private:
  // A broadcast's tensors (as bytes) and their bytes packed (padded to a multiple of k).
  struct broadcast_state {
    shm::tensor_group bytes;
    detail::pooled_buffer packed;
    void pack() { bytes.copy_out(0, bytes.total, packed.data()); }
    void unpack() const { bytes.copy_in(0, bytes.total, packed.data()); }
  };

  // One dtype's tensors of an allreduce as one sequence, packed, and this rank's shard of them.
  struct dtype_run {
    shm::tensor_group group;
    detail::pooled_buffer packed, shard;
  };

  [[nodiscard]] contract::caller caller() {
    return {rank(), size(), calls_++, opts_.timeout,
            contract::memory_rule::host("group_communicator", "it stages through host memory")};
  }

  // Shared with the stages in flight, so that moving the communicator leaves them valid.
  struct parts {
    Inner inner;
    Cross cross;
  };
  std::shared_ptr<parts> p_;
  group_options opts_;
  std::uint64_t calls_ = 0;
  std::shared_ptr<detail::staging_pool> pool_ = std::make_shared<detail::staging_pool>();
  // Every collective's stages are issued in call order on every rank (detail/stage_sequencer.hpp).
  std::shared_ptr<detail::stage_sequencer> order_ = std::make_shared<detail::stage_sequencer>();
};

}  // namespace ddp
