#pragma once
/// @file mpi/folding_allreduce.hpp
/// @brief `detail::folding_allreduce`: what recursive doubling and halving-doubling share, the
/// fold that runs them on any rank count, and their state machine over one send and one receive
/// at a time.
///
/// With `P` the largest power of two not above the rank count, ranks past `P` fold first: each
/// sends its data to rank `r - P`, which reduces it in, and gets the result back at the end.
/// Between the two, the `P` ranks run the algorithm's exchange, one step at a time. Like MPI's own
/// non-blocking collectives, nothing moves between calls of `progress()`.

#include <mpi.h>

#include <cstddef>
#include <cstdint>

#include <ddp/mpi/comm_state.hpp>
#include <ddp/mpi/p2p_allreduce.hpp>
#include <ddp/reduce_op.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp::mpi::detail {

class folding_allreduce : public p2p_allreduce {
 public:
  /// As `p2p_allreduce`; posts nothing and takes no memory yet. Public for the algorithms'
  /// inherited constructors (this class is abstract).
  folding_allreduce(comm_state& comm, const op_info& info, tensor_view region, reduce_op op, std::uint64_t stream)
      : p2p_allreduce(comm, info, region, op, stream), pow2_(largest_power_of_two(comm.size())) {
    stage_ = folds_out() ? stage::fold_out : folds_in() ? stage::fold_in : stage::exchange;
  }

  bool progress() final {
    if (!started_) {  // the first call: take the scratch memory this rank's role needs
      started_ = true;
      if (const std::size_t bytes = scratch_bytes(); bytes > 0) take_scratch(bytes);
    }
    while (stage_ != stage::done) {
      if (!posted_) post();
      if (!test(recv_) || !test(send_)) return false;
      posted_ = false;
      advance();
    }
    return true;
  }

  [[nodiscard]] bool in_flight() const noexcept final { return recv_ != MPI_REQUEST_NULL || send_ != MPI_REQUEST_NULL; }

  [[nodiscard]] bool done() const noexcept final { return stage_ == stage::done; }

 protected:
  /// True on a rank past `P`: it sends its data to `r - P` and gets the result back.
  [[nodiscard]] bool folds_out() const noexcept { return me_ >= pow2_; }
  /// True on a rank below `p - P`: it reduces rank `r + P`'s data in, and sends it the result.
  [[nodiscard]] bool folds_in() const noexcept { return me_ + pow2_ < ranks_; }

  /// Bytes of scratch memory this rank needs (`scratch()`, taken on the first `progress()`): at
  /// least the region on a rank that `folds_in()`, whose peer's data arrives there.
  [[nodiscard]] virtual std::size_t scratch_bytes() const noexcept = 0;
  /// Posts the messages of the exchange's current step into `send_` and `recv_`.
  virtual void post_exchange() = 0;
  /// Takes in the step whose messages completed; true once the exchange is over (the region then
  /// holds the result, divided for `avg`).
  virtual bool finish_exchange() = 0;
  /// Reduces rank `r + P`'s data, received in `scratch()`, into the region.
  virtual void reduce_folded() = 0;

  int pow2_;  // P
  MPI_Request send_ = MPI_REQUEST_NULL;
  MPI_Request recv_ = MPI_REQUEST_NULL;

 private:
  // fold_out (ranks >= P): send the data to r - P, then receive the result (`back`). fold_in
  // (ranks < p - P): receive r + P's data and reduce it in. exchange: the algorithm's steps.
  // fold_back (ranks < p - P): send the result to r + P.
  enum class stage : unsigned char { fold_out, fold_in, exchange, fold_back, back, done };

  [[nodiscard]] static int largest_power_of_two(int n) noexcept {
    int p = 1;
    while (p * 2 <= n) p *= 2;
    return p;
  }

  void post() {
    posted_ = true;
    const std::size_t all = region_bytes();
    switch (stage_) {
      case stage::fold_out: isend(data_, all, me_ - pow2_, send_); break;
      case stage::back: irecv(data_, all, me_ - pow2_, recv_); break;
      case stage::fold_in: irecv(scratch(), all, me_ + pow2_, recv_); break;
      case stage::fold_back: isend(data_, all, me_ + pow2_, send_); break;
      case stage::exchange: post_exchange(); break;
      case stage::done: break;
    }
  }

  void advance() {
    switch (stage_) {
      case stage::fold_out: stage_ = stage::back; return;
      case stage::fold_in:
        reduce_folded();
        stage_ = stage::exchange;
        return;
      case stage::exchange:
        if (finish_exchange()) stage_ = folds_in() ? stage::fold_back : stage::done;
        return;
      case stage::fold_back:
      case stage::back: stage_ = stage::done; return;
      case stage::done: return;
    }
  }

  bool started_ = false;
  bool posted_ = false;
  stage stage_ = stage::exchange;
};

}  // namespace ddp::mpi::detail
