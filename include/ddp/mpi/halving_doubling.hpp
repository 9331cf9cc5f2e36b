#pragma once
/// @file mpi/halving_doubling.hpp
/// @brief `detail::halving_doubling_allreduce`: an in-place allreduce as a state machine over
/// MPI_Isend and MPI_Irecv: a reduce-scatter by recursive halving, then an allgather by recursive
/// doubling (Rabenseifner's algorithm).
///
/// Why: it moves the ring's bytes (`2 (P-1)/P n` per rank) in `2 log2 P` messages instead of the
/// ring's `2 (P-1)`, and sends a binomial tree's latencies with a fraction of its bytes. The model
/// (docs/allreduce-model.md) picks it from a few KiB to the ring's threshold once rank counts grow.
///
/// With `P` the largest power of two not above the rank count, ranks past `P` fold first as in
/// recursive doubling: each sends its data to rank `r - P`, which reduces it in, and gets the
/// result back at the end. Among the `P` ranks, step `s` (distance `P/2, P/4, ..., 1`) splits the
/// range a rank is responsible for in two: the partner with the distance's bit clear keeps the
/// lower half, the other the upper; each sends the half it gives up and reduces the half it keeps
/// with what it receives. After `log2 P` steps every rank owns `1/P` of the elements, reduced over
/// all ranks; the allgather retraces the steps backwards, each partner sending what it owns and
/// receiving its sibling's half in place. Every element is reduced by one rank along one path and
/// then copied, so every rank ends with the same bits. Nothing moves between calls of
/// `progress()`, as with MPI's own non-blocking collectives.

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include <ddp/detail/host_reduce.hpp>
#include <ddp/mpi/comm_state.hpp>
#include <ddp/mpi/p2p_allreduce.hpp>
#include <ddp/reduce_op.hpp>
#include <ddp/tensor.hpp>

namespace ddp::mpi::detail {

class halving_doubling_allreduce final : public p2p_allreduce {
 public:
  /// Prepares the allreduce of `region` (host memory, in place, at most INT_MAX bytes) over 2+
  /// ranks. Posts nothing yet. `info` must outlive this; `stream` as for the ring.
  halving_doubling_allreduce(comm_state& comm, const op_info& info, tensor_view region, reduce_op op,
                             std::uint64_t stream)
      : p2p_allreduce(comm, info, region.type, op, stream),
        data_(region.byte_data()),
        count_(region.count),
        elem_(size_of(region.type)),
        ranks_(comm.size()),
        me_(comm.rank()) {
    while (pow2_ * 2 <= ranks_) pow2_ *= 2;
    distance_ = pow2_ / 2;
    mine_ = {0, count_};
    // Scratch by role: folding in receives the whole region, an exchange at most the larger half
    // of it (the first split's), a folded-out rank receives in place.
    const std::size_t scratch_elems = me_ >= pow2_ ? 0 : me_ + pow2_ < ranks_ ? count_ : count_ - count_ / 2;
    if (scratch_elems > 0) scratch_ = comm.take_scratch(scratch_elems * elem_, scratch_capacity_);
    if (me_ >= pow2_) {
      phase_ = phase::fold_out;
    } else if (me_ + pow2_ < ranks_) {
      phase_ = phase::fold_in;
    } else {
      phase_ = phase::reduce_scatter;
    }
  }

  ~halving_doubling_allreduce() override {
    if (scratch_) comm_.return_scratch(std::move(scratch_), scratch_capacity_);
  }

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
  // fold_out (ranks >= P): send everything to r - P, then receive the result (`back`).
  // fold_in (ranks < p - P): receive r + P's data and reduce it in. reduce_scatter: one step per
  // halving distance. allgather: the same steps backwards. fold_back: send the result to r + P.
  enum class phase : unsigned char { fold_out, fold_in, reduce_scatter, allgather, fold_back, back, done };

  struct range {
    std::size_t begin = 0;  // elements
    std::size_t end = 0;
  };

