#pragma once
/// @file gloo/collectives.hpp
/// @brief The collectives of the communicator concept expressed as blocking gloo calls. Run on
/// the communicator's worker thread, in issue order, so every rank makes the same sequence of
/// gloo calls.
///
/// How each collective maps onto gloo (packing per dtype, f16/bf16 widening, `avg`, ddp's own
/// reduce-scatter ring, one tag per call): docs/backends-gloo.md ("Collectives").

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <ddp/detail/host_reduce.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/reduce_op.hpp>
#include <ddp/tensor.hpp>

namespace ddp::gloo::detail {

/// The buffers gloo is working on right now, so that another thread can abort their waits
/// (gloo/interrupt.hpp says why that is needed).
class buffer_registry {
 public:
  void add(::gloo::transport::UnboundBuffer* b) {
    std::lock_guard lk(m_);
    live_.push_back(b);
  }
  void remove(::gloo::transport::UnboundBuffer* b) noexcept {
    std::lock_guard lk(m_);
    std::erase(live_, b);
  }
  /// Makes the current (or next) send and receive wait of every live buffer return at once.
  /// gloo does not check what its waits return: the collective goes on with whatever is in the
  /// buffers and soon fails on a broken pair; the engine reports it failed either way.
  void abort_waits() noexcept {
    std::lock_guard lk(m_);
    for (auto* b : live_) {
      b->abortWaitSend();
      b->abortWaitRecv();
    }
  }

 private:
  std::mutex m_;
  std::vector<::gloo::transport::UnboundBuffer*> live_;
};

/// What every gloo call of one communicator needs. Used by the worker thread only, except
/// `buffers`, which is thread-safe.
struct call_context {
  std::shared_ptr<::gloo::Context> ctx;
  std::chrono::milliseconds timeout{};
  bool widen_half = true;
  std::uint32_t next_tag = 0;
  buffer_registry* buffers = nullptr;

  std::uint32_t tag() noexcept { return next_tag++; }
};

/// A gloo buffer over caller memory, registered while gloo uses it. Declare it after the gloo
/// options object that takes the buffer: it then unregisters before the buffer is freed.
class registered_buffer {
 public:
  registered_buffer(call_context& c, void* data, std::size_t bytes)
      : registry_(c.buffers), buffer_(c.ctx->createUnboundBuffer(data, bytes)), raw_(buffer_.get()) {
    if (registry_) registry_->add(raw_);
  }
  ~registered_buffer() {
    if (registry_) registry_->remove(raw_);
  }
  registered_buffer(const registered_buffer&) = delete;
  registered_buffer& operator=(const registered_buffer&) = delete;

  /// Hands the buffer to gloo (once).
  std::unique_ptr<::gloo::transport::UnboundBuffer> give() { return std::move(buffer_); }
  /// The buffer, for sends and receives of our own (before or instead of give()).
  ::gloo::transport::UnboundBuffer& get() noexcept { return *raw_; }

