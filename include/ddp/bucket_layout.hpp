#pragma once
/// @file bucket_layout.hpp
/// @brief How gradients are grouped into buckets: the description a layout policy sees
/// (`gradient_info`), what it returns (`bucket_layout`), and the `bucketing_policy` concept.
///
/// A policy is a plain type with
/// - `bucket_layout layout(std::span<const gradient_info>) const`: the layout used from the first
///   iteration on, and optionally
/// - `bucket_layout rebuild(std::span<const gradient_info>, std::span<const std::size_t> ready_order) const`:
///   if present, the Bucketer rebuilds once, after the first synchronised iteration, from the order
///   in which gradients became ready on rank 0 (broadcast, so every rank builds the same layout).
/// A policy with `static constexpr bool fixed_layout = true` promises never to rebuild. Over a
/// fault-tolerance Manager the policy must not rebuild (`Manager::attach` refuses it at compile time,
/// a Bucketer's `build()` over a Manager at run time).
/// With a rebuilding policy a replica that joins later rebuilds after its own first synchronised
/// iteration, one broadcast the others do not issue, so its collectives stop matching theirs
/// (docs/bucketer.md, "Layout policies").

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <ddp/detail/fnv1a.hpp>
#include <ddp/device.hpp>
#include <ddp/dtype.hpp>

namespace ddp {

/// One registered gradient, as layout policies see it.
struct gradient_info {
  std::size_t index = 0;               ///< registration index
  std::size_t count = 0;               ///< elements
  ddp::dtype type = dtype::f32;        ///< element type
  ddp::device where = device::host();  ///< memory the gradient lives in

  /// Size in bytes: `count * size_of(type)`.
  [[nodiscard]] std::size_t bytes() const noexcept { return count * size_of(type); }
};

/// Buckets in launch order; each lists gradient indices in storage order.
struct bucket_layout {
  std::vector<std::vector<std::size_t>> buckets;  ///< `buckets[b]`: gradient indices of bucket `b`

  /// Same buckets in the same order, each with the same indices in the same order.
  friend bool operator==(const bucket_layout&, const bucket_layout&) = default;
  /// Number of buckets.
  [[nodiscard]] std::size_t size() const noexcept { return buckets.size(); }
};

/// Where the small bucket of a size-capped layout goes in launch order.
enum class small_bucket : unsigned char {
  first,  ///< launched first: communication starts as early as possible (PyTorch after its rebuild)
  last,   ///< launched last: the tail of the backward pass waits for as little as possible
  /// Small at both ends, buckets doubling towards the middle up to the cap: communication starts
  /// early and little is left after the backward pass (slow links; docs/bucketer.md).
  tapered,
};

/// A layout policy: copyable, with `bucket_layout layout(std::span<const gradient_info>) const`.
template <class P>
concept bucketing_policy = std::copy_constructible<P> && requires(const P& p, std::span<const gradient_info> g) {
  { p.layout(g) } -> std::same_as<bucket_layout>;
};

/// True if policy P rebuilds once from the agreed ready order.
template <class P>
concept rebuilding_policy = bucketing_policy<P> &&
    requires(const P& p, std::span<const gradient_info> g, std::span<const std::size_t> order) {
  { p.rebuild(g, order) } -> std::same_as<bucket_layout>;
};

/// True if policy P promises a layout that never changes.
template <class P>
concept fixed_layout_policy = bucketing_policy<P> && !rebuilding_policy<P> && requires {
  requires P::fixed_layout == true;
};

namespace detail {

/// Checks that `layout` places every gradient exactly once and never mixes dtype or device in a
/// bucket. Returns a description of the first problem, or nothing.
inline std::optional<std::string> validate_layout(const bucket_layout& layout, std::span<const gradient_info> grads) {
  std::vector<int> seen(grads.size(), 0);
  for (std::size_t b = 0; b < layout.buckets.size(); ++b) {
    const auto& bucket = layout.buckets[b];
    if (bucket.empty()) return "bucket " + std::to_string(b) + " is empty";
    const gradient_info& first = grads[bucket.front() < grads.size() ? bucket.front() : 0];
    for (std::size_t i : bucket) {
      if (i >= grads.size()) {
        return "bucket " + std::to_string(b) + " names gradient " + std::to_string(i) + " but only " +
               std::to_string(grads.size()) + " are registered";
      }
      if (++seen[i] > 1) return "gradient " + std::to_string(i) + " is placed in more than one bucket";
      if (grads[i].type != first.type || grads[i].where != first.where) {
        return "bucket " + std::to_string(b) + " mixes " + std::string(name_of(first.type)) + " on " +
               first.where.str() + " with gradient " + std::to_string(i) + " (" + std::string(name_of(grads[i].type)) +
               " on " + grads[i].where.str() + ")";
      }
    }
  }
  for (std::size_t i = 0; i < seen.size(); ++i) {
    if (seen[i] == 0) return "gradient " + std::to_string(i) + " is in no bucket";
  }
  return std::nullopt;
}

/// 64-bit FNV-1a over a sequence of integers, each as its 8 bytes, least significant first.
class fingerprint {
 public:
  void add(std::uint64_t v) noexcept { h_ = fnv1a_u64(v, h_); }
  [[nodiscard]] std::uint64_t value() const noexcept { return h_; }

