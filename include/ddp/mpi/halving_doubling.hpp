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
/// With `P` the largest power of two not above the rank count, ranks past `P` fold first
/// (folding_allreduce.hpp). Among the `P` ranks, step `s` (distance `P/2, P/4, ..., 1`) splits the
/// range a rank is responsible for in two: the partner with the distance's bit clear keeps the
/// lower half, the other the upper; each sends the half it gives up and reduces the half it keeps
/// with what it receives. After `log2 P` steps every rank owns `1/P` of the elements, reduced over
/// all ranks; the allgather retraces the steps backwards, each partner sending what it owns and
/// receiving its sibling's half in place. Every element is reduced by one rank along one path and
/// then copied, so every rank ends with the same bits.

#include <cstddef>
#include <cstdint>
#include <utility>

#include <ddp/detail/host_reduce.hpp>
#include <ddp/mpi/comm_state.hpp>
#include <ddp/mpi/folding_allreduce.hpp>
#include <ddp/reduce_op.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp::mpi::detail {

class halving_doubling_allreduce final : public folding_allreduce {
 public:
  /// Prepares the allreduce of `region` (host memory, in place, at most INT_MAX bytes) over 2+
  /// ranks, as `folding_allreduce`.
  using folding_allreduce::folding_allreduce;

 private:
  struct range {
    std::size_t begin = 0;  // elements
    std::size_t end = 0;
  };

  // Scratch by role: folding in receives the whole region, an exchange at most the larger half of
  // it (the first split's), a folded-out rank receives in place.
  [[nodiscard]] std::size_t scratch_bytes() const noexcept override {
    return (folds_out() ? 0 : folds_in() ? count_ : count_ - count_ / 2) * elem_;
  }

  [[nodiscard]] std::byte* at(std::size_t element) const noexcept { return data_ + element * elem_; }
  [[nodiscard]] std::size_t bytes(range r) const noexcept { return (r.end - r.begin) * elem_; }

  // The two halves of `r` at the current distance: this rank's (the lower half for the partner
  // whose distance bit is clear) and the partner's. Both partners split at the same point.
  [[nodiscard]] std::pair<range, range> halves(range r) const noexcept {
    const std::size_t mid = r.begin + (r.end - r.begin) / 2;
    const range low{r.begin, mid};
    const range high{mid, r.end};
    return (me_ & distance_) == 0 ? std::pair{low, high} : std::pair{high, low};
  }

  void post_exchange() override {
    if (!gathering_) {
      // Keep one half and give the other away; the partner's copy of the kept half arrives in
      // scratch.
      const auto [keep, give] = halves(mine_);
      irecv(scratch(), bytes(keep), me_ ^ distance_, recv_);
      isend(at(give.begin), bytes(give), me_ ^ distance_, send_);
    } else {
      // Send what this rank owns; the partner's half arrives straight into place.
      const auto [have, get] = halves(split_[steps_ - 1]);
      irecv(at(get.begin), bytes(get), me_ ^ distance_, recv_);
      isend(at(have.begin), bytes(have), me_ ^ distance_, send_);
    }
  }

  bool finish_exchange() override {
    if (gathering_) {
      mine_ = split_[--steps_];
      return (distance_ *= 2) >= pow2_;
    }
    split_[steps_++] = mine_;
    mine_ = halves(mine_).first;
    reduce(scratch(), at(mine_.begin), mine_.end - mine_.begin);
    if ((distance_ /= 2) > 0) return false;
    // The owned range holds the reduction over every rank: `avg` divides it once, here.
    if (op_ == reduce_op::avg) ddp::detail::divide_in_place(type_, at(mine_.begin), mine_.end - mine_.begin, ranks_);
    distance_ = 1;
    gathering_ = true;
    return false;
  }

  void reduce_folded() override { reduce(scratch(), data_, count_); }

  int distance_ = pow2_ / 2;  // of the current exchange; a power of two below pow2_
  range mine_{0, count_};     // the elements this rank reduces (reduce-scatter) or holds (allgather)
  range split_[31] = {};      // the range each reduce-scatter step split, for the allgather to retrace
  int steps_ = 0;
  bool gathering_ = false;  // false: the reduce-scatter, true: the allgather
};

}  // namespace ddp::mpi::detail
