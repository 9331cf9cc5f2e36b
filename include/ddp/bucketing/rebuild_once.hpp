#pragma once
/// @file bucketing/rebuild_once.hpp
/// @brief Size-capped buckets that are regrouped once, after the first synchronised iteration,
/// from the order in which gradients actually became ready (rank 0's order, broadcast so that
/// every rank builds the same layout). Unlike PyTorch, the first iteration already overlaps:
/// it uses the reverse-registration layout instead of one giant bucket.

#include <ostream>
#include <span>

#include <ddp/bucket_layout.hpp>
#include <ddp/bucketing/size_capped.hpp>

namespace ddp::bucketing {

/// Policy that starts with `size_capped`'s layout and regroups once, with the same limits, in
/// the observed ready order. Models `rebuilding_policy`.
struct rebuild_once {
  std::size_t cap_bytes = std::size_t{25} << 20;          ///< as `size_capped::cap_bytes`
  std::size_t small_bucket_bytes = std::size_t{1} << 20;  ///< as `size_capped::small_bucket_bytes`
  small_bucket small_at = small_bucket::first;            ///< as `size_capped::small_at`

  /// Initial layout: size-capped, in reverse registration order.
  [[nodiscard]] bucket_layout layout(std::span<const gradient_info> grads) const { return sizes().layout(grads); }
  /// Layout for the rebuild: size-capped, in `ready_order` (rank 0's order of readiness, the
  /// same on every rank).
  [[nodiscard]] bucket_layout rebuild(std::span<const gradient_info> grads,
                                      std::span<const std::size_t> ready_order) const {
    return sizes().layout_for_order(grads, ready_order);
  }

  /// Memberwise.
  friend bool operator==(const rebuild_once&, const rebuild_once&) = default;
  /// "rebuild_once{size_capped{...}}".
  friend std::ostream& operator<<(std::ostream& os, const rebuild_once& p) {
    return os << "rebuild_once{" << p.sizes() << "}";
  }

 private:
  [[nodiscard]] size_capped sizes() const { return {cap_bytes, small_bucket_bytes, small_at}; }
};

static_assert(rebuilding_policy<rebuild_once>);

}  // namespace ddp::bucketing
