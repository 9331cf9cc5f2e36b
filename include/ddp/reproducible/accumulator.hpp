#pragma once
/// @file reproducible/accumulator.hpp
/// @brief `reproducible::accumulator`: the local half of the reproducible reduction. The trainer
/// hands it the gradients of each of its micro-batches, by global micro-batch index; it adds them
/// in the fixed tree (`reproducible/tree.hpp`) as soon as two siblings are both present, so that
/// in-order use holds at most about log2(M) node buffers.
///
/// @code
/// ddp::reproducible::tree t(8);                                  // 8 micro-batches per step
/// ddp::reproducible::accumulator acc(t, ddp::reproducible::layout({{ddp::dtype::f32, n}}));
/// acc.begin({4, 8});                                             // this rank owns micro-batches 4..7
/// for (std::size_t i = 4; i < 8; ++i) { compute(i, grad); acc.add(i, ddp::view(grad)); }
/// // acc.nodes() == t.cover({4, 8}) == {(2, 1)}: one node, leaves 4..7, added as ((4+5)+(6+7))
/// @endcode
///
/// A leaf that meets its stored sibling is added straight from the trainer's tensors (no copy);
/// otherwise it is copied into a pooled buffer. Node buffers are reused from step to step.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/detail/aligned_buffer.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/partition.hpp>
#include <ddp/reproducible/detail/kernels.hpp>
#include <ddp/reproducible/tree.hpp>
#include <ddp/tensor.hpp>

namespace ddp::reproducible {

/// Shape of one gradient tensor: dtype and element count.
struct tensor_shape {
  dtype type = dtype::f32;  ///< a floating dtype (f32, f64, f16, bf16)
  std::size_t count = 0;    ///< elements
  /// Memberwise.
  friend bool operator==(const tensor_shape&, const tensor_shape&) = default;
};

/// How the gradients of one micro-batch (or one tree node) sit in a flat node buffer: tensors of
/// the same dtype back to back in one **group**, groups in order of their dtype's first
/// appearance, each group 64-byte aligned. A group is what the cross-rank reduction sends.
class layout {
 public:
  /// One dtype group of the buffer.
  struct group {
    dtype type = dtype::f32;  ///< element type of the group
    std::size_t offset = 0;   ///< byte offset of the group in a node buffer
    std::size_t count = 0;    ///< elements in the group
  };
  /// Where one tensor lives.
  struct place {
    std::size_t group = 0;   ///< its group
    std::size_t offset = 0;  ///< element offset inside the group
    std::size_t count = 0;   ///< elements
  };

  layout() = default;
  /// Lays out `tensors` (in order) as described above.
  /// @throws usage_error for a non-floating dtype
  explicit layout(std::vector<tensor_shape> tensors) : tensors_(std::move(tensors)) {
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      const tensor_shape& t = tensors_[i];
      if (!is_floating(t.type)) {
        throw usage_error(-1, "reproducible::layout",
                          "tensor " + std::to_string(i) + " has dtype " + std::string(name_of(t.type)) +
                              "; the reproducible reduction adds floating-point values (f32, f64, f16, bf16)");
      }
      std::size_t g = 0;
      while (g < groups_.size() && groups_[g].type != t.type) ++g;
      if (g == groups_.size()) groups_.push_back({t.type, 0, 0});
      places_.push_back({g, groups_[g].count, t.count});
      groups_[g].count += t.count;
    }
    for (auto& g : groups_) {
      g.offset = bytes_;
      bytes_ += (g.count * size_of(g.type) + 63) / 64 * 64;
    }
  }

  /// The tensors, as given.
  [[nodiscard]] const std::vector<tensor_shape>& tensors() const noexcept { return tensors_; }
  /// The dtype groups.
  [[nodiscard]] const std::vector<group>& groups() const noexcept { return groups_; }
  /// Where each tensor lives.
  [[nodiscard]] const std::vector<place>& places() const noexcept { return places_; }
  /// Size of one node buffer.
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }

  /// Group `g` inside the node buffer `buffer`.
  [[nodiscard]] tensor_view group_view(std::byte* buffer, std::size_t g) const noexcept {
    return {buffer + groups_[g].offset, groups_[g].count, groups_[g].type, device::host()};
  }
  /// Tensor `i` inside the node buffer `buffer`.
  [[nodiscard]] tensor_view tensor_view_of(std::byte* buffer, std::size_t i) const noexcept {
    const place& p = places_[i];
    return group_view(buffer, p.group).slice(p.offset, p.count);
  }

  /// Memberwise (the tensors determine the rest).
  friend bool operator==(const layout& a, const layout& b) { return a.tensors_ == b.tensors_; }

 private:
  std::vector<tensor_shape> tensors_;
  std::vector<group> groups_;
  std::vector<place> places_;
  std::size_t bytes_ = 0;
};

