#pragma once
/// @file bucketer/device.hpp
/// @brief The Bucketer's device part: device buckets on the communicator's stream, ordered after
/// the trainer's compute stream and before it again at finalize (docs/bucketer.md, "Device
/// gradients"). Not for users.

#include <cstddef>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/detail/device_buffer.hpp>
#include <ddp/device_runtime.hpp>
#include <ddp/tensor.hpp>

namespace ddp::detail {

/// The communicator's device stream and the events and compute stream a Bucketer orders its device
/// work with. With a host communicator (`on_device()` false) only `problem` is used.
class bucketer_device {
 public:
  explicit bucketer_device(device_queue dq) : dq_(std::move(dq)) {}

  /// True for a device communicator: the buckets live in device memory.
  [[nodiscard]] bool on_device() const noexcept { return dq_.runtime != nullptr; }
  /// The communicator's device, stream and runtime.
  [[nodiscard]] const device_queue& queue() const noexcept { return dq_; }
  /// A compute stream was set.
  [[nodiscard]] bool has_compute() const noexcept { return has_compute_; }

  /// Why a gradient on `g.where` cannot be averaged over this communicator ("" if it can): host
  /// gradients need a host communicator, device gradients a device communicator on their device.
  [[nodiscard]] std::string problem(const tensor_view& g) const {
    if (dq_.runtime == nullptr) {
      if (g.where.is_host()) return {};
      return "is on " + g.where.str() +
             ", but the communicator runs its collectives on host memory: device gradients need a device "
             "communicator (ddp::nccl::communicator)";
    }
    if (g.where == dq_.where) return {};
    return "is on " + g.where.str() + ", but the communicator's collectives run on " + dq_.where.str() +
           ": a Bucketer's gradients are all on its communicator's device";
  }

  /// At build(): one ready event per gradient (recorded by mark_ready) and the finalize event.
  void prepare(std::size_t gradients) {
    ready_events_.clear();
    for (std::size_t i = 0; i < gradients; ++i) ready_events_.emplace_back(*dq_.runtime, dq_.where);
    done_event_ = device_event_owner(*dq_.runtime, dq_.where);
  }

  /// Sets the trainer's compute stream; once built, its next work waits for the comm stream.
  void set_compute_stream(device_stream stream, bool built) {
    compute_ = stream;
    has_compute_ = true;
    if (built) order_compute_after_comm();
  }

  /// Work enqueued on the compute stream from now on runs after the work on the comm stream so
  /// far (a no-op before build() or without a compute stream).
  void order_compute_after_comm() {
    if (!has_compute_ || !done_event_.get()) return;
    dq_.runtime->record(done_event_.get(), dq_.stream);
    dq_.runtime->wait(compute_, done_event_.get());
  }

  /// The comm stream waits for gradient i's producer: `produced`, or an event recorded now on the
  /// compute stream. False if neither exists (the caller names the gradient in its error).
  [[nodiscard]] bool wait_for_producer(std::size_t i, device_event produced) {
    if (!produced) {
      if (!has_compute_) return false;
      produced = ready_events_[i].get();
      dq_.runtime->record(produced, compute_);
    }
    dq_.runtime->wait(dq_.stream, produced);
    return true;
  }

  /// A bucket of `bytes` on the communicator's device, allocated in order on its stream.
  [[nodiscard]] device_buffer allocate(std::size_t bytes) const {
    return device_buffer(*dq_.runtime, dq_.where, bytes, dq_.stream);
  }
  /// One batch of copies on the comm stream.
  void copy(std::span<const copy_region> regions) const { dq_.runtime->copy(regions, dq_.stream); }
  /// Zeroes `bytes` at `data` on the comm stream.
  void zero(void* data, std::size_t bytes) const { dq_.runtime->zero(data, bytes, dq_.stream); }

  /// finalize(): the compute stream (if any) waits for everything on the comm stream so far.
  void order_finalize() {
    dq_.runtime->record(done_event_.get(), dq_.stream);
    if (has_compute_) dq_.runtime->wait(compute_, done_event_.get());
  }
  /// The host waits for what `order_finalize()` captured (the copies back).
  void synchronize() const { dq_.runtime->synchronize(done_event_.get()); }

 private:
  device_queue dq_;          // the communicator's device stream (runtime null: host gradients)
  device_stream compute_{};  // the backward pass's stream (set_compute_stream)
  bool has_compute_ = false;
  std::vector<device_event_owner> ready_events_;  // per gradient, recorded by mark_ready(i)
  device_event_owner done_event_;                 // the comm stream at finalize()
};

}  // namespace ddp::detail
