#pragma once
/// @file detail/host_staging.hpp
/// @brief (detail) Staging of a collective over host tensors through device memory, for a
/// communicator whose collectives run on a device stream (`device_communicator`): the
/// components' small control messages (layout checks, join bookkeeping) are host tensors.
///
/// Written against the `device_runtime` interface only, so every device backend (the emulated
/// one, NCCL) stages the same way:
/// @code
/// ddp::detail::host_staging staging(queue);
/// const ddp::tensor_view d = staging.stage(host_tensor, /*copy_in=*/true);  // allocate + copy in
/// ddp::work w = enqueue_collective_over(d);                                   // on queue.stream
/// staging.finish(std::move(w), info);  // copy out, wait, free; rethrows the collective's error
/// @endcode
/// `finish` is a host synchronisation: the call completes before it returns. Never use a staged
/// collective on a hot path.

#include <cstddef>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include <ddp/device_runtime.hpp>
#include <ddp/error.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp::detail {

/// Device copies of host tensors for one staged collective (see the file comment). Stage the
/// enclosing view first: a later view that lies inside an already-staged one (the input of an
/// in-place allgather, inside the output) is a view of the same device copy.
class host_staging {
 public:
  /// Stages through `queue`'s runtime, on its stream and device.
  /// @throws usage_error if the queue has no runtime
  explicit host_staging(device_queue queue) : q_(queue) {
    if (q_.runtime == nullptr) {
      throw usage_error(-1, "host_staging", "a device queue without a runtime cannot stage host tensors");
    }
  }
  host_staging(const host_staging&) = delete;
  host_staging& operator=(const host_staging&) = delete;

  /// Frees what `finish` did not (an exception before it): stream-ordered, so memory still used
  /// by work enqueued on the stream is freed after that work.
  ~host_staging() { release(); }

  /// The device view of `host`, tagged with the queue's device. A view inside an already-staged
  /// one is the corresponding part of that one's device copy; otherwise a new device copy is
  /// allocated on the stream. `copy_in`: the host values are copied in (for a view inside a
  /// staged one, only its part). `copy_out`: `finish` copies the device values back to `host`
  /// (ignored for a view inside a staged one: the enclosing view's flag decides).
  [[nodiscard]] tensor_view stage(tensor_view host, bool copy_in, bool copy_out = true) {
    tensor_view dev = host;
    dev.where = q_.where;
    if (host.count == 0) {
      dev.data = nullptr;
      return dev;
    }
    for (const entry& e : entries_) {
      const std::byte* h0 = e.host.byte_data();
      if (host.byte_data() >= h0 && host.byte_data() + host.bytes() <= h0 + e.host.bytes()) {
        dev.data = static_cast<std::byte*>(e.device) + (host.byte_data() - h0);
        if (copy_in) copy_in_now(dev.data, host);
        return dev;
      }
    }
    void* memory = q_.runtime->allocate(q_.where, host.bytes(), q_.stream);
    entries_.push_back({host, memory, copy_out});
    dev.data = memory;
    if (copy_in) copy_in_now(memory, host);
    return dev;
  }

  /// Completes the staged call: enqueues the copies back to the host after `collective` (which
  /// was enqueued on the queue's stream after the copies in) and the frees of the device copies,
  /// waits for the collective (its work: errors and timeouts as its backend reports them), then
  /// `synchronize`s the copies back and the frees (the host synchronisation): nothing of the
  /// call is left on the stream.
  /// @throws the collective's error; a failure of the copies back, named after `info`
  void finish(work collective, const op_info& info) {
    std::vector<copy_region> out;
    for (const entry& e : entries_) {
      if (e.copy_out) out.push_back({e.host.data, e.device, e.host.bytes()});
    }
    if (!out.empty()) q_.runtime->copy(out, q_.stream);
    release_memory();
    event_ = q_.runtime->create_event(q_.where);
    q_.runtime->record(event_, q_.stream);
    try {
      collective.wait();
    } catch (...) {
      // The copies back are behind the failed collective: make sure they will never write the
      // host buffers after this returns (the stream failed, or the backend aborted it).
      try {
        q_.runtime->synchronize(event_);
      } catch (...) {
      }
      release();
      throw;
    }
    try {
      q_.runtime->synchronize(event_);
    } catch (const timeout_error& e) {
      release();
      throw timeout_error(info.rank, info.describe(), "copying the result back to host memory: " + e.message());
    } catch (const error& e) {
      release();
      throw communication_error(info.rank, info.describe(),
                                "copying the result back to host memory failed: " + e.message());
    }
    release();
  }

 private:
  struct entry {
    tensor_view host;
    void* device = nullptr;
    bool copy_out = true;
  };

  void copy_in_now(void* dst, tensor_view host) {
    const copy_region r{dst, host.data, host.bytes()};
    q_.runtime->copy({&r, 1}, q_.stream);
  }

  void release_memory() noexcept {
    for (const entry& e : entries_) q_.runtime->deallocate(e.device, q_.stream);
    entries_.clear();
  }

  void release() noexcept {
    release_memory();
    if (event_) q_.runtime->destroy_event(event_);
    event_ = {};
  }

  device_queue q_;
  std::vector<entry> entries_;
  device_event event_;
};

}  // namespace ddp::detail