/// The local tree reduction of one rank's micro-batches (see the file description). Not
/// thread-safe: one thread adds the micro-batches of a step. Move-only.
class accumulator {
 public:
  /// An accumulator for micro-batches of shape `l` in tree `t`. Call `begin()` before adding.
  accumulator(tree t, layout l) : tree_(t), layout_(std::move(l)) {}

  /// Starts a step in which this rank owns the micro-batches `r`. Drops every stored node, or,
  /// with `keep_inside`, keeps the stored nodes whose leaves lie inside `r` (their values count
  /// as already added: use it only when they were computed from the same parameters and data,
  /// e.g. for a retry of a step that did not commit) and drops the others.
  /// @throws usage_error if `r` is not inside the tree's leaves
  void begin(item_range r, bool keep_inside = false) {
    if (r.first > r.last || r.last > tree_.leaves()) {
      throw usage_error(-1, "reproducible::accumulator::begin",
                        "range [" + std::to_string(r.first) + ", " + std::to_string(r.last) + ") is not inside the " +
                            std::to_string(tree_.leaves()) + " micro-batches");
    }
    auto old = std::move(stored_);
    stored_.clear();
    range_ = r;
    reused_ = 0;
    for (const auto& [n, buf] : old) {
      if (keep_inside && tree_.first(n) >= r.first && tree_.last(n) <= r.last) {
        reused_ += tree_.last(n) - tree_.first(n);
        settle(n, source{nullptr, buf});
      } else {
        free_.push_back(buf);
      }
    }
  }

  /// Adds micro-batch `leaf`'s gradients: one view per tensor of the layout, same dtype and count.
  /// @throws usage_error if `leaf` is outside the current range, was added already in this step,
  ///   or the views do not match the layout
  void add(std::size_t leaf, std::span<const tensor_view> parts) {
    check_parts(leaf, parts);
    settle(node{0, leaf}, source{parts.data(), npos});
  }
  /// `add` for a layout of one tensor.
  void add(std::size_t leaf, tensor_view gradient) { add(leaf, std::span<const tensor_view>(&gradient, 1)); }

  /// True once every micro-batch of the range was added (or kept): the stored nodes are then
  /// exactly `shape().cover(range())`.
  [[nodiscard]] bool complete() const noexcept {
    std::size_t n = 0;
    for (const auto& [nd, buf] : stored_) n += tree_.last(nd) - tree_.first(nd);
    return n == range_.size();
  }
  /// Micro-batches of the range not added yet, in order.
  [[nodiscard]] std::vector<std::size_t> pending() const {
    std::vector<std::size_t> out;
    std::vector<bool> have(range_.size(), false);
    for (const auto& [nd, buf] : stored_) {
      for (std::size_t i = tree_.first(nd); i < tree_.last(nd); ++i) have[i - range_.first] = true;
    }
    for (std::size_t i = 0; i < have.size(); ++i) {
      if (!have[i]) out.push_back(range_.first + i);
    }
    return out;
  }
  /// Micro-batches whose values were kept by `begin(r, true)` in this step.
  [[nodiscard]] std::size_t reused() const noexcept { return reused_; }

  /// The stored nodes, left to right.
  [[nodiscard]] std::vector<node> nodes() const {
    std::vector<node> out;
    for (const auto& [nd, buf] : stored_) out.push_back(nd);
    std::sort(out.begin(), out.end(), [this](node a, node b) { return tree_.first(a) < tree_.first(b); });
    return out;
  }
  /// The node buffer of stored node `n` (`layout().bytes()` bytes, laid out by `layout()`).
  /// @throws usage_error if `n` is not stored
  [[nodiscard]] std::byte* value(node n) const {
    auto it = stored_.find(n);
    if (it == stored_.end()) {
      throw usage_error(-1, "reproducible::accumulator::value",
                        "node (" + std::to_string(n.level) + ", " + std::to_string(n.index) + ") is not stored");
    }
    return buffers_[it->second].data();
  }
  /// Tensor `i` of stored node `n`.
  [[nodiscard]] tensor_view value(node n, std::size_t i) const { return layout_.tensor_view_of(value(n), i); }

  /// The micro-batches of the current step.
  [[nodiscard]] item_range range() const noexcept { return range_; }
  /// The tree.
  [[nodiscard]] const tree& shape() const noexcept { return tree_; }
  /// The layout of a node buffer.
  [[nodiscard]] const layout& buffer_layout() const noexcept { return layout_; }
  /// Node buffers allocated so far (stored and pooled): the memory is this times `layout().bytes()`.
  [[nodiscard]] std::size_t buffers_allocated() const noexcept { return buffers_.size(); }

