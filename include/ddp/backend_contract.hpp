#pragma once
/// @file backend_contract.hpp
/// @brief The checks every backend runs on a collective call before issuing it, written once:
/// `contract::check_allreduce(me, tensors, op)` and its siblings check the call against the
/// `communicator` contract (communicator.hpp) and return the call's `op_info`, or throw a
/// `usage_error` naming the rank, the collective and the offending tensor.
///
/// One implementation, so that a program moved from one backend to another fails the same way,
/// with the same message. What is checked, the messages, and a backend in outline:
/// docs/writing-a-backend.md ("The contract checks").

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include <ddp/device.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/reduce_op.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp::contract {

/// The memory a backend's collectives read and write, and how its errors name the backend.
struct memory_rule {
  ddp::device where = device::host();         ///< the device every tensor must be on
  std::string_view backend = "this backend";  ///< who needs it, in errors: "the MPI backend"
  std::string_view note = {};                 ///< why, in parentheses after the need, or empty

  /// Host memory only, e.g. `host("the MPI backend", "ddp does not assume a CUDA-aware MPI")`.
  [[nodiscard]] static constexpr memory_rule host(std::string_view backend, std::string_view note = {}) noexcept {
    return {device::host(), backend, note};
  }
  /// CUDA memory of device `ordinal` only.
  [[nodiscard]] static constexpr memory_rule cuda(int ordinal, std::string_view backend,
                                                  std::string_view note = {}) noexcept {
    return {device::cuda(ordinal), backend, note};
  }

  /// What the backend needs, as errors say it: "host memory", "CUDA memory on cuda:0".
  [[nodiscard]] std::string need() const {
    return where.is_host() ? std::string("host memory") : "CUDA memory on " + where.str();
  }
};

/// The calling rank's side of a collective, as its backend knows it before checking the call.
struct caller {
  int rank = -1;                                        ///< the calling rank
  int size = 0;                                         ///< ranks of the communicator
  std::uint64_t seq = 0;                                ///< sequence number the call gets if it passes (errors show it)
  std::chrono::milliseconds timeout = default_timeout;  ///< deadline of the call's work
  memory_rule memory;                                   ///< memory the backend reaches
};

namespace detail {

// The op_info of a call before its tensors are looked at.
[[nodiscard]] inline op_info start_info(const caller& c, const char* name, reduce_op op, int root) {
  op_info info;
  info.rank = c.rank;
  info.name = name;
  info.seq = c.seq;
  info.op = op;
  info.root = root;
  info.timeout = c.timeout;
  return info;
}

// Names tensor `i` of a call's `n` tensors in errors ("" when it is the only one).
[[nodiscard]] inline std::string tensor_label(std::size_t i, std::size_t n) {
  return n == 1 ? std::string() : "tensor #" + std::to_string(i) + " of " + std::to_string(n);
}

// Input and output of an allgather / reduce_scatter: one dtype, checked before their sizes.
inline void check_same_dtype(const op_info& info, tensor_view in, tensor_view out) {
  if (in.type != out.type) {
    throw usage_error(info.rank, info.describe(),
                      "input dtype " + std::string(name_of(in.type)) + " differs from output dtype " +
                          std::string(name_of(out.type)));
  }
}

// `big` must hold `small.count * size` elements (allgather: output over input; reduce_scatter:
// input over output).
inline void check_block_count(const op_info& info, int size, tensor_view small, const char* small_name, tensor_view big,
                              const char* big_name) {
  const std::size_t want = small.count * static_cast<std::size_t>(size);
  if (big.count != want) {
    throw usage_error(info.rank, info.describe(),
                      std::string(big_name) + " has " + std::to_string(big.count) + " elements, expected " +
                          std::to_string(want) + " (" + small_name + " count " + std::to_string(small.count) +
                          " x size " + std::to_string(size) + ")");
  }
}

}  // namespace detail

/// True if the memory of `a` and `b` overlaps (an empty view overlaps nothing).
[[nodiscard]] inline bool overlap(tensor_view a, tensor_view b) noexcept {
  if (a.count == 0 || b.count == 0) return false;
  const std::byte* a0 = a.byte_data();
  const std::byte* b0 = b.byte_data();
  return a0 < b0 + b.bytes() && b0 < a0 + a.bytes();
}

/// True for the in-place form of an allgather: `in` is exactly `rank`'s block of `out`.
[[nodiscard]] inline bool is_in_place_allgather(int rank, tensor_view in, tensor_view out) noexcept {
  return in.count > 0 && in.data == out.byte_data() + static_cast<std::size_t>(rank) * in.bytes();
}

/// Checks that `t` lies in the memory `memory` names and has a data pointer if it has elements.
/// `label` names the tensor within the call ("tensor #2 of 3", "input"); empty for the only one.
/// @throws usage_error naming the rank, the call (`info`), the tensor and both devices
inline void check_memory(const op_info& info, const memory_rule& memory, tensor_view t, std::string_view label = {}) {
  const std::string which = label.empty() ? std::string() : " (" + std::string(label) + ")";
  if (t.where != memory.where) {
    std::string text = std::string(memory.backend) + " needs " + memory.need();
    if (!memory.note.empty()) text += " (" + std::string(memory.note) + ")";
    throw usage_error(info.rank, info.describe(), text + ", got a tensor on " + t.where.str() + which);
  }
  if (t.count > 0 && t.data == nullptr) {
    throw usage_error(info.rank, info.describe(),
                      (label.empty() ? std::string("tensor") : std::string(label)) + " has " + std::to_string(t.count) +
                          " elements but no data pointer");
  }
}

/// Checks an allreduce of `tensors` (in place; one coalesced call, dtypes may differ) and
/// describes it: dtype of the first tensor, elements of all.
/// @throws usage_error as `check_memory`
[[nodiscard]] inline op_info check_allreduce(const caller& c, std::span<const tensor_view> tensors, reduce_op op) {
  op_info info = detail::start_info(c, "allreduce", op, -1);
  if (!tensors.empty()) info.type = tensors.front().type;
  for (const tensor_view& t : tensors) info.count += t.count;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    check_memory(info, c.memory, tensors[i], detail::tensor_label(i, tensors.size()));
  }
  return info;
}