 private:
  std::uint64_t h_ = fnv1a_offset_basis;
};

/// Fingerprint of the registered gradients and the layout: equal on two ranks iff both registered
/// the same sizes and dtypes in the same order and grouped them into the same buckets.
inline std::uint64_t layout_fingerprint(const bucket_layout& layout, std::span<const gradient_info> grads) {
  fingerprint f;
  f.add(grads.size());
  for (const auto& g : grads) {
    f.add(g.count);
    f.add(static_cast<std::uint64_t>(g.type));
  }
  f.add(layout.buckets.size());
  for (const auto& b : layout.buckets) {
    f.add(b.size());
    for (std::size_t i : b) f.add(i);
  }
  return f.value();
}

/// The size-capped grouping shared by the built-in policies: walks gradients in `order`, keeps one
/// open bucket per (dtype, device), closes it once it holds at least its limit (so a bucket
/// overshoots by at most one gradient; a gradient larger than the cap gets a bucket of its own).
/// The first bucket closed for each (dtype, device) uses `first_limit`, the rest `cap`. Buckets
/// are returned in the order they close, i.e. the order in which they become ready when gradients
/// arrive in `order`: that is launch order.
inline bucket_layout assign_by_size(std::span<const gradient_info> grads, std::span<const std::size_t> order,
                                    std::size_t first_limit, std::size_t cap) {
  struct open_bucket {
    dtype type;
    device where;
    std::vector<std::size_t> members;
    std::size_t bytes = 0;
    bool first = true;
  };
  std::vector<open_bucket> open;
  bucket_layout out;
  for (std::size_t i : order) {
    const gradient_info& g = grads[i];
    open_bucket* ob = nullptr;
    for (auto& o : open) {
      if (o.type == g.type && o.where == g.where) ob = &o;
    }
    if (ob == nullptr) {
      open.push_back({g.type, g.where, {}, 0, true});
      ob = &open.back();
    }
    ob->members.push_back(i);
    ob->bytes += g.bytes();
    if (ob->bytes >= (ob->first ? first_limit : cap)) {
      out.buckets.push_back(std::move(ob->members));
      ob->members.clear();
      ob->bytes = 0;
      ob->first = false;
    }
  }
  // Partly filled buckets close when their last gradient arrives: order them by that position.
  std::vector<std::size_t> position(grads.size());
  for (std::size_t p = 0; p < order.size(); ++p) position[order[p]] = p;
  std::vector<std::vector<std::size_t>> tails;
  for (auto& o : open) {
    if (!o.members.empty()) tails.push_back(std::move(o.members));
  }
  std::sort(tails.begin(), tails.end(),
            [&](const auto& a, const auto& b) { return position[a.back()] < position[b.back()]; });
  for (auto& t : tails) out.buckets.push_back(std::move(t));
  return out;
}

/// The tapered grouping (`small_bucket::tapered`): per (dtype, device), in `order`, buckets are
/// cut from both ends at once, each end's limits doubling from `small` up to `cap`, the end with
/// the smaller limit cutting next, so the two ends meet at the cap. Buckets are returned in the
/// order they become ready (the position of their last gradient in `order`): launch order.
inline bucket_layout assign_tapered(std::span<const gradient_info> grads, std::span<const std::size_t> order,
                                    std::size_t small, std::size_t cap) {
  std::vector<std::vector<std::size_t>> groups;  // `order` split by (dtype, device), order kept
  for (std::size_t i : order) {
    auto same = std::find_if(groups.begin(), groups.end(), [&](const auto& g) {
      return grads[g.front()].type == grads[i].type && grads[g.front()].where == grads[i].where;
    });
    if (same == groups.end()) {
      groups.push_back({i});
    } else {
      same->push_back(i);
    }
  }
  const auto grow = [cap](std::size_t limit) { return std::min(cap, std::max<std::size_t>(limit, 1) * 2); };
  bucket_layout out;
  for (const auto& g : groups) {
    std::vector<std::vector<std::size_t>> front, back;
    std::size_t lo = 0, hi = g.size(), front_limit = std::min(small, cap), back_limit = front_limit;
    while (lo < hi) {
      std::vector<std::size_t> bucket;
      std::size_t bytes = 0;
      if (front_limit <= back_limit) {
        while (lo < hi && bytes < front_limit) bytes += grads[bucket.emplace_back(g[lo++])].bytes();
        front.push_back(std::move(bucket));
        front_limit = grow(front_limit);
      } else {
        while (lo < hi && bytes < back_limit) bytes += grads[bucket.emplace_back(g[--hi])].bytes();
        std::reverse(bucket.begin(), bucket.end());
        back.push_back(std::move(bucket));
        back_limit = grow(back_limit);
      }
    }
    out.buckets.insert(out.buckets.end(), front.begin(), front.end());
    out.buckets.insert(out.buckets.end(), back.rbegin(), back.rend());
  }
  std::vector<std::size_t> position(grads.size());
  for (std::size_t p = 0; p < order.size(); ++p) position[order[p]] = p;
  std::stable_sort(out.buckets.begin(), out.buckets.end(),
                   [&](const auto& a, const auto& b) { return position[a.back()] < position[b.back()]; });
  return out;
}

}  // namespace detail
}  // namespace ddp