 private:
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  // A value to settle: external tensors (one view per layout tensor) or an owned buffer.
  struct source {
    const tensor_view* parts;
    std::size_t buffer;
  };

  void check_parts(std::size_t leaf, std::span<const tensor_view> parts) const {
    const char* op = "reproducible::accumulator::add";
    if (!range_.contains(leaf)) {
      throw usage_error(-1, op,
                        "micro-batch " + std::to_string(leaf) + " is not in this rank's range [" +
                            std::to_string(range_.first) + ", " + std::to_string(range_.last) + ")");
    }
    for (node n{0, leaf}; n.level <= tree_.height(); n = tree::parent(n)) {
      if (stored_.count(n)) {
        throw usage_error(-1, op, "micro-batch " + std::to_string(leaf) + " was already added in this step");
      }
    }
    const auto& shapes = layout_.tensors();
    if (parts.size() != shapes.size()) {
      throw usage_error(
          -1, op, std::to_string(parts.size()) + " tensors given, the layout has " + std::to_string(shapes.size()));
    }
    for (std::size_t i = 0; i < parts.size(); ++i) {
      if (parts[i].type != shapes[i].type || parts[i].count != shapes[i].count || !parts[i].where.is_host() ||
          (parts[i].count && !parts[i].data)) {
        throw usage_error(-1, op,
                          "tensor " + std::to_string(i) + " is " + std::to_string(parts[i].count) + " " +
                              std::string(name_of(parts[i].type)) + " on " + parts[i].where.str() +
                              "; the layout wants " + std::to_string(shapes[i].count) + " " +
                              std::string(name_of(shapes[i].type)) + " in host memory");
      }
    }
  }

  [[nodiscard]] bool inside(node n) const noexcept {
    return tree_.first(n) >= range_.first && tree_.last(n) <= range_.last;
  }

  // Climbs from `n` while its parent lies in the range: passes through parents without a right
  // child, adds stored siblings (left operand first), and stores the result where it stops.
  void settle(node n, source s) {
    while (n.level < tree_.height()) {
      const node up = tree::parent(n);
      if (!inside(up)) break;
      const node sib = tree::sibling(n);
      if (!tree_.exists(sib)) {  // pass-through: the parent's value is this node's
        n = up;
        continue;
      }
      auto it = stored_.find(sib);
      if (it == stored_.end()) break;
      const std::size_t sb = it->second;
      stored_.erase(it);
      const bool sib_left = sib.index < n.index;
      combine_into(sb, s, sib_left);
      if (s.buffer != npos) free_.push_back(s.buffer);
      s = source{nullptr, sb};
      n = up;
    }
    if (s.buffer == npos) s.buffer = copy_in(s.parts);
    stored_.emplace(n, s.buffer);
  }

  // buffers_[dst] = sib_left ? dst + s : s + dst.
  void combine_into(std::size_t dst, source s, bool dst_is_left) {
    std::byte* d = buffers_[dst].data();
    if (s.buffer != npos) {
      std::byte* o = buffers_[s.buffer].data();
      for (std::size_t g = 0; g < layout_.groups().size(); ++g) {
        const tensor_view dv = layout_.group_view(d, g);
        const tensor_view ov = layout_.group_view(o, g);
        detail::add(dv.type, dv.data, dst_is_left ? dv.data : ov.data, dst_is_left ? ov.data : dv.data, dv.count);
      }
      return;
    }
    for (std::size_t i = 0; i < layout_.tensors().size(); ++i) {
      const tensor_view dv = layout_.tensor_view_of(d, i);
      const void* ext = s.parts[i].data;
      detail::add(dv.type, dv.data, dst_is_left ? dv.data : ext, dst_is_left ? ext : dv.data, dv.count);
    }
  }

  std::size_t copy_in(const tensor_view* parts) {
    const std::size_t b = acquire();
    for (std::size_t i = 0; i < layout_.tensors().size(); ++i) {
      const tensor_view dv = layout_.tensor_view_of(buffers_[b].data(), i);
      if (dv.count) std::memcpy(dv.data, parts[i].data, dv.bytes());
    }
    return b;
  }

  std::size_t acquire() {
    if (!free_.empty()) {
      const std::size_t b = free_.back();
      free_.pop_back();
      return b;
    }
    buffers_.emplace_back(std::max<std::size_t>(layout_.bytes(), 64));
    return buffers_.size() - 1;
  }

  tree tree_;
  layout layout_;
  item_range range_{};
  std::map<node, std::size_t> stored_;  // complete nodes of this step -> buffer
  std::vector<ddp::detail::aligned_buffer> buffers_;
  std::vector<std::size_t> free_;
  std::size_t reused_ = 0;
};

}  // namespace ddp::reproducible
