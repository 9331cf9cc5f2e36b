#pragma once
/// @file mpi/recursive_doubling.hpp
/// @brief `detail::recursive_doubling_allreduce`: an in-place allreduce of a small message as a
/// state machine over MPI_Isend and MPI_Irecv: `log2(P)` exchanges of the whole message with
/// partners at doubling distances (`P` the largest power of two not above the rank count; the
/// other ranks fold in, folding_allreduce.hpp).
///
/// Why: a small allreduce is latency-bound, and this sends the fewest messages of any algorithm
/// (`log2 P` against the ring's `2 (p - 1)`; docs/allreduce-model.md). Open MPI 4.1's non-blocking
/// `MPI_Iallreduce` runs a binomial tree for an in-place call, twice the latencies.
///
/// Every exchange, and the fold, reduces the lower rank's data as the left operand (`lower op
/// higher`, whoever computes it), so both partners hold the same bits after every step and every
/// rank ends with the same bits, for every op including min and max of signed zeros.

#include <cstddef>
#include <cstdint>
#include <cstring>

#include <ddp/detail/host_reduce.hpp>
#include <ddp/mpi/comm_state.hpp>
#include <ddp/mpi/folding_allreduce.hpp>
#include <ddp/reduce_op.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp::mpi::detail {

class recursive_doubling_allreduce final : public folding_allreduce {
 public:
  /// Prepares the allreduce of `region` (host memory, in place, at most INT_MAX bytes) over 2+
  /// ranks, as `folding_allreduce`.
  using folding_allreduce::folding_allreduce;

 private:
  // The partner's data, and a copy of this rank's.
  [[nodiscard]] std::size_t scratch_bytes() const noexcept override { return 2 * region_bytes(); }

  void post_exchange() override {
    const int partner = me_ ^ distance_;
    irecv(scratch(), region_bytes(), partner, recv_);
    isend(data_, region_bytes(), partner, send_);  // `data_` is not written until both completed
  }

  bool finish_exchange() override {
    combine(me_ ^ distance_);
    distance_ *= 2;
    if (distance_ < pow2_) return false;
    // `avg` runs as a sum; every rank of the exchange divides the same sum the same way, before
    // a folded rank gets its copy.
    if (op_ == reduce_op::avg) ddp::detail::divide_in_place(type_, data_, count_, ranks_);
    return true;
  }

  void reduce_folded() override { combine(me_ + pow2_); }

  // data = lower op higher, where the received data (in scratch) came from `partner`.
  void combine(int partner) {
    const std::size_t bytes = region_bytes();
    if (partner > me_) {  // mine is the left operand: reduce into a copy of mine
      std::byte* mine = scratch() + bytes;
      std::memcpy(mine, data_, bytes);
      reduce(mine, scratch(), count_);  // scratch = mine op scratch
      std::memcpy(data_, scratch(), bytes);
    } else {
      reduce(scratch(), data_, count_);  // data = received op data
    }
  }

  int distance_ = 1;
};

}  // namespace ddp::mpi::detail