  [[nodiscard]] std::byte* at(std::size_t element) const noexcept { return data_ + element * elem_; }
  [[nodiscard]] static std::size_t bytes(range r, std::size_t elem) noexcept { return (r.end - r.begin) * elem; }

  // The two halves of `r` at the current distance: this rank's (the lower half for the partner
  // whose distance bit is clear) and the partner's. Both partners split at the same point.
  [[nodiscard]] std::pair<range, range> halves(range r) const noexcept {
    const std::size_t mid = r.begin + (r.end - r.begin) / 2;
    const range low{r.begin, mid};
    const range high{mid, r.end};
    return (me_ & distance_) == 0 ? std::pair{low, high} : std::pair{high, low};
  }

  void post() {
    posted_ = true;
    const std::size_t all = count_ * elem_;
    switch (phase_) {
      case phase::fold_out: isend(data_, all, me_ - pow2_, send_); break;
      case phase::back: irecv(data_, all, me_ - pow2_, recv_); break;
      case phase::fold_in: irecv(scratch_.get(), all, me_ + pow2_, recv_); break;
      case phase::fold_back: isend(data_, all, me_ + pow2_, send_); break;
      case phase::reduce_scatter: {
        // Keep one half and give the other away; the partner's copy of the kept half arrives in
        // scratch.
        const auto [keep, give] = halves(mine_);
        irecv(scratch_.get(), bytes(keep, elem_), me_ ^ distance_, recv_);
        isend(at(give.begin), bytes(give, elem_), me_ ^ distance_, send_);
        break;
      }
      case phase::allgather: {
        // Send what this rank owns; the partner's half arrives straight into place.
        const auto [have, get] = halves(split_[steps_ - 1]);
        irecv(at(get.begin), bytes(get, elem_), me_ ^ distance_, recv_);
        isend(at(have.begin), bytes(have, elem_), me_ ^ distance_, send_);
        break;
      }
      case phase::done: break;
    }
  }

  void advance() {
    switch (phase_) {
      case phase::fold_out: phase_ = phase::back; return;
      case phase::fold_in:
        reduce(scratch_.get(), data_, count_);
        phase_ = phase::reduce_scatter;
        return;
      case phase::reduce_scatter:
        split_[steps_++] = mine_;
        mine_ = halves(mine_).first;
        reduce(scratch_.get(), at(mine_.begin), mine_.end - mine_.begin);
        if ((distance_ /= 2) > 0) return;
        // The owned range holds the reduction over every rank: `avg` divides it once, here.
        if (op_ == reduce_op::avg)
          ddp::detail::divide_in_place(type_, at(mine_.begin), mine_.end - mine_.begin, ranks_);
        distance_ = 1;
        phase_ = phase::allgather;
        return;
      case phase::allgather:
        mine_ = split_[--steps_];
        if ((distance_ *= 2) < pow2_) return;
        phase_ = me_ + pow2_ < ranks_ ? phase::fold_back : phase::done;
        return;
      case phase::fold_back:
      case phase::back: phase_ = phase::done; return;
      case phase::done: return;
    }
  }

  std::byte* data_;
  std::size_t count_;
  std::size_t elem_;
  int ranks_;
  int me_;
  int pow2_ = 1;
  int distance_ = 0;      // of the current exchange; a power of two below pow2_
  range mine_;            // the elements this rank reduces (reduce-scatter) or holds (allgather)
  range split_[31] = {};  // the range each reduce-scatter step split, for the allgather to retrace
  int steps_ = 0;
  bool posted_ = false;
  std::unique_ptr<std::byte[]> scratch_;
  std::size_t scratch_capacity_ = 0;
  phase phase_ = phase::reduce_scatter;
  MPI_Request send_ = MPI_REQUEST_NULL;
  MPI_Request recv_ = MPI_REQUEST_NULL;
};

}  // namespace ddp::mpi::detail
