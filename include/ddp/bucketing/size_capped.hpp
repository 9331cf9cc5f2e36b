#pragma once
/// @file bucketing/size_capped.hpp
/// @brief PyTorch DDP's grouping: size-capped buckets in reverse registration order (an
/// approximation of backward order), one small bucket, never rebuilt.

#include <algorithm>
#include <cstddef>
#include <numeric>
#include <ostream>
#include <span>
#include <vector>

#include <ddp/bucket_layout.hpp>

namespace ddp::bucketing {

/// Policy: per (dtype, device), a bucket closes once it holds at least `cap_bytes`, except one
/// small bucket of `small_bucket_bytes`, launched first or last per `small_at` (`tapered`: small
/// buckets at both ends, doubling towards the middle up to the cap). Never rebuilt.
struct size_capped {
  std::size_t cap_bytes = std::size_t{25} << 20;          ///< PyTorch's bucket_cap_mb default
  std::size_t small_bucket_bytes = std::size_t{1} << 20;  ///< PyTorch's first-bucket default
  small_bucket small_at = small_bucket::first;            ///< explicit, not an accident of rebuilding

  /// Layout for gradients becoming ready in `order` (indices into `grads`).
  [[nodiscard]] bucket_layout layout_for_order(std::span<const gradient_info> grads,
                                               std::span<const std::size_t> order) const {
    if (small_at == small_bucket::first) {
      return detail::assign_by_size(grads, order, small_bucket_bytes, cap_bytes);
    }
    if (small_at == small_bucket::tapered) return detail::assign_tapered(grads, order, small_bucket_bytes, cap_bytes);
    // Small bucket last: group from the end of the order, then launch in the forward direction.
    std::vector<std::size_t> reversed(order.rbegin(), order.rend());
    bucket_layout l = detail::assign_by_size(grads, reversed, small_bucket_bytes, cap_bytes);
    std::reverse(l.buckets.begin(), l.buckets.end());
    for (auto& b : l.buckets) std::reverse(b.begin(), b.end());
    return l;
  }

  /// Layout for the reverse registration order.
  [[nodiscard]] bucket_layout layout(std::span<const gradient_info> grads) const {
    std::vector<std::size_t> order(grads.size());
    std::iota(order.rbegin(), order.rend(), std::size_t{0});  // reverse registration order
    return layout_for_order(grads, order);
  }

  /// Memberwise.
  friend bool operator==(const size_capped&, const size_capped&) = default;
  /// "size_capped{cap_bytes=..., small_bucket_bytes=..., small_at=first|last|tapered}".
  friend std::ostream& operator<<(std::ostream& os, const size_capped& p) {
    constexpr const char* where[] = {"first", "last", "tapered"};
    return os << "size_capped{cap_bytes=" << p.cap_bytes << ", small_bucket_bytes=" << p.small_bucket_bytes
              << ", small_at=" << where[static_cast<int>(p.small_at)] << "}";
  }
};

static_assert(bucketing_policy<size_capped>);

}  // namespace ddp::bucketing
