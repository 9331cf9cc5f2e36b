#pragma once
/// @file gloo/collectives.hpp
/// @brief The collectives of the communicator concept expressed as blocking gloo calls. Run on
/// the communicator's worker thread, in issue order, so every rank makes the same sequence of
/// gloo calls.
///
/// - allreduce: gloo's allreduce (ring) with our reduction function, so every dtype and op works
///   the same way (gloo has no f16/bf16 in several of its APIs, and no `avg`). Tensors of one
///   call are packed per dtype: one gloo call per dtype present. f16/bf16 travel as f32 unless
///   `widen_half` is off. `avg` is a sum divided afterwards (integers truncate toward zero).
/// - broadcast: one byte-wise gloo broadcast of all tensors packed together.
/// - allgather: gloo's allgather, byte-wise.
/// - reduce_scatter: an allreduce of a copy of the input, of which each rank keeps its block.
///   Twice the bytes of a ring reduce-scatter; correct for every dtype and op.
/// - barrier: gloo's barrier.
/// Every gloo call gets its own tag (slot), so a rank one call ahead or behind cannot have its
/// data taken for another call's: it times out instead.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/context.h>

#include <ddp/detail/host_reduce.hpp>
#include <ddp/dtype.hpp>
#include <ddp/reduce_op.hpp>
#include <ddp/tensor.hpp>

namespace ddp::gloo::detail {

/// What every gloo call of one communicator needs. Used by the worker thread only.
struct call_context {
  std::shared_ptr<::gloo::Context> ctx;
  std::chrono::milliseconds timeout{};
  bool widen_half = true;
  std::uint32_t next_tag = 0;

  std::uint32_t tag() noexcept { return next_tag++; }
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
    o.setOutput<T>(static_cast<T*>(data), n);
    o.setReduceFunction(reduce_function(t, op));
    o.setTag(c.tag());
    o.setTimeout(c.timeout);
    ::gloo::allreduce(o);
  });
  if (op == reduce_op::avg) ddp::detail::divide_in_place(t, data, n, c.ctx->size);
}

inline void run_allreduce(call_context& c, std::span<const tensor_view> views, reduce_op op) {
  for (dtype t : {dtype::f16, dtype::bf16, dtype::f32, dtype::f64, dtype::i8, dtype::u8, dtype::i32, dtype::i64}) {
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
  o.setOutput<std::uint8_t>(static_cast<std::uint8_t*>(data), bytes);
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
  o.setInput<std::uint8_t>(static_cast<std::uint8_t*>(in.data), in.bytes());
  o.setOutput<std::uint8_t>(static_cast<std::uint8_t*>(out.data), out.bytes());
  o.setTag(c.tag());
  o.setTimeout(c.timeout);
  ::gloo::allgather(o);
}

inline void run_reduce_scatter(call_context& c, tensor_view in, tensor_view out, reduce_op op) {
  if (out.count == 0) return;
  const dtype wire = wire_type(in.type, c.widen_half);
  std::vector<std::byte> staging(in.count * size_of(wire));
  ddp::detail::convert(in.type, in.data, wire, staging.data(), in.count);
  allreduce_contiguous(c, staging.data(), in.count, wire, op);
  const std::size_t block = static_cast<std::size_t>(c.ctx->rank) * out.count * size_of(wire);
  ddp::detail::convert(wire, staging.data() + block, out.type, out.data, out.count);
}

inline void run_barrier(call_context& c) {
  ::gloo::BarrierOptions o(c.ctx);
  o.setTag(c.tag());
  o.setTimeout(c.timeout);
  ::gloo::barrier(o);
}

}  // namespace ddp::gloo::detail
