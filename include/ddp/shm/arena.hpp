#pragma once
/// @file shm/arena.hpp
/// @brief `arena`: the part of a node's segment that belongs to one rank, handed out as
/// `arena_block`s. A tensor that lives in its rank's arena is allreduced without being copied
/// in: peers read it where it is.
///
/// First-fit over a sorted free list, 256-byte granules (whole cache-line pairs, so blocks never
/// share a line). Bookkeeping is process-local: only the owning rank allocates in its region.

#include <cstddef>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include <ddp/error.hpp>

namespace ddp::shm {

/// One rank's region of the segment. Thread-safe.
class arena {
 public:
  static constexpr std::size_t granule = 256;

  /// Manages [begin, begin + bytes). `keep_alive` (the mapping) lives as long as any block.
  arena(std::byte* begin, std::size_t bytes, std::shared_ptr<const void> keep_alive)
      : begin_(begin), bytes_(bytes / granule * granule), keep_alive_(std::move(keep_alive)) {
    if (bytes_ > 0) free_.emplace(0, bytes_);
  }
  arena(const arena&) = delete;
  arena& operator=(const arena&) = delete;

  /// Total bytes of the region.
  [[nodiscard]] std::size_t capacity() const noexcept { return bytes_; }
  /// Bytes handed out and not yet returned.
  [[nodiscard]] std::size_t used() const {
    std::lock_guard lk(m_);
    return used_;
  }
  /// True if [p, p + bytes) lies inside this region.
  [[nodiscard]] bool contains(const void* p, std::size_t bytes) const noexcept {
    const auto* b = static_cast<const std::byte*>(p);
    return b >= begin_ && b <= begin_ + bytes_ && bytes <= static_cast<std::size_t>(begin_ + bytes_ - b);
  }
  [[nodiscard]] std::byte* begin() const noexcept { return begin_; }

  /// Takes `bytes` (rounded up to the granule) from the region; nullopt if no free run is large
  /// enough. Returns the offset into the region.
  [[nodiscard]] std::optional<std::size_t> take(std::size_t bytes) {
    if (bytes > bytes_) return std::nullopt;  // also keeps the rounding below from wrapping to 0
    const std::size_t need = (bytes + granule - 1) / granule * granule;
    std::lock_guard lk(m_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < need) continue;
      const std::size_t at = it->first;
      const std::size_t left = it->second - need;
      free_.erase(it);
      if (left > 0) free_.emplace(at + need, left);
      used_ += need;
      return at;
    }
    return std::nullopt;
  }

  /// Returns a run taken with `take(bytes)`, merging it with free neighbours.
  void give_back(std::size_t offset, std::size_t bytes) noexcept {
    const std::size_t size = (bytes + granule - 1) / granule * granule;
    if (size == 0) return;
    std::lock_guard lk(m_);
    used_ -= size;
    auto [it, inserted] = free_.emplace(offset, size);
    if (!inserted) return;  // double free: ignore rather than corrupt the list
    if (auto next = std::next(it); next != free_.end() && it->first + it->second == next->first) {
      it->second += next->second;
      free_.erase(next);
    }
    if (it != free_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == it->first) {
        prev->second += it->second;
        free_.erase(it);
      }
    }
  }

  [[nodiscard]] const std::shared_ptr<const void>& keep_alive() const noexcept { return keep_alive_; }

 private:
  std::byte* begin_;
  std::size_t bytes_;
  std::shared_ptr<const void> keep_alive_;
  mutable std::mutex m_;
  std::map<std::size_t, std::size_t> free_;  // offset -> bytes
  std::size_t used_ = 0;
};

/// Zero-initialised memory in a rank's arena, 256-byte aligned. Move-only; returns the memory
/// on destruction. Keeps the segment mapped while it lives.
class arena_block {
 public:
  arena_block() = default;
  arena_block(std::shared_ptr<arena> owner, std::size_t offset, std::size_t bytes) noexcept
      : owner_(std::move(owner)), offset_(offset), bytes_(bytes) {}
  arena_block(arena_block&& o) noexcept
      : owner_(std::move(o.owner_)), offset_(std::exchange(o.offset_, 0)), bytes_(std::exchange(o.bytes_, 0)) {}
  arena_block& operator=(arena_block&& o) noexcept {
    if (this != &o) {
      release();
      owner_ = std::move(o.owner_);
      offset_ = std::exchange(o.offset_, 0);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  arena_block(const arena_block&) = delete;
  arena_block& operator=(const arena_block&) = delete;
  ~arena_block() { release(); }

  [[nodiscard]] std::byte* data() const noexcept { return owner_ ? owner_->begin() + offset_ : nullptr; }
  [[nodiscard]] std::size_t size() const noexcept { return bytes_; }
  [[nodiscard]] explicit operator bool() const noexcept { return owner_ != nullptr; }

 private:
  void release() noexcept {
    if (owner_) owner_->give_back(offset_, bytes_);
    owner_.reset();
  }
  std::shared_ptr<arena> owner_;
  std::size_t offset_ = 0;
  std::size_t bytes_ = 0;
};

/// Allocates a zero-filled block of `bytes` from `a`.
/// @throws usage_error naming the rank, the request and the arena's state when it does not fit
[[nodiscard]] inline arena_block allocate(const std::shared_ptr<arena>& a, std::size_t bytes, int rank) {
  if (!a || a->capacity() == 0) {
    throw usage_error(rank, "shm::communicator::allocate",
                      "this communicator has no arena: set options::arena_bytes to allocate zero-copy buffers");
  }
  const std::size_t want = bytes == 0 ? 1 : bytes;
  const auto at = a->take(want);
  if (!at) {
    throw usage_error(rank, "shm::communicator::allocate",
                      "arena exhausted: " + std::to_string(bytes) + " bytes requested, " +
                          std::to_string(a->capacity() - a->used()) + " of " + std::to_string(a->capacity()) +
                          " free (raise options::arena_bytes)");
  }
  arena_block b(a, *at, want);
  std::memset(b.data(), 0, want);
  return b;
}

}  // namespace ddp::shm
