#pragma once
/// @file shm/tensor_group.hpp
/// @brief `tensor_group`: the tensors of one dtype in one allreduce call, seen as a single
/// sequence of elements (the pipeline cuts that sequence into chunks, whatever tensors they span).

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <optional>
#include <vector>

#include <ddp/dtype.hpp>
#include <ddp/tensor.hpp>

namespace ddp::shm {

/// Tensors of one dtype reduced as one sequence of elements (a coalesced call's dtype group).
struct tensor_group {
  ddp::dtype type = dtype::f32;     ///< dtype of every part
  std::vector<tensor_view> parts;   ///< non-empty tensors, in call order
  std::vector<std::size_t> starts;  ///< first element of each part in the sequence
  std::size_t total = 0;            ///< elements of all parts
  /// Segment offset of the only part when it lies in this rank's arena: it is then reduced where
  /// it is (zero-copy) instead of through the staging slots.
  std::optional<std::size_t> zero_copy_offset;

  /// Appends `t` to the sequence.
  void add(tensor_view t) {
    parts.push_back(t);
    starts.push_back(total);
    total += t.count;
  }

  /// Address of elements [first, first + n) if they lie in one part, else null.
  [[nodiscard]] std::byte* contiguous(std::size_t first, std::size_t n) const noexcept {
    if (n == 0 || parts.empty()) return nullptr;
    auto it = std::upper_bound(starts.begin(), starts.end(), first);
    const auto p = static_cast<std::size_t>(it - starts.begin()) - 1;
    const std::size_t at = first - starts[p];
    return at + n <= parts[p].count ? parts[p].byte_data() + at * size_of(type) : nullptr;
  }

  /// Copies elements [first, first + n) of the sequence to `dst`.
  void copy_out(std::size_t first, std::size_t n, std::byte* dst) const noexcept {
    visit(first, n, [&](const tensor_view& t, std::size_t at, std::size_t m, std::size_t done) {
      std::memcpy(dst + done * size_of(type), t.byte_data() + at * size_of(type), m * size_of(type));
    });
  }
  /// Copies `src` into elements [first, first + n) of the sequence.
  void copy_in(std::size_t first, std::size_t n, const std::byte* src) const noexcept {
    visit(first, n, [&](const tensor_view& t, std::size_t at, std::size_t m, std::size_t done) {
      std::memcpy(t.byte_data() + at * size_of(type), src + done * size_of(type), m * size_of(type));
    });
  }

  /// fn(address, elements done before, elements) over the pieces of [first, first + n) that lie
  /// in one part each, in order.
  template <class F>
  void pieces(std::size_t first, std::size_t n, F&& fn) const noexcept {
    visit(first, n, [&](const tensor_view& t, std::size_t at, std::size_t m, std::size_t done) {
      fn(t.byte_data() + at * size_of(type), done, m);
    });
  }

 private:
  // fn(part, element offset in the part, elements, elements done before) over the pieces of the range.
  template <class F>
  void visit(std::size_t first, std::size_t n, F&& fn) const noexcept {
    if (n == 0) return;
    auto it = std::upper_bound(starts.begin(), starts.end(), first);
    auto p = static_cast<std::size_t>(it - starts.begin()) - 1;
    std::size_t done = 0;
    while (done < n) {
      const tensor_view& t = parts[p];
      const std::size_t at = first + done - starts[p];
      const std::size_t m = std::min(n - done, t.count - at);
      fn(t, at, m, done);
      done += m;
      ++p;
    }
  }
};

}  // namespace ddp::shm
