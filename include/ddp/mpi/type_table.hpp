#pragma once
/// @file mpi/type_table.hpp
/// @brief `detail::type_table`: the MPI datatype and operator of every (dtype, reduce_op) for one
/// communicator, owning the ones MPI lacks (f16 and bf16).

#include <mpi.h>

#include <array>
#include <cstddef>

#include <ddp/detail/host_reduce.hpp>
#include <ddp/dtype.hpp>
#include <ddp/mpi/datatype.hpp>
#include <ddp/mpi/error.hpp>
#include <ddp/reduce_op.hpp>

namespace ddp::mpi::detail {

/// MPI user function reducing `len` 2-byte floats: inout[i] = in[i] (op) inout[i], computed in
/// float per element (the ddp rule for f16/bf16). One instantiation per (type, op) because an
/// MPI_User_function has no user-data argument and ddp keeps no global state to look it up.
template <class T, reduce_op Op>
void reduce_two_byte(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  ddp::detail::reduce_typed<T>(Op, static_cast<T*>(inout), static_cast<const T*>(in), static_cast<std::size_t>(*len));
}

/// Per-communicator table of MPI datatypes and operators. Created with the communicator and
/// freed with it, so several communicators (or several libraries) never share MPI objects.
class type_table {
 public:
  type_table() = default;
  type_table(const type_table&) = delete;
  type_table& operator=(const type_table&) = delete;
  ~type_table() { release(); }

  /// Creates the 2-byte datatype and the 8 f16/bf16 operators. Throws `mpi_error`.
  void create(int rank) {
    try {
      check(MPI_Type_contiguous(2, MPI_BYTE, &two_byte_), rank, "mpi::communicator", "MPI_Type_contiguous");
      check(MPI_Type_commit(&two_byte_), rank, "mpi::communicator", "MPI_Type_commit");
      create_ops<half>(0, rank);
      create_ops<bfloat16>(4, rank);
    } catch (...) {
      release();
      throw;
    }
  }

  /// The datatype that moves elements of `t`.
  [[nodiscard]] MPI_Datatype datatype(dtype t) const noexcept {
    return has_native_datatype(t) ? native_datatype(t) : two_byte_;
  }

  /// The operator reducing elements of `t` with `op` (`avg` reduces like `sum`).
  [[nodiscard]] MPI_Op op(dtype t, reduce_op op) const noexcept {
    if (has_native_datatype(t)) return native_op(op);
    return ops_[(t == dtype::bf16 ? 4u : 0u) + slot(op)];
  }

  /// Frees the MPI objects if MPI is still running. Idempotent.
  void release() noexcept {
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (finalized) {
      forget();
      return;
    }
    for (MPI_Op& o : ops_) {
      if (o != MPI_OP_NULL) MPI_Op_free(&o);
      o = MPI_OP_NULL;
    }
    if (two_byte_ != MPI_DATATYPE_NULL) MPI_Type_free(&two_byte_);
    two_byte_ = MPI_DATATYPE_NULL;
  }

  /// Drops the handles without freeing them (when MPI may not be called from this thread).
  void forget() noexcept {
    ops_.fill(MPI_OP_NULL);
    two_byte_ = MPI_DATATYPE_NULL;
  }

 private:
  static constexpr std::size_t slot(reduce_op op) noexcept {
    switch (op) {
      case reduce_op::sum:
      case reduce_op::avg: return 0;
      case reduce_op::prod: return 1;
      case reduce_op::min: return 2;
      case reduce_op::max: return 3;
    }
    return 0;
  }

  template <class T>
  void create_ops(std::size_t base, int rank) {
    // commute = 1 lets MPI pick its fast algorithms. Ranks still agree bit for bit: float
    // add, multiply, min and max give the same bits whichever operand comes first.
    check(MPI_Op_create(&reduce_two_byte<T, reduce_op::sum>, 1, &ops_[base + 0]), rank, "mpi::communicator",
          "MPI_Op_create");
    check(MPI_Op_create(&reduce_two_byte<T, reduce_op::prod>, 1, &ops_[base + 1]), rank, "mpi::communicator",
          "MPI_Op_create");
    check(MPI_Op_create(&reduce_two_byte<T, reduce_op::min>, 1, &ops_[base + 2]), rank, "mpi::communicator",
          "MPI_Op_create");
    check(MPI_Op_create(&reduce_two_byte<T, reduce_op::max>, 1, &ops_[base + 3]), rank, "mpi::communicator",
          "MPI_Op_create");
  }

  MPI_Datatype two_byte_ = MPI_DATATYPE_NULL;
  std::array<MPI_Op, 8> ops_{MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL,
                             MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
};

}  // namespace ddp::mpi::detail
