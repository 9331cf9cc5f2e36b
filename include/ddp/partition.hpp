#pragma once
/// @file partition.hpp
/// @brief `contiguous_share`: splitting `items` ordered things (micro-batches, samples) into
/// `parts` contiguous, balanced ranges, the same way everywhere in the library.
///
/// Part `k` of `parts` gets `items / parts` items, and the first `items % parts` parts one more,
/// in order: 10 items over 3 parts are [0,4) [4,7) [7,10). The split depends only on its three
/// arguments, so every rank computes every other rank's range without communicating. Both the
/// reproducible reduction (`ddp/reproducible/`) and the exactly-once sampler (`ddp/data/`) use
/// it, so a rank's micro-batches and its samples always agree.

#include <concepts>
#include <cstddef>
#include <string>

#include <ddp/error.hpp>

namespace ddp {

/// A half-open range `[first, last)` of item indices.
struct item_range {
  std::size_t first = 0;  ///< first item
  std::size_t last = 0;   ///< one past the last item

  /// Number of items in the range.
  [[nodiscard]] constexpr std::size_t size() const noexcept { return last - first; }
  /// True if the range holds no item.
  [[nodiscard]] constexpr bool empty() const noexcept { return first == last; }
  /// True if `i` lies in the range.
  [[nodiscard]] constexpr bool contains(std::size_t i) const noexcept { return i >= first && i < last; }
  /// Memberwise.
  friend constexpr bool operator==(const item_range&, const item_range&) = default;
};

/// The `part`-th of `parts` contiguous, balanced ranges over `items` items (see the file
/// description). Parts beyond `items` get empty ranges.
/// @throws usage_error if `parts < 1` or `part` is not in `[0, parts)`
[[nodiscard]] inline item_range contiguous_share(std::size_t items, int parts, int part) {
  if (parts < 1 || part < 0 || part >= parts) {
    throw usage_error(part, "contiguous_share",
                      "part " + std::to_string(part) + " of " + std::to_string(parts) + " parts does not exist");
  }
  const auto p = static_cast<std::size_t>(parts);
  const auto k = static_cast<std::size_t>(part);
  const std::size_t base = items / p;
  const std::size_t extra = items % p;
  const std::size_t first = k * base + (k < extra ? k : extra);
  return {first, first + base + (k < extra ? 1 : 0)};
}

/// The share of `items` that a member of `group` contributes in a step: by its participant rank
/// among the participants when the group has them (a Manager: hot spares and replicas that count
/// as zeros get nothing), else by its rank among the group's members.
template <class Group>
requires requires(const Group& g) {
  { g.rank() } -> std::convertible_to<int>;
  { g.size() } -> std::convertible_to<int>;
}
[[nodiscard]] item_range contributor_share(std::size_t items, const Group& group) {
  if constexpr (requires {
                  { group.participant_rank() } -> std::convertible_to<int>;
                  { group.participants() } -> std::convertible_to<int>;
                }) {
    if (group.participant_rank() < 0) return {};
    return contiguous_share(items, group.participants(), group.participant_rank());
  } else {
    return contiguous_share(items, group.size(), group.rank());
  }
}

}  // namespace ddp
