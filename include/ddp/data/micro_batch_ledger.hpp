#pragma once
/// @file data/micro_batch_ledger.hpp
/// @brief `data::micro_batch_ledger`: a retry after a failed step recomputes only the
/// micro-batches that no live replica holds, and the step still trains on every sample of its
/// global batch exactly once.
///
/// Each replica keeps the sum of the micro-batch gradients it computed for the step (keyed by the
/// sampler's cursor, which only moves on commit). Each attempt starts with one allreduce of M
/// words (M micro-batches) that tells every member which micro-batches live members still hold;
/// the rest are split over the step's participants; the reduction sums the kept gradients and
/// divides by M. The Bucketer route, the soundness conditions and the tests: docs/exactly-once.md,
/// "Reusing gradients without the reproducible reducer".

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <ddp/average.hpp>
#include <ddp/communicator.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/partition.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp::data {

/// Keeps what this replica computed for a step across failed attempts (see the file description).
/// Host tensors of f32 or f64 only. Neither copyable nor movable: it refers to the gradients.
class micro_batch_ledger {
 public:
  /// @param gradients      where the trainer computes each micro-batch's gradient (host, f32/f64);
  ///                       they must outlive the ledger
  /// @param micro_batches  M, micro-batches per global batch (`global_batch_sampler::micro_batches()`)
  /// @throws usage_error for a device or integer tensor, or M of 0 or above `INT_MAX`
  micro_batch_ledger(std::span<const tensor_view> gradients, std::size_t micro_batches)
      : grads_(gradients.begin(), gradients.end()), m_(micro_batches) {
    const char* op = "micro_batch_ledger";
    if (m_ == 0 || m_ > static_cast<std::size_t>(std::numeric_limits<int>::max())) {
      throw usage_error(-1, op, "micro_batches must be in [1, INT_MAX], got " + std::to_string(m_));
    }
    for (std::size_t i = 0; i < grads_.size(); ++i) {
      const tensor_view& g = grads_[i];
      if (!g.where.is_host() || (g.type != dtype::f32 && g.type != dtype::f64)) {
        throw usage_error(-1, op,
                          "gradient " + std::to_string(i) + " must be a host f32 or f64 tensor (it is " +
                              std::string(name_of(g.type)) + " on " + g.where.str() + ")");
      }
      kept_.push_back(g.type == dtype::f64 ? kept_sum{std::vector<double>(g.count), {}}
                                           : kept_sum{{}, std::vector<float>(g.count)});
    }
  }
  micro_batch_ledger(const micro_batch_ledger&) = delete;
  micro_batch_ledger& operator=(const micro_batch_ledger&) = delete;

  /// Start of an attempt at the step `key` (the sampler's cursor), after `start_quorum()`. A new
  /// key drops what was kept. Agrees with every member of `group` which micro-batches live members
  /// hold (one blocking allreduce of M words) and returns those this member computes now: its
  /// contiguous share of the rest among the participants (`participant_rank()` /
  /// `participants()` when the group has them, else rank and size). If two members hold the same
  /// micro-batch (one left the quorum and came back before the step committed), every member
  /// drops what it kept and the step starts over. A failed allreduce (a Manager captures it) fails
  /// the step: what this returns is then moot.
  template <communicator Group>
  const std::vector<std::size_t>& begin(Group& group, std::uint64_t key) {
    if (!keyed_ || key != key_) drop(key);
    std::vector<std::int64_t> holders(m_, 0);
    for (std::size_t j : held_) holders[j] = 1;
    const tensor_view words = view(holders);
    group.allreduce(std::span<const tensor_view>(&words, 1), reduce_op::sum).wait();
    if (std::any_of(holders.begin(), holders.end(), [](std::int64_t h) { return h > 1; })) {
      drop(key);
      std::fill(holders.begin(), holders.end(), 0);
    }
    reused_ = held_.size();
    std::vector<std::size_t> missing;
    for (std::size_t j = 0; j < m_; ++j) {
      if (holders[j] == 0) missing.push_back(j);
    }
    const item_range r = contributor_share(missing.size(), group);
    todo_.assign(missing.begin() + static_cast<std::ptrdiff_t>(r.first),
                 missing.begin() + static_cast<std::ptrdiff_t>(r.last));
    return todo_;
  }

