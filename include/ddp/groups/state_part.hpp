#pragma once
/// @file groups/state_part.hpp
/// @brief `group_state`, how the ranks of a replica group hold the replica's training state (which
/// decides what each rank heals), and `detail::state_part`, a rank's part of a replicated state:
/// the i-th of k byte ranges, what rank i heals (docs/replica-groups.md, "Healing by shard").

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <utility>
#include <vector>

#include <ddp/dtype.hpp>
#include <ddp/tensor.hpp>

namespace ddp {

/// How the ranks of a replica group hold the replica's training state.
enum class group_state : unsigned char {
  /// Each rank registers its own part (HSDP: the model sharded inside the group): a rank heals
  /// what it registered, from the same-index rank of an up-to-date group.
  sharded,
  /// Every rank registers the same, whole state (DDP inside the group): rank i heals the i-th of k
  /// equal byte ranges of it, every rank at once, then the group shares the parts inside.
  replicated,
};

namespace detail {

/// Part `index` of `k` of `tensors`: the bytes [index T / k, (index + 1) T / k) of their
/// concatenation (T bytes in all, in order), as byte views of the tensors it covers.
[[nodiscard]] inline std::vector<tensor_view> byte_range_part(std::span<const tensor_view> tensors, int index, int k) {
  std::size_t total = 0;
  for (const tensor_view& t : tensors) total += t.bytes();
  const auto part = static_cast<std::size_t>(index), parts = static_cast<std::size_t>(k);
  const std::size_t first = total / parts * part + std::min(part, total % parts);
  const std::size_t last = first + total / parts + (part < total % parts ? 1 : 0);
  std::vector<tensor_view> out;
  std::size_t at = 0;  // the offset of the tensor in the concatenation
  for (const tensor_view& t : tensors) {
    const std::size_t begin = std::max(first, at), end = std::min(last, at + t.bytes());
    if (begin < end) out.push_back({t.byte_data() + (begin - at), end - begin, dtype::u8, t.where});
    at += t.bytes();
  }
  return out;
}

/// A rank's part of a replicated state (`group_state::replicated`): models `transferable_state`
/// with the byte views of its part (recomputed when the whole state's views change) and the whole
/// state's scalars.
class state_part {
 public:
  state_part(std::function<std::span<const tensor_view>()> whole_tensors,
             std::function<std::span<std::int64_t>()> whole_scalars, int index, int k)
      : whole_tensors_(std::move(whole_tensors)), whole_scalars_(std::move(whole_scalars)), index_(index), k_(k) {}

  /// The byte views of this rank's part, stable until the whole state's views change.
  [[nodiscard]] std::span<const tensor_view> state_tensors() {
    const std::span<const tensor_view> whole = whole_tensors_();
    if (!same_views(whole)) {
      seen_.assign(whole.begin(), whole.end());
      part_ = byte_range_part(whole, index_, k_);
    }
    return part_;
  }
  /// The whole state's scalars (every rank holds them all).
  [[nodiscard]] std::span<std::int64_t> state_scalars() { return whole_scalars_(); }

 private:
  [[nodiscard]] bool same_views(std::span<const tensor_view> whole) const {
    if (whole.size() != seen_.size()) return false;
    for (std::size_t i = 0; i < whole.size(); ++i) {
      if (whole[i].data != seen_[i].data || whole[i].bytes() != seen_[i].bytes()) return false;
    }
    return !seen_.empty() || whole.empty();
  }

  std::function<std::span<const tensor_view>()> whole_tensors_;
  std::function<std::span<std::int64_t>()> whole_scalars_;
  int index_;
  int k_;
  std::vector<tensor_view> seen_;  // the whole state's views part_ was cut from
  std::vector<tensor_view> part_;
};

}  // namespace detail
}  // namespace ddp
