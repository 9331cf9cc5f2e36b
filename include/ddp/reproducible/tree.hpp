#pragma once
/// @file reproducible/tree.hpp
/// @brief The fixed reduction tree over global micro-batch indices that makes a reduction give
/// the same bits at every world size.
///
/// The tree has `M` leaves, the micro-batches `0..M-1` of a global batch, and is the binary tree
/// of the next power of two above `M` with the leaves past `M` removed. Node `(l, i)` covers the
/// leaves `[i * 2^l, min((i + 1) * 2^l, M))`; its value is `value(l-1, 2i) + value(l-1, 2i+1)`,
/// element-wise, left operand first, or `value(l-1, 2i)` alone when the right child covers no
/// leaf (a pass-through: no addition). The root `(height, 0)` covers every leaf.
///
/// A rank that owns the contiguous leaves `[a, b)` can compute every node whose leaves lie
/// inside `[a, b)`; the maximal such nodes, its **cover** (at most about `2 log2(b - a)` nodes),
/// partition `[a, b)`. The covers of all ranks partition `[0, M)`, and the nodes above them are
/// computed from the covers in the tree's order, so the root is the same sequence of additions
/// whatever the number of ranks and wherever the range boundaries fall.

#include <algorithm>
#include <bit>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <ddp/error.hpp>
#include <ddp/partition.hpp>

namespace ddp::reproducible {

/// A node of the reduction tree: `level` 0 is a leaf (micro-batch `index`).
struct node {
  unsigned level = 0;     ///< height above the leaves
  std::size_t index = 0;  ///< position among the nodes of its level, left to right
  /// Memberwise; nodes order by level, then index.
  friend constexpr auto operator<=>(const node&, const node&) = default;
  /// Memberwise (implied by `<=>`; declared because nvcc 13 does not define the implied one).
  friend constexpr bool operator==(const node&, const node&) = default;
};

/// The reduction tree over `leaves` micro-batches (see the file description). A small value type.
class tree {
 public:
  /// A tree over `leaves` micro-batches.
  /// @throws usage_error if `leaves` is 0
  explicit tree(std::size_t leaves) : leaves_(leaves) {
    if (leaves == 0) throw usage_error(-1, "reproducible::tree", "a reduction tree needs at least one micro-batch");
    height_ = static_cast<unsigned>(std::bit_width(leaves - 1));  // ceil(log2(leaves)); 0 for one leaf
  }

  /// Number of leaves (micro-batches per global batch).
  [[nodiscard]] std::size_t leaves() const noexcept { return leaves_; }
  /// Level of the root: ceil(log2(leaves)).
  [[nodiscard]] unsigned height() const noexcept { return height_; }
  /// The node covering every leaf.
  [[nodiscard]] node root() const noexcept { return {height_, 0}; }

  /// First leaf covered by `n`.
  [[nodiscard]] std::size_t first(node n) const noexcept { return n.index << n.level; }
  /// One past the last leaf covered by `n` (clipped to `leaves()`; equal to `first(n)` if `n`
  /// covers no leaf).
  [[nodiscard]] std::size_t last(node n) const noexcept {
    const std::size_t f = first(n);
    if (f >= leaves_) return f;
    const std::size_t span = std::size_t{1} << n.level;
    return leaves_ - f < span ? leaves_ : f + span;
  }
  /// The leaves `n` covers.
  [[nodiscard]] item_range leaves_of(node n) const noexcept { return {first(n), last(n)}; }
  /// True if `n` is a node of this tree that covers at least one leaf.
  [[nodiscard]] bool exists(node n) const noexcept { return n.level <= height_ && first(n) < leaves_; }

  /// The parent of `n` (meaningless for the root).
  [[nodiscard]] static constexpr node parent(node n) noexcept { return {n.level + 1, n.index / 2}; }
  /// The left child of an inner node `n`.
  [[nodiscard]] static constexpr node left(node n) noexcept { return {n.level - 1, 2 * n.index}; }
  /// The right child of an inner node `n` (may cover no leaf: then `n` passes its left child through).
  [[nodiscard]] static constexpr node right(node n) noexcept { return {n.level - 1, 2 * n.index + 1}; }
  /// The other child of `n`'s parent.
  [[nodiscard]] static constexpr node sibling(node n) noexcept { return {n.level, n.index ^ 1}; }

  /// The maximal nodes whose leaves lie inside `r`, left to right: they partition `r`. Where a
  /// pass-through chain has several nodes with the same leaves, the highest is returned.
  /// @throws usage_error if `r` is not inside `[0, leaves())`
  [[nodiscard]] std::vector<node> cover(item_range r) const {
    if (r.first > r.last || r.last > leaves_) {
      throw usage_error(-1, "reproducible::tree::cover",
                        "range [" + std::to_string(r.first) + ", " + std::to_string(r.last) + ") is not inside the " +
                            std::to_string(leaves_) + " micro-batches");
    }
    std::vector<node> out;
    for (std::size_t pos = r.first; pos < r.last;) {
      node n{0, pos};
      while (n.level < height_ && (pos & ((std::size_t{2} << n.level) - 1)) == 0 && last(parent(n)) <= r.last) {
        n = parent(n);
      }
      out.push_back(n);
      pos = last(n);
    }
    return out;
  }

  /// The cover of rank `rank`'s share (`contiguous_share(leaves(), ranks, rank)`).
  [[nodiscard]] std::vector<node> cover_of_rank(int ranks, int rank) const {
    return cover(contiguous_share(leaves_, ranks, rank));
  }

  /// The largest cover over the ranks of a world of `ranks`: the number of nodes each rank
  /// contributes to the cross-rank reduction.
  [[nodiscard]] std::size_t max_cover(int ranks) const {
    std::size_t k = 0;
    for (int r = 0; r < ranks; ++r) k = std::max(k, cover_of_rank(ranks, r).size());
    return k;
  }

  /// Memberwise.
  friend bool operator==(const tree&, const tree&) = default;

 private:
  std::size_t leaves_;
  unsigned height_ = 0;
};

}  // namespace ddp::reproducible