  /// The gradients hold micro-batch `j`'s gradient (the mean over its samples): adds them to the
  /// kept sum. @throws usage_error if `j` is not one `begin()` returned, or was added already
  void accumulate(std::size_t j) {
    if (std::find(todo_.begin(), todo_.end(), j) == todo_.end() ||
        std::find(held_.begin(), held_.end(), j) != held_.end()) {
      throw usage_error(-1, "micro_batch_ledger::accumulate",
                        "micro-batch " + std::to_string(j) +
                            " is not one begin() assigned to this replica, or was "
                            "added already");
    }
    for (std::size_t i = 0; i < grads_.size(); ++i) {
      if (grads_[i].type == dtype::f64) {
        add(grads_[i], kept_[i].f64);
      } else {
        add(grads_[i], kept_[i].f32);
      }
    }
    held_.push_back(j);
  }

  /// Writes the kept sum times `scale` into the gradients (for a Bucketer: see the docs).
  void write_sum(double scale = 1.0) {
    for (std::size_t i = 0; i < grads_.size(); ++i) {
      if (grads_[i].type == dtype::f64) {
        write(kept_[i].f64, grads_[i], scale);
      } else {
        write(kept_[i].f32, grads_[i], scale);
      }
    }
  }

  /// Writes the kept sum into the gradients and averages over the step's M micro-batches through
  /// `group` (sum, then ddp's one rule with divisor M): every member ends with the mean of the M
  /// micro-batch gradients. Through a Manager, an error fails the step instead of throwing.
  template <communicator Group>
  [[nodiscard]] work reduce(Group& group) {
    write_sum();
    return allreduce_average(group, std::span<const tensor_view>(grads_), static_cast<int>(m_), average_input::raw,
                             "micro_batch_ledger::reduce");
  }

  /// Micro-batches this member holds for the current key, in the order it computed them.
  [[nodiscard]] const std::vector<std::size_t>& held() const noexcept { return held_; }
  /// Micro-batches this member held from earlier attempts when the current attempt began.
  [[nodiscard]] std::size_t reused() const noexcept { return reused_; }
  /// M.
  [[nodiscard]] std::size_t micro_batches() const noexcept { return m_; }

 private:
  void drop(std::uint64_t key) {
    key_ = key;
    keyed_ = true;
    held_.clear();
    for (auto& k : kept_) {
      std::fill(k.f64.begin(), k.f64.end(), 0.0);
      std::fill(k.f32.begin(), k.f32.end(), 0.0f);
    }
  }

  // The sum of the held micro-batches' gradients, in the gradient's dtype (one of the two is used).
  struct kept_sum {
    std::vector<double> f64;
    std::vector<float> f32;
  };

  template <class T>
  static void add(const tensor_view& g, std::vector<T>& sum) {
    const T* src = static_cast<const T*>(g.data);
    for (std::size_t k = 0; k < sum.size(); ++k) sum[k] += src[k];
  }

  template <class T>
  static void write(const std::vector<T>& sum, const tensor_view& g, double scale) {
    T* dst = static_cast<T*>(g.data);
    for (std::size_t k = 0; k < sum.size(); ++k) {
      dst[k] = scale == 1.0 ? sum[k] : static_cast<T>(static_cast<double>(sum[k]) * scale);
    }
  }

  std::vector<tensor_view> grads_;
  std::vector<kept_sum> kept_;  // per gradient
  std::size_t m_;
  std::uint64_t key_ = 0;
  bool keyed_ = false;
  std::vector<std::size_t> held_;  // micro-batches in the kept sums
  std::vector<std::size_t> todo_;  // what begin() assigned in the current attempt
  std::size_t reused_ = 0;
};

}  // namespace ddp::data