/// Checks a broadcast of `tensors` from `root` and describes it.
/// @throws usage_error if `root` is not a rank, or as `check_memory`
[[nodiscard]] inline op_info check_broadcast(const caller& c, std::span<const tensor_view> tensors, int root) {
  op_info info = detail::start_info(c, "broadcast", reduce_op::sum, root);
  if (!tensors.empty()) info.type = tensors.front().type;
  for (const tensor_view& t : tensors) info.count += t.count;
  if (root < 0 || root >= c.size) {
    throw usage_error(
        c.rank, info.describe(),
        "root " + std::to_string(root) + " is not a rank of a communicator of size " + std::to_string(c.size));
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    check_memory(info, c.memory, tensors[i], detail::tensor_label(i, tensors.size()));
  }
  return info;
}

namespace detail {
/// The common part of allgather and reduce_scatter: one input and one output of the same dtype,
/// one of them a block (`in_is_block`: the input) and the other `size` blocks, both in memory the
/// backend accepts. Describes the call by its input.
[[nodiscard]] inline op_info check_block_collective(const caller& c, const char* name, reduce_op op, tensor_view in,
                                                    tensor_view out, bool in_is_block) {
  op_info info = start_info(c, name, op, -1);
  info.type = in.type;
  info.count = in.count;
  check_same_dtype(info, in, out);
  if (in_is_block) {
    check_block_count(info, c.size, in, "input", out, "output");
  } else {
    check_block_count(info, c.size, out, "output", in, "input");
  }
  check_memory(info, c.memory, in, "input");
  check_memory(info, c.memory, out, "output");
  return info;
}
}  // namespace detail

/// Checks an allgather (`out.count == in.count * size`; rank r's `in` lands at
/// `out[r * in.count]`) and describes it by its input.
/// @throws usage_error on a dtype or size mismatch, an overlap other than the in-place form, or
///   as `check_memory`
[[nodiscard]] inline op_info check_allgather(const caller& c, tensor_view in, tensor_view out) {
  op_info info = detail::check_block_collective(c, "allgather", reduce_op::sum, in, out, /*in_is_block=*/true);
  if (overlap(in, out) && !is_in_place_allgather(c.rank, in, out)) {
    throw usage_error(c.rank, info.describe(),
                      "input overlaps output other than as this rank's block of it (the in-place form, input = "
                      "output[rank * count])");
  }
  return info;
}

/// Checks a reduce_scatter (`in.count == out.count * size`; rank r gets block r of the
/// reduction) and describes it by its input.
/// @throws usage_error on a dtype or size mismatch, overlapping input and output, or as
///   `check_memory`
[[nodiscard]] inline op_info check_reduce_scatter(const caller& c, tensor_view in, tensor_view out, reduce_op op) {
  op_info info = detail::check_block_collective(c, "reduce_scatter", op, in, out, /*in_is_block=*/false);
  if (overlap(in, out)) throw usage_error(c.rank, info.describe(), "input and output overlap");
  return info;
}

/// Describes a barrier (there is nothing to check).
[[nodiscard]] inline op_info check_barrier(const caller& c) {
  return detail::start_info(c, "barrier", reduce_op::sum, -1);
}

}  // namespace ddp::contract
