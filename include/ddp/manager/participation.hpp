#pragma once
/// @file manager/participation.hpp
/// @brief Who contributes gradients in the steps of a new quorum: every member, or at most
/// `manager_options::active_replicas` of them, the rest hot spares; and, with
/// `healed_replicas_participate = false`, not the members that just received the state. A pure
/// function of what every member knows once the quorum formed, so every member computes the same
/// answer. Not for users: the rule is in docs/fault-tolerance.md, "Hot spares".

#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

#include <ddp/device_runtime.hpp>
#include <ddp/error.hpp>
#include <ddp/tensor.hpp>

namespace ddp::detail {

/// Each member's participant rank in the steps of a quorum (-1: it contributes zeros).
struct participation {
  std::vector<int> slot;  ///< by quorum rank: index among the participants, or -1
  int participants = 0;   ///< members with a slot
};

/// `n` members; `sources`: the ranks that held the committed state when the quorum formed (all of
/// them when nobody was behind); `healed_participate`: members that received the state count;
/// `active_replicas`: at most this many participants (0: no limit). Up-to-date members are chosen
/// first, so a replacement that just healed becomes the spare and a warm spare takes the dead
/// member's place; participant ranks follow quorum ranks.
[[nodiscard]] inline participation assign_participation(std::size_t n, const std::vector<int>& sources,
                                                        bool healed_participate, int active_replicas) {
  std::vector<bool> up_to_date(n, false);
  for (int s : sources) up_to_date[static_cast<std::size_t>(s)] = true;
  std::vector<bool> chosen(n, false);
  std::size_t left = active_replicas > 0 ? static_cast<std::size_t>(active_replicas) : n;
  for (int pass = 0; pass < 2; ++pass) {  // pass 0: up-to-date members; pass 1: healed ones
    if (pass == 1 && !healed_participate) break;
    for (std::size_t r = 0; r < n && left > 0; ++r) {
      if (!chosen[r] && up_to_date[r] == (pass == 0)) {
        chosen[r] = true;
        --left;
      }
    }
  }
  participation p;
  p.slot.assign(n, -1);
  for (std::size_t r = 0; r < n; ++r) {
    if (chosen[r]) p.slot[r] = p.participants++;
  }
  return p;
}

/// A spare's bucket (it contributes zeros): a memset on the host, or zeros enqueued on the
/// replica's device queue, where stream order keeps them before the collective that reads them.
/// @throws usage_error for a device bucket without a device queue
inline void zero_bucket(const tensor_view& data, const device_queue& q, int rank) {
  if (data.where.is_host()) {
    std::memset(data.data, 0, data.bytes());
    return;
  }
  if (q.runtime == nullptr) {
    throw usage_error(rank, "Manager comm hook",
                      "a bucket on " + data.where.str() + ", but the Manager has no device queue to zero it on");
  }
  q.runtime->zero(data.data, data.bytes(), q.stream);
}

}  // namespace ddp::detail
