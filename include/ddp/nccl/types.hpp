#pragma once
/// @file types.hpp
/// @brief Compile-time mapping of ddp element types and reduction operators to NCCL's enums.

#include <nccl.h>

#include <ddp/dtype.hpp>
#include <ddp/nccl/features.hpp>
#include <ddp/reduce_op.hpp>

namespace ddp::nccl {

/// NCCL data type of a ddp dtype. Every ddp dtype has an exact NCCL counterpart, so collectives
/// never need a conversion pass.
[[nodiscard]] constexpr ncclDataType_t to_nccl(dtype t) noexcept {
  switch (t) {
    case dtype::f16: return ncclFloat16;
    case dtype::bf16: return ncclBfloat16;
    case dtype::f32: return ncclFloat32;
    case dtype::f64: return ncclFloat64;
    case dtype::i8: return ncclInt8;
    case dtype::u8: return ncclUint8;
    case dtype::i32: return ncclInt32;
    case dtype::i64: return ncclInt64;
  }
  return ncclNumTypes;  // unreachable for valid enumerators
}

/// NCCL reduction operator of a ddp reduce_op. `avg` maps to `ncclAvg`, which (like ddp's
/// definition) sums, then divides by the communicator size; integers divide with truncation.
[[nodiscard]] constexpr ncclRedOp_t to_nccl(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return ncclSum;
    case reduce_op::avg: return ncclAvg;
    case reduce_op::min: return ncclMin;
    case reduce_op::max: return ncclMax;
    case reduce_op::prod: return ncclProd;
  }
  return ncclNumOps;  // unreachable for valid enumerators
}

}  // namespace ddp::nccl
