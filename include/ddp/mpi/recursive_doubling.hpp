#pragma once
/// @file mpi/recursive_doubling.hpp
/// @brief `detail::recursive_doubling_allreduce`: an in-place allreduce of a small message as a
/// state machine over MPI_Isend and MPI_Irecv: `log2(P)` exchanges of the whole message with
/// partners at doubling distances (`P` the largest power of two not above the rank count).
///
/// Why: a small allreduce is latency-bound, and this sends the fewest messages of any algorithm
/// (`log2 P` against the ring's `2 (p - 1)`; docs/allreduce-model.md). Open MPI 4.1's non-blocking
/// `MPI_Iallreduce` runs a binomial tree for an in-place call, twice the latencies.
///
/// Ranks past `P` fold first: each sends its data to rank `r - P`, which reduces it in, and gets
/// the result back at the end. Every exchange reduces the lower rank's data as the left operand
/// (`lower op higher`, whoever computes it), so both partners hold the same bits after every step
/// and every rank ends with the same bits, for every op including min and max of signed zeros.
/// Like MPI's own non-blocking collectives, nothing moves between calls of `progress()`.

#include <mpi.h>

#include <cstddef>
#include <cstring>
#include <memory>

#include <ddp/detail/host_reduce.hpp>
#include <ddp/mpi/comm_state.hpp>
#include <ddp/mpi/error.hpp>
#include <ddp/mpi/p2p_allreduce.hpp>
#include <ddp/reduce_op.hpp>
#include <ddp/tensor.hpp>

namespace ddp::mpi::detail {

class recursive_doubling_allreduce final : public p2p_allreduce {
 public:
  /// Prepares the allreduce of `region` (host memory, in place, at most INT_MAX bytes) over 2+
  /// ranks. Posts nothing yet. `info` must outlive this; `stream` as for the ring.
  recursive_doubling_allreduce(comm_state& comm, const op_info& info, tensor_view region, reduce_op op,
                               std::uint64_t stream)
      : p2p_allreduce(comm, info, region.type, op, stream),
        data_(region.byte_data()),
        count_(region.count),
        bytes_(region.bytes()),
        ranks_(comm.size()),
        me_(comm.rank()) {
    while (pow2_ * 2 <= ranks_) pow2_ *= 2;
    scratch_ = comm.take_scratch(2 * bytes_, scratch_capacity_);
    if (me_ >= pow2_) {
      phase_ = phase::fold_out;
    } else if (me_ + pow2_ < ranks_) {
      phase_ = phase::fold_in;
    } else {
      phase_ = phase::exchange;
    }
  }

  ~recursive_doubling_allreduce() override { comm_.return_scratch(std::move(scratch_), scratch_capacity_); }

  bool progress() override {
    while (phase_ != phase::done) {
      if (!posted_) post();
      if (!test(recv_) || !test(send_)) return false;
      posted_ = false;
      advance();
    }
    return true;
  }

  [[nodiscard]] bool in_flight() const noexcept override {
    return recv_ != MPI_REQUEST_NULL || send_ != MPI_REQUEST_NULL;
  }

  [[nodiscard]] bool done() const noexcept override { return phase_ == phase::done; }

 private:
  // fold_out (ranks >= P): send the data to r - P, then receive the result (the `back` phase).
  // fold_in (ranks < p - P): receive r + P's data and reduce it in. exchange: one step per
  // doubling distance. fold_back (ranks < p - P): send the result to r + P.
  enum class phase : unsigned char { fold_out, fold_in, exchange, fold_back, back, done };

  [[nodiscard]] std::byte* scratch() const noexcept { return scratch_.get(); }

  void post() {
    posted_ = true;
    const std::size_t n = bytes_;
    switch (phase_) {
      case phase::fold_out: isend(data_, n, me_ - pow2_, send_); break;
      case phase::back: irecv(data_, n, me_ - pow2_, recv_); break;
      case phase::fold_in: irecv(scratch(), n, me_ + pow2_, recv_); break;
      case phase::fold_back: isend(data_, n, me_ + pow2_, send_); break;
      case phase::exchange: {
        const int partner = me_ ^ distance_;
        irecv(scratch(), n, partner, recv_);
        isend(data_, n, partner, send_);  // `data_` is not written until both completed
        break;
      }
      case phase::done: break;
    }
  }

  void advance() {
    switch (phase_) {
      case phase::fold_out: phase_ = phase::back; return;
      case phase::fold_in:
        combine(me_ + pow2_);
        phase_ = phase::exchange;
        return;
      case phase::exchange:
        combine(me_ ^ distance_);
        distance_ *= 2;
        if (distance_ < pow2_) return;
        // `avg` runs as a sum; every rank of the exchange divides the same sum the same way, before
        // a folded rank gets its copy.
        if (op_ == reduce_op::avg) ddp::detail::divide_in_place(type_, data_, count_, ranks_);
        phase_ = me_ + pow2_ < ranks_ ? phase::fold_back : phase::done;
        return;
      case phase::fold_back:
      case phase::back: phase_ = phase::done; return;
      case phase::done: return;
    }
  }

  // data = lower op higher, where the received data (in scratch) came from `partner`.
  void combine(int partner) {
    if (partner > me_) {  // mine is the left operand: reduce into a copy of mine
      std::byte* mine = scratch() + bytes_;
      std::memcpy(mine, data_, bytes_);
      reduce(mine, scratch(), count_);  // scratch = mine op scratch
      std::memcpy(data_, scratch(), bytes_);
    } else {
      reduce(scratch(), data_, count_);  // data = received op data
    }
  }

  std::byte* data_;
  std::size_t count_;
  std::size_t bytes_;
  int ranks_;
  int me_;
  int pow2_ = 1;
  int distance_ = 1;
  bool posted_ = false;
  std::unique_ptr<std::byte[]> scratch_;  // the partner's data, and a copy of this rank's
  std::size_t scratch_capacity_ = 0;
  phase phase_ = phase::exchange;
  MPI_Request send_ = MPI_REQUEST_NULL;
  MPI_Request recv_ = MPI_REQUEST_NULL;
};

}  // namespace ddp::mpi::detail
