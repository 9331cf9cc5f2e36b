#pragma once
/// @file gloo/enroll.hpp
/// @brief Building (and re-building) a gloo communicator for a member set agreed in a store.
///
/// Survivors of a failure meet in the next generation's namespace, agree on the members there
/// (`stores::enroll`) and connect: the recovery loop is in docs/backends-gloo.md, "Re-creation
/// after a failure".

#include <cstdint>
#include <string_view>
#include <utility>

#include <ddp/gloo/communicator.hpp>
#include <ddp/gloo/options.hpp>
#include <ddp/store.hpp>
#include <ddp/stores/membership.hpp>
#include <ddp/stores/prefix_store.hpp>

namespace ddp::gloo {

/// Connects to the members of an agreed group (`membership` from stores::enroll) through
/// `store`, which must be the namespace the group formed in.
[[nodiscard]] inline communicator connect(store_ref store, const stores::membership& group, options opts = {}) {
  return communicator(store, group.rank, group.size(), std::move(opts));
}

/// Enrolls in generation `generation` of `job` in `store`: agrees on the member set with the
/// other processes enrolling in it, then connects to them. Returns this process's communicator;
/// its rank follows the order of the members' ids.
/// @throws timeout_error if the group did not form or connect in time; communication_error if
///         it formed without this process (enroll in the next generation)
template <store S>
[[nodiscard]] communicator enroll(S& store, std::string_view job, std::uint64_t generation, std::string_view id,
                                  const stores::group_options& group = {}, options opts = {}) {
  auto ns = stores::generation_store(store, job, generation);
  const stores::membership m = stores::enroll(ns, id, group);
  return communicator(ns, m.rank, m.size(), std::move(opts));
}

}  // namespace ddp::gloo
