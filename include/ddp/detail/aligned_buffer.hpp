#pragma once
/// @file detail/aligned_buffer.hpp
/// @brief A 64-byte aligned, zero-initialised byte buffer (cache-line aligned bucket storage).

#include <cstddef>
#include <cstring>
#include <new>
#include <utility>

namespace ddp::detail {

class aligned_buffer {
 public:
  static constexpr std::align_val_t alignment{64};

  aligned_buffer() = default;
  explicit aligned_buffer(std::size_t bytes)
      : data_(bytes ? static_cast<std::byte*>(::operator new(bytes, alignment)) : nullptr), size_(bytes) {
    if (data_) std::memset(data_, 0, bytes);
  }
  aligned_buffer(aligned_buffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  aligned_buffer& operator=(aligned_buffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  aligned_buffer(const aligned_buffer&) = delete;
  aligned_buffer& operator=(const aligned_buffer&) = delete;
  ~aligned_buffer() { release(); }

  [[nodiscard]] std::byte* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }

 private:
  void release() noexcept {
    if (data_) ::operator delete(data_, alignment);
    data_ = nullptr;
  }
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace ddp::detail
