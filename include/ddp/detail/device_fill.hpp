#pragma once
/// @file device_fill.hpp
/// @brief Filling a tensor that may live on a device: the neutral values a joined rank
/// contributes (zeros, or a reduction's identity). On a host tensor a plain write; on a device
/// tensor through the communicator's device runtime, ordered before the collectives that follow
/// on its stream.

#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <ddp/communicator.hpp>
#include <ddp/detail/device_buffer.hpp>
#include <ddp/device_runtime.hpp>
#include <ddp/error.hpp>
#include <ddp/tensor.hpp>

namespace ddp::detail {

// The device queue for filling `t` over `comm`, or a usage_error saying why there is none.
[[nodiscard]] inline device_queue queue_for_fill(communicator_ref comm, const tensor_view& t, const char* op,
                                                 const std::string& what) {
  const device_queue q = comm.device_queue();
  if (q.runtime == nullptr || q.where != t.where) {
    throw usage_error(comm.rank(), op,
                      "cannot fill " + what + " on " + t.where.str() + ": the communicator has " +
                          (q.runtime == nullptr ? std::string("no device stream") : "its stream on " + q.where.str()));
  }
  return q;
}

/// Zeroes `t`: memset on the host; on a device, enqueued on the communicator's stream (no host
/// wait: the collectives issued after it on that stream see the zeros).
/// @throws usage_error if `t` is on a device the communicator has no stream for
inline void zero_fill(communicator_ref comm, const tensor_view& t, const char* op, const std::string& what) {
  if (t.count == 0) return;
  if (t.where.is_host()) {
    std::memset(t.data, 0, t.bytes());
    return;
  }
  const device_queue q = queue_for_fill(comm, t, op, what);
  q.runtime->zero(t.data, t.bytes(), q.stream);
}

/// Fills every element of `t` with the element whose bytes are `value` (`size_of(t.type)` of
/// them). On a device the pattern is built on the host, copied on the communicator's stream, and
/// waited for on the host (the host buffer must outlive the copy): a host synchronisation, for a
/// joined rank, which has no backward pass to overlap.
/// @throws usage_error if `t` is on a device the communicator has no stream for
inline void pattern_fill(communicator_ref comm, const tensor_view& t, std::span<const std::byte> value, const char* op,
                         const std::string& what) {
  if (t.count == 0) return;
  std::vector<std::byte> pattern(t.bytes());
  for (std::size_t k = 0; k < t.count; ++k) std::memcpy(pattern.data() + k * value.size(), value.data(), value.size());
  if (t.where.is_host()) {
    std::memcpy(t.data, pattern.data(), pattern.size());
    return;
  }
  const device_queue q = queue_for_fill(comm, t, op, what);
  device_runtime& rt = *q.runtime;
  const copy_region region{t.data, pattern.data(), pattern.size()};
  rt.copy(std::span<const copy_region>(&region, 1), q.stream);
  const device_event_owner done(rt, q.where);
  rt.record(done.get(), q.stream);
  rt.synchronize(done.get());
}

}  // namespace ddp::detail
