#pragma once
/// @file event.hpp
/// @brief Owning wrapper of a timing-free `cudaEvent_t`: the completion marker of a collective
/// and the hand-off point between the communicator's stream and the trainer's streams.

#include <cuda_runtime_api.h>

#include <string_view>
#include <utility>

#include <ddp/nccl/error.hpp>

namespace ddp::nccl {

/// Move-only owner of a CUDA event created with `cudaEventDisableTiming` (cheapest to record
/// and query). Create it with the owning device current.
class event {
 public:
  event() = default;
  /// @throws communication_error if `cudaEventCreateWithFlags` fails
  [[nodiscard]] static event create(int rank, std::string_view operation) {
    event e;
    check_cuda(cudaEventCreateWithFlags(&e.native_, cudaEventDisableTiming), rank, operation,
               "cudaEventCreateWithFlags");
    return e;
  }
  /// Takes over `other`'s event; `other` becomes empty.
  event(event&& other) noexcept : native_(std::exchange(other.native_, nullptr)) {}
  /// Destroys this object's event, then takes over `other`'s.
  event& operator=(event&& other) noexcept {
    if (this != &other) {
      reset();
      native_ = std::exchange(other.native_, nullptr);
    }
    return *this;
  }
  event(const event&) = delete;
  event& operator=(const event&) = delete;
  /// Destroying an event whose recorded work is still pending is allowed: CUDA releases it
  /// once the work completed.
  ~event() { reset(); }

  /// Captures the work enqueued on `stream` so far.
  /// @throws communication_error
  void record(cudaStream_t stream, int rank, std::string_view operation) const {
    check_cuda(cudaEventRecord(native_, stream), rank, operation, "cudaEventRecord");
  }

  /// Makes `stream` wait (on the device) for the work captured by the last `record`; the host
  /// does not block.
  /// @throws communication_error
  void make_wait(cudaStream_t stream, int rank, std::string_view operation) const {
    check_cuda(cudaStreamWaitEvent(stream, native_, 0), rank, operation, "cudaStreamWaitEvent");
  }

  /// `cudaSuccess` once the captured work completed on the device, `cudaErrorNotReady` before,
  /// any other value on failure.
  [[nodiscard]] cudaError_t query() const noexcept { return cudaEventQuery(native_); }

  /// The CUDA event (still owned by this object); null if empty.
  [[nodiscard]] cudaEvent_t native_handle() const noexcept { return native_; }
  /// True if an event is owned (made by `create`, not default-constructed or moved from).
  [[nodiscard]] explicit operator bool() const noexcept { return native_ != nullptr; }

 private:
  void reset() noexcept {
    if (native_ != nullptr) (void)cudaEventDestroy(native_);
    native_ = nullptr;
  }

  cudaEvent_t native_ = nullptr;
};

}  // namespace ddp::nccl
