#pragma once
/// @file detail/flat_layout.hpp
/// @brief `flat_layout`: groups a reducer's buffers by (strategy, dtype, device) and lays each
/// group out back to back in one host allocation, so one collective covers the group.

#include <cstddef>
#include <memory>
#include <new>
#include <span>
#include <utility>
#include <vector>

#include <ddp/device.hpp>
#include <ddp/dtype.hpp>
#include <ddp/tensor.hpp>

namespace ddp::detail {

/// One buffer as the layout sees it.
struct flat_member {
  std::size_t strategy = 0;  ///< index of the buffer's strategy in the reducer's table of distinct strategies
  dtype type = dtype::f32;
  device where = device::host();
  std::size_t count = 0;
  bool owned = false;  ///< lives in the layout's storage for good (the trainer works on a view of it)
};

/// Zero-initialised host bytes, aligned to a cache line (so flat views are friendly to
/// vectorised reductions and never share a line with unrelated data).
class flat_storage {
 public:
  static constexpr std::align_val_t alignment{64};

  flat_storage() = default;
  explicit flat_storage(std::size_t bytes) : data_(allocate(bytes)) {}

  [[nodiscard]] std::byte* data() const noexcept { return data_.get(); }
  [[nodiscard]] explicit operator bool() const noexcept { return data_ != nullptr; }

 private:
  struct release {
    void operator()(std::byte* p) const noexcept { ::operator delete(p, alignment); }
  };
  static std::unique_ptr<std::byte, release> allocate(std::size_t bytes) {
    // At least one byte, so that an empty group still has storage (and a non-null data pointer).
    const std::size_t n = bytes > 0 ? bytes : 1;
    auto* p = static_cast<std::byte*>(::operator new(n, alignment));
    for (std::size_t i = 0; i < n; ++i) p[i] = std::byte{0};
    return std::unique_ptr<std::byte, release>(p);
  }
  std::unique_ptr<std::byte, release> data_;
};

/// The buffers that share a strategy, a dtype and a device.
struct flat_group {
  std::size_t strategy = 0;
  dtype type = dtype::f32;
  device where = device::host();
  std::vector<std::size_t> members;  ///< registration indices, ascending
  std::vector<std::size_t> offsets;  ///< element offset of each member in the flat storage
  std::vector<std::size_t> counts;   ///< elements of each member
  std::size_t count = 0;             ///< elements over the group
  bool has_owned = false;            ///< some member lives in the storage for good
  /// Empty when the collective can run on the trainer's memory as it is: a group that is one
  /// trainer-owned buffer, or device memory (which host code cannot pack).
  flat_storage storage;

  /// The whole group in its storage (requires storage).
  [[nodiscard]] tensor_view flat() const noexcept { return {storage.data(), count, type, where}; }
  /// Member `k` (position in `members`) in the storage (requires storage).
  [[nodiscard]] tensor_view slice(std::size_t k) const noexcept { return flat().slice(offsets[k], counts[k]); }
};

/// Groups in order of their first member's registration: every rank that registered the same
/// buffers with the same strategies builds the same groups, in the same order.
class flat_layout {
 public:
  flat_layout() = default;

  /// Groups `members` and allocates storage for every host group of several buffers, or that
  /// holds an owned buffer.
  explicit flat_layout(std::span<const flat_member> members) : group_of_(members.size()), position_of_(members.size()) {
    for (std::size_t i = 0; i < members.size(); ++i) {
      const flat_member& m = members[i];
      std::size_t g = 0;
      while (g < groups_.size() &&
             !(groups_[g].strategy == m.strategy && groups_[g].type == m.type && groups_[g].where == m.where)) {
        ++g;
      }
      if (g == groups_.size()) {
        groups_.emplace_back();
        groups_.back().strategy = m.strategy;
        groups_.back().type = m.type;
        groups_.back().where = m.where;
      }
      flat_group& grp = groups_[g];
      group_of_[i] = g;
      position_of_[i] = grp.members.size();
      grp.members.push_back(i);
      grp.offsets.push_back(grp.count);
      grp.counts.push_back(m.count);
      grp.count += m.count;
      grp.has_owned = grp.has_owned || m.owned;
    }
    for (flat_group& grp : groups_) {
      if (grp.where.is_host() && (grp.has_owned || grp.members.size() > 1)) {
        grp.storage = flat_storage(grp.count * size_of(grp.type));
      }
    }
  }

  [[nodiscard]] std::span<const flat_group> groups() const noexcept { return groups_; }
  /// Group of buffer `i`.
  [[nodiscard]] std::size_t group_of(std::size_t i) const { return group_of_[i]; }
  /// Position of buffer `i` within its group.
  [[nodiscard]] std::size_t position_of(std::size_t i) const { return position_of_[i]; }
  /// Buffer `i` in its group's storage (requires that the group has storage).
  [[nodiscard]] tensor_view slice_of(std::size_t i) const { return groups_[group_of_[i]].slice(position_of_[i]); }

 private:
  std::vector<flat_group> groups_;
  std::vector<std::size_t> group_of_;
  std::vector<std::size_t> position_of_;
};

}  // namespace ddp::detail
