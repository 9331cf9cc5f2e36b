#pragma once
/// @file device_runtime.hpp
/// @brief The small device-runtime interface the components use for gradients and buffers in
/// device memory: stream-ordered allocation, copies and zero fills, and events to order streams
/// without blocking the host. Two implementations: `ddp::cuda::runtime` (ddp/cuda/runtime.hpp,
/// the CUDA runtime API) and `ddp::emulated_device::runtime` (ddp/testing/emulated.hpp, host
/// memory and ordered queues, so that device code paths run, and are tested, without a GPU).
///
/// A communicator whose collectives run on a device stream says so with `device_queue()`
/// (`device_communicator`): the runtime, the stream its collectives are enqueued on, and its
/// device. Components then order their copies on that stream, around the collectives, and never
/// wait on the host unless asked to. Contract of such a communicator, in addition to
/// communicator.hpp's:
/// - a collective over device tensors is enqueued on `device_queue().stream` in call order and
///   returns at once; its `work` completes when the collective completed on the device (so
///   work enqueued on the stream after the call sees the result: no host wait is needed);
/// - a collective over host tensors (the components' small control messages: layout checks,
///   join bookkeeping) is staged through device memory and has completed when the call returns.
///   It is a host synchronisation: never use one on a hot path.

#include <cstddef>
#include <span>
#include <string>
#include <string_view>

#include <ddp/device.hpp>
#include <ddp/error.hpp>

namespace ddp {

/// A stream of the device runtime (for CUDA: a `cudaStream_t`; null is the legacy default
/// stream). Does not own it.
struct device_stream {
  void* native = nullptr;  ///< the runtime's handle
  /// Same handle.
  friend bool operator==(const device_stream&, const device_stream&) = default;
};

/// An event of the device runtime (for CUDA: a `cudaEvent_t`). Does not own it.
struct device_event {
  void* native = nullptr;  ///< the runtime's handle; null: no event
  /// Same handle.
  friend bool operator==(const device_event&, const device_event&) = default;
  /// True if it names an event.
  [[nodiscard]] explicit operator bool() const noexcept { return native != nullptr; }
};

/// A gate of the device runtime: work enqueued on a stream after `wait_gate` runs only once the
/// host opened the gate. How a device communicator over a host transport orders a host
/// collective into a stream (ddp/staged/communicator.hpp). Does not own it.
struct device_gate {
  void* native = nullptr;  ///< the runtime's handle; null: no gate
  /// Same handle.
  friend bool operator==(const device_gate&, const device_gate&) = default;
  /// True if it names a gate.
  [[nodiscard]] explicit operator bool() const noexcept { return native != nullptr; }
};

/// One copy of a batch: `bytes` from `src` to `dst`, either of which may be host or device memory.
struct copy_region {
  void* dst = nullptr;        ///< destination
  const void* src = nullptr;  ///< source
  std::size_t bytes = 0;      ///< length; 0 copies nothing
};

/// The device operations the components need. Every call that takes a stream enqueues work on it
/// and returns without waiting for the device, except `synchronize`. Errors are
/// `communication_error`s naming the rank given at construction and the runtime call.
/// Thread-safe: a Bucketer's `mark_ready` may enqueue from several threads.
class device_runtime {
 public:
  device_runtime() = default;
  device_runtime(const device_runtime&) = delete;
  device_runtime& operator=(const device_runtime&) = delete;
  virtual ~device_runtime() = default;

  /// "cuda", "emulated": for error messages.
  [[nodiscard]] virtual std::string_view name() const noexcept = 0;

  /// `bytes` of memory on `where`, usable by work enqueued on `stream` after this call (CUDA:
  /// `cudaMallocAsync`). Never null for `bytes` > 0.
  [[nodiscard]] virtual void* allocate(device where, std::size_t bytes, device_stream stream) = 0;
  /// Returns memory from `allocate` once the work enqueued on `stream` so far completed.
  virtual void deallocate(void* memory, device_stream stream) noexcept = 0;

  /// Enqueues the copies on `stream`, in order (one batched call where the runtime has one).
  virtual void copy(std::span<const copy_region> regions, device_stream stream) = 0;
  /// Enqueues `bytes` zero bytes at `memory` on `stream`.
  virtual void zero(void* memory, std::size_t bytes, device_stream stream) = 0;

  /// A new stream on `where` (owned by the runtime until `destroy_stream`).
  [[nodiscard]] virtual device_stream create_stream(device where) = 0;
  /// Destroys a stream from `create_stream` once its work completed.
  virtual void destroy_stream(device_stream stream) noexcept = 0;

  /// A new event on `where`, without timing (owned by the caller until `destroy_event`).
  [[nodiscard]] virtual device_event create_event(device where) = 0;
  /// Destroys an event; allowed while the work it captured is pending.
  virtual void destroy_event(device_event event) noexcept = 0;
  /// Captures the work enqueued on `stream` so far.
  virtual void record(device_event event, device_stream stream) = 0;
  /// Work enqueued on `stream` after this call waits for the work `event` captured; the host
  /// does not block.
  virtual void wait(device_stream stream, device_event event) = 0;
  /// True once the work `event` captured completed (an event never recorded counts as complete).
  [[nodiscard]] virtual bool query(device_event event) = 0;
  /// Blocks the host until the work `event` captured completed: a host synchronisation.
  virtual void synchronize(device_event event) = 0;

  // ---- host staging (optional: a runtime without it throws usage_error) ------------------------

  /// `bytes` of page-locked host memory, which copies to and from the device can use without
  /// blocking the host (CUDA: `cudaHostAlloc`). Never null for `bytes` > 0.
  [[nodiscard]] virtual void* allocate_host(std::size_t bytes) {
    (void)bytes;
    throw unsupported("allocate_host");
  }
  /// Frees memory from `allocate_host`; no copy may still use it. Null is ignored.
  virtual void deallocate_host(void* memory) noexcept { (void)memory; }
  /// A new gate, closed (owned by the caller until `destroy_gate`).
  [[nodiscard]] virtual device_gate create_gate() { throw unsupported("create_gate"); }
  /// Work enqueued on `stream` after this call waits until `gate` is opened; the host does not block.
  virtual void wait_gate(device_stream stream, device_gate gate) {
    (void)stream;
    (void)gate;
    throw unsupported("wait_gate");
  }
  /// Opens `gate`, from any thread: streams waiting on it go on. Opening it again does nothing.
  virtual void open_gate(device_gate gate) noexcept { (void)gate; }
  /// Destroys a gate; allowed while a stream still waits on it only once it is open.
  virtual void destroy_gate(device_gate gate) noexcept { (void)gate; }

 private:
  [[nodiscard]] usage_error unsupported(const char* operation) const {
    return usage_error(-1, std::string("device_runtime::") + operation,
                       "the " + std::string(name()) + " runtime does not stage through host memory");
  }
};

/// Where a communicator's collectives run on a device (see the file comment).
struct device_queue {
  device_runtime* runtime = nullptr;  ///< the runtime of the stream and the memory
  device_stream stream;               ///< collectives are enqueued here, in call order
  device where;                       ///< the device of the communicator's collectives
};

}  // namespace ddp
