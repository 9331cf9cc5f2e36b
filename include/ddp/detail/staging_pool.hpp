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

/// Free buffers, shared by the calls in flight (thread-safe).
class staging_pool {
 public:
  /// How many free buffers are kept (the rest are released).
  static constexpr std::size_t kept = 8;

  /// A buffer of `bytes` bytes: the smallest free one that holds them, else the largest resized,
  /// else a new one. Contents unspecified.
  [[nodiscard]] std::vector<std::byte> take(std::size_t bytes) {
    std::vector<std::byte> b;
    {
      std::lock_guard lk(m_);
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        const bool fits = it->capacity() >= bytes;
        if (best == free_.end() || (fits && (best->capacity() < bytes || it->capacity() < best->capacity())) ||
            (!fits && best->capacity() < bytes && it->capacity() > best->capacity())) {
          best = it;
        }
      }
      if (best != free_.end()) {
        b = std::move(*best);
        free_.erase(best);
      }
    }
    b.resize(bytes);
    return b;
  }

  /// Gives `b` back for a later `take`.
  void give(std::vector<std::byte> b) {
    if (b.capacity() == 0) return;
    std::lock_guard lk(m_);
    if (free_.size() < kept) free_.push_back(std::move(b));
  }

 private:
  std::mutex m_;
  std::vector<std::vector<std::byte>> free_;
};

/// A buffer taken from a pool, given back when destroyed. Move-only.
class pooled_buffer {
 public:
  pooled_buffer() = default;
  pooled_buffer(std::shared_ptr<staging_pool> pool, std::size_t bytes)
      : pool_(std::move(pool)), bytes_(pool_->take(bytes)) {}
  pooled_buffer(pooled_buffer&&) noexcept = default;
  pooled_buffer& operator=(pooled_buffer&& other) noexcept {
    if (this != &other) {
      release();
      pool_ = std::move(other.pool_);
      bytes_ = std::move(other.bytes_);
    }
    return *this;
  }
  pooled_buffer(const pooled_buffer&) = delete;
  pooled_buffer& operator=(const pooled_buffer&) = delete;
  ~pooled_buffer() { release(); }

  [[nodiscard]] std::byte* data() noexcept { return bytes_.data(); }
  [[nodiscard]] const std::byte* data() const noexcept { return bytes_.data(); }
  [[nodiscard]] std::size_t size() const noexcept { return bytes_.size(); }

 private:
  void release() noexcept {
    if (pool_) {
      try {
        pool_->give(std::move(bytes_));
      } catch (...) {  // a failed push_back only loses the buffer for reuse
      }
      pool_.reset();
    }
  }
  std::shared_ptr<staging_pool> pool_;
  std::vector<std::byte> bytes_;
};

}  // namespace ddp::detail
