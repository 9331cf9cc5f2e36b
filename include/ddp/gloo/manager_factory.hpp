#pragma once
/// @file gloo/manager_factory.hpp
/// @brief `ddp::gloo::manager_factory`: the fault-tolerant `Manager` (or `GroupManager`) over gloo,
/// with the communicator's timeouts derived from the Manager's: each quorum's communicator
/// connects within what is left of the quorum's deadline and takes as its own collective timeout
/// `quorum_info::communicator_timeout` (a backstop the Manager's step and quorum deadlines always
/// beat). The timing model: docs/fault-tolerance.md, "Timing".
///
/// @code
/// ddp::Manager m(store, ddp::gloo::manager_factory({.secret = secret}), state,
///                ddp::manager_options::fast_failover("replica-0"));
/// @endcode

#include <utility>

#include <ddp/any_communicator.hpp>
#include <ddp/gloo/communicator.hpp>
#include <ddp/gloo/options.hpp>
#include <ddp/manager/options.hpp>

namespace ddp::gloo {

/// A `communicator_factory` for `ddp::Manager` and `ddp::GroupManager`: a gloo communicator of the
/// quorum's (or heal route's) members through `quorum_info::store`.
/// @param opts options of every communicator built; `connect_timeout` and `timeout` are upper
///   bounds, lowered to what the quorum's deadline leaves (and `connect_timeout` to the quorum's,
///   `quorum_info::connect_timeout`)
[[nodiscard]] inline communicator_factory manager_factory(options opts = {}) {
  return [opts = std::move(opts)](const quorum_info& q) -> any_communicator {
    options o = opts;
    o.timeout = q.communicator_timeout(opts.timeout);
    o.connect_timeout = q.connect_time_left(opts.connect_timeout);
    return any_communicator(communicator(q.store, q.rank, q.size, o));
  };
}

}  // namespace ddp::gloo
