#pragma once
/// @file device_buffer.hpp
/// @brief Owners of device memory and events from a `device_runtime`: the components keep their
/// device buckets and their stream-ordering events in these, so nothing leaks on an exception.

#include <cstddef>
#include <utility>

#include <ddp/device_runtime.hpp>

namespace ddp::detail {

/// Device memory from `runtime.allocate`, returned with `deallocate` on the same stream when the
/// owner goes (stream-ordered: work already enqueued on that stream still sees it). Move-only.
class device_buffer {
 public:
  device_buffer() = default;
  /// `bytes` on `where`, ordered on `stream`; nothing for 0 bytes.
  device_buffer(device_runtime& runtime, device where, std::size_t bytes, device_stream stream)
      : runtime_(&runtime), stream_(stream), data_(bytes > 0 ? runtime.allocate(where, bytes, stream) : nullptr) {}
  device_buffer(device_buffer&& other) noexcept
      : runtime_(other.runtime_), stream_(other.stream_), data_(std::exchange(other.data_, nullptr)) {}
  device_buffer& operator=(device_buffer&& other) noexcept {
    if (this != &other) {
      release();
      runtime_ = other.runtime_;
      stream_ = other.stream_;
      data_ = std::exchange(other.data_, nullptr);
    }
    return *this;
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { release(); }

  /// The memory (null if none).
  [[nodiscard]] void* data() const noexcept { return data_; }

 private:
  void release() noexcept {
    if (data_ != nullptr) runtime_->deallocate(data_, stream_);
    data_ = nullptr;
  }

  device_runtime* runtime_ = nullptr;
  device_stream stream_{};
  void* data_ = nullptr;
};

/// An event from `runtime.create_event`, destroyed with its owner. Move-only.
class device_event_owner {
 public:
  device_event_owner() = default;
  /// A new event on `where`.
  device_event_owner(device_runtime& runtime, device where) : runtime_(&runtime), event_(runtime.create_event(where)) {}
  device_event_owner(device_event_owner&& other) noexcept
      : runtime_(other.runtime_), event_(std::exchange(other.event_, device_event{})) {}
  device_event_owner& operator=(device_event_owner&& other) noexcept {
    if (this != &other) {
      release();
      runtime_ = other.runtime_;
      event_ = std::exchange(other.event_, device_event{});
    }
    return *this;
  }
  device_event_owner(const device_event_owner&) = delete;
  device_event_owner& operator=(const device_event_owner&) = delete;
  ~device_event_owner() { release(); }

  /// The event (empty if none).
  [[nodiscard]] device_event get() const noexcept { return event_; }

 private:
  void release() noexcept {
    if (event_) runtime_->destroy_event(event_);
    event_ = {};
  }

  device_runtime* runtime_ = nullptr;
  device_event event_{};
};

}  // namespace ddp::detail
