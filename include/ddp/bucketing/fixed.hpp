#pragma once
/// @file bucketing/fixed.hpp
/// @brief A layout that never changes: either given explicitly, or the size-capped layout of the
/// registration order. Required by the fault-tolerance Manager, so that a replica that joins
/// mid-training groups gradients exactly like the ones already running.

#include <ostream>
#include <span>

#include <ddp/bucket_layout.hpp>
#include <ddp/bucketing/size_capped.hpp>

namespace ddp::bucketing {

/// Policy whose layout never changes: `explicit_layout` if given, else `sizes` applied to the
/// reverse registration order. Models `fixed_layout_policy`.
struct fixed {
  static constexpr bool fixed_layout = true;  ///< promise checked by `fixed_layout_policy`: never rebuilds

  /// Used when `explicit_layout` is empty.
  size_capped sizes{};
  /// If non-empty, exactly this layout (validated against the registered gradients).
  bucket_layout explicit_layout{};

  /// `explicit_layout` if non-empty, else `sizes.layout(grads)`.
  [[nodiscard]] bucket_layout layout(std::span<const gradient_info> grads) const {
    return explicit_layout.buckets.empty() ? sizes.layout(grads) : explicit_layout;
  }

  /// Memberwise.
  friend bool operator==(const fixed&, const fixed&) = default;
  /// "fixed{<sizes>}", or "fixed{N explicit buckets}".
  friend std::ostream& operator<<(std::ostream& os, const fixed& p) {
    if (!p.explicit_layout.buckets.empty()) return os << "fixed{" << p.explicit_layout.size() << " explicit buckets}";
    return os << "fixed{" << p.sizes << "}";
  }
};

static_assert(fixed_layout_policy<fixed>);

}  // namespace ddp::bucketing
