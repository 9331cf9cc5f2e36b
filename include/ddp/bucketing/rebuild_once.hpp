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

struct rebuild_once {
  std::size_t cap_bytes = std::size_t{25} << 20;
  std::size_t small_bucket_bytes = std::size_t{1} << 20;
  small_bucket small_at = small_bucket::first;

  [[nodiscard]] bucket_layout layout(std::span<const gradient_info> grads) const { return sizes().layout(grads); }
  [[nodiscard]] bucket_layout rebuild(std::span<const gradient_info> grads,
                                      std::span<const std::size_t> ready_order) const {
    return sizes().layout_for_order(grads, ready_order);
  }

  friend bool operator==(const rebuild_once&, const rebuild_once&) = default;
  friend std::ostream& operator<<(std::ostream& os, const rebuild_once& p) {
    return os << "rebuild_once{" << p.sizes() << "}";
  }

 private:
  [[nodiscard]] size_capped sizes() const { return {cap_bytes, small_bucket_bytes, small_at}; }
};

static_assert(rebuilding_policy<rebuild_once>);

}  // namespace ddp::bucketing