 private:
  buffer_registry* registry_;
  std::unique_ptr<::gloo::transport::UnboundBuffer> buffer_;
  ::gloo::transport::UnboundBuffer* raw_;
};

/// gloo's reduction callback: out = a (op) b over n elements; out may alias a or b.
[[nodiscard]] inline ::gloo::AllreduceOptions::Func reduce_function(dtype t, reduce_op op) {
  return [t, op](void* out, const void* a, const void* b, std::size_t n) {
    if (out == a) {
      ddp::detail::reduce_into(t, op, out, b, n);
    } else if (out == b) {  // every op is commutative
      ddp::detail::reduce_into(t, op, out, a, n);
    } else {
      std::memcpy(out, a, n * size_of(t));
      ddp::detail::reduce_into(t, op, out, b, n);
    }
  };
}

/// Dtype the elements of `t` travel and are reduced in.
[[nodiscard]] inline dtype wire_type(dtype t, bool widen_half) noexcept {
  return widen_half && (t == dtype::f16 || t == dtype::bf16) ? dtype::f32 : t;
}

/// In-place allreduce of n contiguous elements of dtype t (`avg` divides afterwards).
inline void allreduce_contiguous(call_context& c, void* data, std::size_t n, dtype t, reduce_op op) {
  if (n == 0) return;
  ddp::detail::visit_dtype(t, [&]<class T>(T) {
    ::gloo::AllreduceOptions o(c.ctx);
    registered_buffer out(c, data, n * sizeof(T));
    o.setOutput<T>(out.give());
    o.setReduceFunction(reduce_function(t, op));
    o.setTag(c.tag());
    o.setTimeout(c.timeout);
    ::gloo::allreduce(o);
  });
  if (op == reduce_op::avg) ddp::detail::divide_in_place(t, data, n, c.ctx->size);
}

inline void run_allreduce(call_context& c, std::span<const tensor_view> views, reduce_op op) {
  for (dtype t : all_dtypes) {  // dtype order: every rank makes the same gloo calls
    std::vector<const tensor_view*> group;
    std::size_t total = 0;
    for (const auto& v : views) {
      if (v.type == t && v.count > 0) {
        group.push_back(&v);
        total += v.count;
      }
    }
    if (group.empty()) continue;
    const dtype wire = wire_type(t, c.widen_half);
    if (group.size() == 1 && wire == t) {  // in place, no copy
      allreduce_contiguous(c, group[0]->data, total, t, op);
      continue;
    }
    std::vector<std::byte> staging(total * size_of(wire));
    std::size_t offset = 0;
    for (const auto* v : group) {
      ddp::detail::convert(t, v->data, wire, staging.data() + offset * size_of(wire), v->count);
      offset += v->count;
    }
    allreduce_contiguous(c, staging.data(), total, wire, op);
    offset = 0;
    for (const auto* v : group) {
      ddp::detail::convert(wire, staging.data() + offset * size_of(wire), t, v->data, v->count);
      offset += v->count;
    }
  }
}

inline void broadcast_bytes(call_context& c, void* data, std::size_t bytes, int root) {
  ::gloo::BroadcastOptions o(c.ctx);
  registered_buffer out(c, data, bytes);
  o.setOutput<std::uint8_t>(out.give());
  o.setRoot(root);
  o.setTag(c.tag());
  o.setTimeout(c.timeout);
  ::gloo::broadcast(o);
}

inline void run_broadcast(call_context& c, std::span<const tensor_view> views, int root) {
  std::vector<const tensor_view*> parts;
  std::size_t total = 0;
  for (const auto& v : views) {
    if (v.count > 0) {
      parts.push_back(&v);
      total += v.bytes();
    }
  }
  if (parts.empty()) return;
  if (parts.size() == 1) {
    broadcast_bytes(c, parts[0]->data, total, root);
    return;
  }
  std::vector<std::byte> staging(total);
  const bool is_root = c.ctx->rank == root;
  std::size_t offset = 0;
  if (is_root) {
    for (const auto* v : parts) {
      std::memcpy(staging.data() + offset, v->data, v->bytes());
      offset += v->bytes();
    }
  }
  broadcast_bytes(c, staging.data(), total, root);
  if (!is_root) {
    offset = 0;
    for (const auto* v : parts) {
      std::memcpy(v->data, staging.data() + offset, v->bytes());
      offset += v->bytes();
    }
  }
}

inline void run_allgather(call_context& c, tensor_view in, tensor_view out) {
  if (in.bytes() == 0) return;
  ::gloo::AllgatherOptions o(c.ctx);
  registered_buffer input(c, in.data, in.bytes());
  registered_buffer output(c, out.data, out.bytes());
  o.setInput<std::uint8_t>(input.give());
  o.setOutput<std::uint8_t>(output.give());
  o.setTag(c.tag());
  o.setTimeout(c.timeout);
  ::gloo::allgather(o);
}

/// gloo slot prefix of ddp's own ring below (gloo's collectives use 0x01 .. 0x08).
inline constexpr std::uint8_t reduce_scatter_slot_prefix = 0x40;

/// Ring reduce-scatter on gloo's transport (gloo has no such collective for arbitrary types and
/// functions): n - 1 steps, each sending one block to the right neighbour and reducing the block
/// received from the left one into a copy of the input; rank r ends with block r fully reduced.
/// Unlike gloo's own collectives it checks what its waits return, so an interrupt ends it.
inline void run_reduce_scatter(call_context& c, tensor_view in, tensor_view out, reduce_op op) {
  if (out.count == 0) return;
  const int n = c.ctx->size;
  const int r = c.ctx->rank;
  const dtype wire = wire_type(in.type, c.widen_half);
  const std::size_t block = out.count * size_of(wire);
  std::vector<std::byte> acc(in.count * size_of(wire));  // in is left untouched
  ddp::detail::convert(in.type, in.data, wire, acc.data(), in.count);
  if (n > 1) {
    std::vector<std::byte> incoming(block);
    registered_buffer sending(c, acc.data(), acc.size());
    registered_buffer receiving(c, incoming.data(), incoming.size());
    const auto slot = ::gloo::Slot::build(reduce_scatter_slot_prefix, c.tag());
    const int right = (r + 1) % n;
    const int left = (r + n - 1) % n;
    for (int step = 0; step < n - 1; ++step) {
      // Block sent at step s + 1 is the one reduced at step s; rank r finishes with block r.
      const auto send_block = static_cast<std::size_t>((r - step - 1 + 2 * n) % n);
      const auto recv_block = static_cast<std::size_t>((r - step - 2 + 2 * n) % n);
      sending.get().send(right, slot, send_block * block, block);
      receiving.get().recv(left, slot, 0, block);
      if (!receiving.get().waitRecv(c.timeout) || !sending.get().waitSend(c.timeout)) {
        throw communication_error(r, "reduce_scatter", "interrupted");  // replaced by the engine's reason
      }
      ddp::detail::reduce_into(wire, op, acc.data() + recv_block * block, incoming.data(), out.count);
    }
  }
  std::byte* mine = acc.data() + static_cast<std::size_t>(r) * block;
  if (op == reduce_op::avg) ddp::detail::divide_in_place(wire, mine, out.count, n);
  ddp::detail::convert(wire, mine, out.type, out.data, out.count);
}

inline void run_barrier(call_context& c) {
  ::gloo::BarrierOptions o(c.ctx);
  o.setTag(c.tag());
  o.setTimeout(c.timeout);
  ::gloo::barrier(o);
}

}  // namespace ddp::gloo::detail
