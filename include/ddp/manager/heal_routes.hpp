#pragma once
/// @file manager/heal_routes.hpp
/// @brief The communicators of a heal over source routes (`heal_transport::source_routes`): one
/// per source that sends a transfer, from that source (rank 0) to the members it heals (in quorum
/// rank order), built by the Manager's factory in the generation's rendezvous namespace; and the
/// lanes `heal_state` (manager/heal.hpp) sends over. Not for users; docs/fault-tolerance.md
/// ("Healing routes").

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <ddp/any_communicator.hpp>
#include <ddp/manager/heal.hpp>
#include <ddp/manager/options.hpp>
#include <ddp/progress.hpp>
#include <ddp/store.hpp>
#include <ddp/stores/prefix_store.hpp>

namespace ddp::detail {

/// The route communicators this member takes part in, owned until the heal's hash check is
/// over (a source's route must outlive its receivers' last bytes), and the heal's lanes: lane s
/// is source s's route; a source takes no part in another source's lane. With one source the
/// quorum's communicator is the route (its members are that source and everyone it heals).
class heal_routes {
 public:
  /// The lanes of a heal of `state` from `sources` (quorum ranks, in order) to every other
  /// member of a quorum of `members.size()`, `over` the quorum's communicator or over routes.
  /// Routes: source s's if this member is source s or a receiver, for each source with a
  /// transfer to send (transfer k is source k mod sources'), built one after another in source
  /// order, so the rendezvous of every route finds its members. Collective over each route.
  /// @param generation_store the generation's rendezvous namespace; route s uses `heal<s>/` in it
  /// @throws state_placement_error if a route cannot heal device state (check_state_placement)
  heal_routes(heal_transport over, const communicator_factory& factory, any_communicator& quorum,
              store_ref generation_store, std::uint64_t generation, const std::vector<int>& sources, int rank,
              const std::vector<std::string>& members, const state_view& state, std::size_t chunk_bytes)
      : generation_store_(generation_store) {
    const std::size_t transfers = plan_transfers(state.tensors, chunk_bytes).size();
    if (over == heal_transport::quorum_broadcast || sources.size() <= 1) {
      lanes_ = quorum_lanes(quorum, sources);
      return;
    }
    std::vector<int> receivers;
    for (int r = 0; r < static_cast<int>(members.size()); ++r) {
      if (std::find(sources.begin(), sources.end(), r) == sources.end()) receivers.push_back(r);
    }
    const bool receiving = std::find(receivers.begin(), receivers.end(), rank) != receivers.end();
    const std::size_t used = std::min(sources.size(), transfers);  // lanes with a transfer to send
    lanes_.resize(sources.size());
    comms_.reserve(used);  // lanes point into comms_: no reallocation
    for (std::size_t s = 0; s < used; ++s) {
      if (!receiving && rank != sources[s]) continue;
      quorum_info route{generation,
                        0,
                        static_cast<int>(receivers.size()) + 1,
                        {members[static_cast<std::size_t>(sources[s])]},
                        store_ref(generation_store),
                        sources[s]};
      for (std::size_t i = 0; i < receivers.size(); ++i) {
        route.members.push_back(members[static_cast<std::size_t>(receivers[i])]);
        if (receivers[i] == rank) route.rank = static_cast<int>(i) + 1;
      }
      stores_.push_back(
          std::make_unique<stores::prefix_store<store_ref>>(generation_store_, "heal" + std::to_string(s) + "/"));
      route.store = store_ref(*stores_.back());
      comms_.push_back(factory(route));
      check_state_placement(state.tensors, comms_.back(), rank, generation);
      lanes_[s] = {&comms_.back(), 0};
    }
  }
  heal_routes(const heal_routes&) = delete;
  heal_routes& operator=(const heal_routes&) = delete;
  /// Destroyed by an exception (a transfer or the hash check failed), it aborts every route first:
  /// a route whose broadcast still waits on a dead peer must not be destroyed as healthy (NCCL's
  /// destroy would wait for it).
  ~heal_routes() {
    if (std::uncaught_exceptions() <= unwinding_) return;
    for (any_communicator& c : comms_) c.abort();
  }

  /// Lane s: source s's route, or none where this member takes no part in it.
  [[nodiscard]] std::span<const heal_lane> lanes() const noexcept { return lanes_; }

 private:
  store_ref generation_store_;  // the routes' namespaces refer to it: it outlives them
  std::vector<std::unique_ptr<stores::prefix_store<store_ref>>> stores_;
  std::vector<any_communicator> comms_;
  std::vector<heal_lane> lanes_;
  int unwinding_ = std::uncaught_exceptions();  // exceptions in flight when the heal began
};

/// One member's part of a heal of `state` to the step `step`: the transfers over the lanes of
/// `over` (heal_routes), then the hash check over the quorum. Collective over the quorum.
/// @throws communication_error if a transfer fails or the states differ after it
inline healed_state heal_member(heal_transport over, const communicator_factory& factory, any_communicator& quorum,
                                store_ref generation_store, std::uint64_t generation, const std::vector<int>& sources,
                                int rank, const std::vector<std::string>& members, const state_view& state,
                                std::int64_t step, std::size_t chunk_bytes, progress_meter& meter) {
  // The routes live until the check is over: a source's route outlives its receivers' last bytes.
  const heal_routes routes(over, factory, quorum, generation_store, generation, sources, rank, members, state,
                           chunk_bytes);
  // Hashed as the transfers land: no second pass for the check.
  const healed_state healed =
      heal_state(quorum, routes.lanes(), state, sources.front(), step, chunk_bytes, meter, rank);
  check_same_state(quorum, healed.hash, members, rank);
  return healed;
}

}  // namespace ddp::detail
