#pragma once
/// @file staged/pinned_pool.hpp
/// @brief `ddp::staged::detail::pinned_pool`: page-locked host buffers of a device runtime, kept
/// for reuse (allocating and freeing page-locked memory is slow, and CUDA's free waits for the
/// device), for the staged communicator's host copies.

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include <ddp/device_runtime.hpp>

namespace ddp::staged::detail {

/// Buffers taken by the calling thread and given back once the stream is done with them.
class pinned_pool {
 public:
  /// Alignment of every region inside a buffer (a cache line, and enough for every dtype).
  static constexpr std::size_t alignment = 64;
  /// `bytes` rounded up to the alignment.
  [[nodiscard]] static constexpr std::size_t aligned(std::size_t bytes) noexcept {
    return (bytes + alignment - 1) / alignment * alignment;
  }

  /// One buffer: `size` bytes at `data`; empty when `data` is null.
  struct buffer {
    std::byte* data = nullptr;  ///< page-locked host memory
    std::size_t size = 0;       ///< its length
  };

  /// Buffers of `rt`.
  explicit pinned_pool(device_runtime& rt) noexcept : rt_(&rt) {}
  pinned_pool(const pinned_pool&) = delete;
  pinned_pool& operator=(const pinned_pool&) = delete;
  /// Frees the buffers given back.
  ~pinned_pool() { clear(); }

  /// A buffer of at least `bytes` (the smallest free one that fits, else a new one of at least
  /// 64 KiB); empty for 0 bytes. @throws what the runtime's allocate_host throws
  [[nodiscard]] buffer take(std::size_t bytes) {
    if (bytes == 0) return {};
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->size >= bytes && (best == free_.end() || it->size < best->size)) best = it;
    }
    if (best != free_.end()) {
      const buffer b = *best;
      free_.erase(best);
      return b;
    }
    const std::size_t size = std::max<std::size_t>(aligned(bytes), std::size_t{64} << 10);
    buffer b{static_cast<std::byte*>(rt_->allocate_host(size)), size};
    held_ += size;
    return b;
  }
  /// Keeps `b` for reuse; nothing for an empty one.
  void give_back(buffer&& b) noexcept {
    if (b.data == nullptr) return;
    try {
      free_.push_back(b);
    } catch (...) {  // no memory to keep it: free it
      rt_->deallocate_host(b.data);
      held_ -= b.size;
    }
    b = {};
  }
  /// Frees every buffer given back (taken ones stay the taker's).
  void clear() noexcept {
    for (const buffer& b : free_) {
      rt_->deallocate_host(b.data);
      held_ -= b.size;
    }
    free_.clear();
  }
  /// Bytes allocated and not freed (taken or kept).
  [[nodiscard]] std::size_t held_bytes() const noexcept { return held_; }

 private:
  device_runtime* rt_;
  std::vector<buffer> free_;
  std::size_t held_ = 0;
};

}  // namespace ddp::staged::detail
