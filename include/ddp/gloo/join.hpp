#pragma once
/// @file gloo/join.hpp
/// @brief Deprecated: the former name of `gloo::enroll` (gloo/enroll.hpp), kept so that existing
/// code compiles. "Join" in ddp now means only uneven inputs (`JoinContext`, join.hpp).

#include <cstdint>
#include <string_view>
#include <utility>

#include <ddp/gloo/communicator.hpp>
#include <ddp/gloo/enroll.hpp>
#include <ddp/gloo/options.hpp>
#include <ddp/store.hpp>
#include <ddp/stores/membership.hpp>

namespace ddp::gloo {

/// Former name of `enroll`.
template <store S>
[[deprecated("use ddp::gloo::enroll (ddp/gloo/enroll.hpp)")]] [[nodiscard]] communicator join(
    S& store, std::string_view job, std::uint64_t generation, std::string_view id,
    const stores::group_options& group = {}, options opts = {}) {
  return enroll(store, job, generation, id, group, std::move(opts));
}

}  // namespace ddp::gloo
