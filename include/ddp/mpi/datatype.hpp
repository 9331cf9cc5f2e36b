#pragma once
/// @file mpi/datatype.hpp
/// @brief The predefined MPI datatypes and reduction operators of ddp's dtypes and ops.

#include <mpi.h>

#include <ddp/dtype.hpp>
#include <ddp/reduce_op.hpp>

namespace ddp::mpi {

/// True if MPI has a predefined datatype for `t` (all but the 2-byte floats).
[[nodiscard]] constexpr bool has_native_datatype(dtype t) noexcept { return t != dtype::f16 && t != dtype::bf16; }

/// The predefined MPI datatype of `t`; MPI_DATATYPE_NULL for f16/bf16, which MPI lacks (each
/// communicator creates its own 2-byte type and operators for them, see `type_table`).
[[nodiscard]] inline MPI_Datatype native_datatype(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return MPI_FLOAT;
    case dtype::f64: return MPI_DOUBLE;
    case dtype::i8: return MPI_INT8_T;
    case dtype::u8: return MPI_UINT8_T;
    case dtype::i32: return MPI_INT32_T;
    case dtype::i64: return MPI_INT64_T;
    case dtype::f16:
    case dtype::bf16: break;
  }
  return MPI_DATATYPE_NULL;
}

/// The predefined MPI operator of `op`. `avg` maps to MPI_SUM: the division by the communicator
/// size happens after the collective.
[[nodiscard]] inline MPI_Op native_op(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum:
    case reduce_op::avg: return MPI_SUM;
    case reduce_op::prod: return MPI_PROD;
    case reduce_op::min: return MPI_MIN;
    case reduce_op::max: return MPI_MAX;
  }
  return MPI_SUM;
}

}  // namespace ddp::mpi
