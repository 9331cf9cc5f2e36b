#pragma once
/// @file hooks/compress.hpp
/// @brief Compression hooks: cast the bucket to f16 or bf16 (dividing first, by ddp's averaging
/// rule, so the sum cannot overflow), allreduce half the bytes, cast back on completion. PyTorch's fp16/bf16 compress
/// hooks.

#include <cstddef>
#include <memory>
#include <vector>

#include <ddp/average.hpp>
#include <ddp/comm_hook.hpp>
#include <ddp/detail/host_reduce.hpp>
#include <ddp/error.hpp>

namespace ddp::hooks {

namespace detail {
/// Cast-allreduce-cast through a 2-byte float type. Keeps one scratch buffer per bucket index, so
/// steady-state steps allocate nothing; copies of the hook share the scratch.
template <dtype Wire>
class compress {
 public:
  work operator()(grad_bucket& b) const {
    const tensor_view data = b.data;
    if (!is_floating(data.type)) {
      throw usage_error(b.comm.rank(), "comm hook compress",
                        "bucket " + std::to_string(b.index) + " holds " + std::string(name_of(data.type)) +
                            " gradients; compression hooks need floating-point buckets");
    }
    if (data.type == Wire) {  // nothing to compress: the plain average
      return ddp::allreduce_average(b.comm, data, b.divisor, average_input::raw, "comm hook compress");
    }
    if (scratch_->size() <= b.index) scratch_->resize(b.index + 1);
    auto& buf = (*scratch_)[b.index];
    buf.resize(data.count * 2);
    const tensor_view wire{buf.data(), data.count, Wire, data.where};
    // Divide in the wide type before narrowing (ddp's averaging rule, ddp/average.hpp): small
    // values stay representable and the narrow sum cannot overflow.
    average_divide_in_place(data.type, data.data, data.count, b.divisor);
    ddp::detail::convert(data.type, data.data, Wire, wire.data, data.count);
    work w = ddp::allreduce_average(b.comm, wire, b.divisor, average_input::divided, "comm hook compress");
    w.then([data, wire] { ddp::detail::convert(Wire, wire.data, data.type, data.data, data.count); });
    return w;
  }

 private:
  std::shared_ptr<std::vector<std::vector<std::byte>>> scratch_ =
      std::make_shared<std::vector<std::vector<std::byte>>>();
};
}  // namespace detail

/// f32/f64 buckets travel as IEEE half.
using fp16_compress = detail::compress<dtype::f16>;
/// f32/f64 buckets travel as bfloat16 (wider range than fp16, fewer mantissa bits).
using bf16_compress = detail::compress<dtype::bf16>;

}  // namespace ddp::hooks
