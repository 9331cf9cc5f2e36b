#pragma once
/// @file detail/staging_pool.hpp
/// @brief `staging_pool`: host staging buffers kept between collectives. A fresh buffer costs its
/// page faults on first touch (a new 64 MiB buffer: 60-90 ms on the 2-core test machine, more than
/// moving its bytes across a host), so a component that stages every call takes its buffers from
/// here and gives them back when the call's work is done. Not for users.

#include <algorithm>
#include <cstddef>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace ddp::detail {

/// Host memory for staging, uninitialised (no pass over it before use).
struct staging_block {
  std::unique_ptr<std::byte[]> bytes;
  std::size_t capacity = 0;
};

/// Free blocks, shared by the calls in flight (thread-safe).
class staging_pool {
 public:
  /// How many free blocks are kept (the rest are released): enough for the buckets of a step.
  static constexpr std::size_t kept = 32;

  /// A block of at least `bytes` bytes: the smallest free one that holds them, else a new one.
  /// Contents unspecified.
  [[nodiscard]] staging_block take(std::size_t bytes) {
    {
      std::lock_guard lk(m_);
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->capacity >= bytes && (best == free_.end() || it->capacity < best->capacity)) best = it;
      }
      if (best != free_.end()) {
        staging_block b = std::move(*best);
        free_.erase(best);
        return b;
      }
    }
    return {std::unique_ptr<std::byte[]>(new std::byte[std::max<std::size_t>(bytes, 1)]), bytes};
  }

  /// Gives `b` back for a later `take`; the smallest block goes when more than `kept` are free.
  void give(staging_block b) {
    if (!b.bytes) return;
    std::lock_guard lk(m_);
    free_.push_back(std::move(b));
    if (free_.size() > kept) {
      free_.erase(std::min_element(free_.begin(), free_.end(), [](const staging_block& x, const staging_block& y) {
        return x.capacity < y.capacity;
      }));
    }
  }

 private:
  std::mutex m_;
  std::vector<staging_block> free_;
};

/// A block taken from a pool for `size()` bytes, given back when destroyed. Move-only.
class pooled_buffer {
 public:
  pooled_buffer() = default;
  pooled_buffer(std::shared_ptr<staging_pool> pool, std::size_t bytes)
      : pool_(std::move(pool)), block_(pool_->take(bytes)), size_(bytes) {}
  pooled_buffer(pooled_buffer&& other) noexcept
      : pool_(std::move(other.pool_)), block_(std::move(other.block_)), size_(other.size_) {}
  pooled_buffer& operator=(pooled_buffer&& other) noexcept {
    if (this != &other) {
      release();
      pool_ = std::move(other.pool_);
      block_ = std::move(other.block_);
      size_ = other.size_;
    }
    return *this;
  }
  pooled_buffer(const pooled_buffer&) = delete;
  pooled_buffer& operator=(const pooled_buffer&) = delete;
  ~pooled_buffer() { release(); }

  [[nodiscard]] std::byte* data() noexcept { return block_.bytes.get(); }
  [[nodiscard]] const std::byte* data() const noexcept { return block_.bytes.get(); }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }

 private:
  void release() noexcept {
    if (pool_) {
      try {
        pool_->give(std::move(block_));
      } catch (...) {  // a failed push_back only loses the block for reuse
      }
      pool_.reset();
    }
  }
  std::shared_ptr<staging_pool> pool_;
  staging_block block_;
  std::size_t size_ = 0;
};

}  // namespace ddp::detail
