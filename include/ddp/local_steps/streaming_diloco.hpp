#pragma once
/// @file local_steps/streaming_diloco.hpp
/// @brief `streaming_diloco`: DiLoCo with the parameters split into fragments that take their
/// outer steps on a staggered schedule, each fragment's exchange overlapped with the next
/// `delay` inner steps and merged with a mixing factor (Streaming DiLoCo, arXiv 2501.18512).
/// docs/local-steps.md.

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ddp/communicator.hpp>
#include <ddp/error.hpp>
#include <ddp/local_steps/fragment.hpp>
#include <ddp/local_steps/outer_exchange.hpp>
#include <ddp/local_steps/outer_sgd.hpp>
#include <ddp/tensor.hpp>

namespace ddp {

/// Knobs of `streaming_diloco`; `O` is the outer optimizer policy (one copy per fragment).
template <class O = outer_sgd>
struct streaming_diloco_options {
  int sync_every = 100;  ///< H: inner steps between two outer steps of the same fragment
  int fragments = 1;     ///< F: groups of parameters; must divide `sync_every`
  /// tau: inner steps between a fragment's send and its merge, in [0, sync_every / fragments)
  int delay = 0;
  double alpha = 1.0;                    ///< mixing factor: merged = (1 - alpha) * local + alpha * global
  O outer = {};                          ///< the outer optimizer
  outer_wire wire = outer_wire::native;  ///< the type outer gradients travel in
  bool broadcast_initial = true;         ///< construction broadcasts the parameters from rank 0 (a collective)
};

/// Splits `params` in order into `fragments` contiguous groups of about equal element counts
/// (each with at least one tensor).
/// @throws usage_error (rank -1) if there are fewer tensors than fragments, or `fragments` < 1
[[nodiscard]] inline std::vector<std::vector<tensor_view>> split_fragments(const std::vector<tensor_view>& params,
                                                                           int fragments) {
  if (fragments < 1 || static_cast<std::size_t>(fragments) > params.size()) {
    throw usage_error(-1, "split_fragments",
                      std::to_string(fragments) + " fragments of " + std::to_string(params.size()) +
                          " tensors: need between 1 and one per tensor");
  }
  std::size_t total = 0;
  for (const tensor_view& p : params) total += p.count;
  const auto f_count = static_cast<std::size_t>(fragments);
  std::vector<std::vector<tensor_view>> out(f_count);
  std::size_t seen = 0;
  std::size_t f = 0;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const std::size_t left = params.size() - i;  // tensors still to place, this one included
    const std::size_t fragments_after = f_count - 1 - f;
    // Move on once this fragment has its share, or when every later fragment needs a tensor.
    if (!out[f].empty() && fragments_after > 0 && (seen * f_count >= (f + 1) * total || left <= fragments_after)) ++f;
    out[f].push_back(params[i]);
    seen += params[i].count;
  }
  return out;
}

/// Streaming DiLoCo. Fragment `f` (of F) takes its outer step at the inner steps `t` with
/// `t % H == ((f + 1) * H / F) % H` (the last fragment at multiples of H, as DiLoCo), after
/// sending its outer gradient `delay` inner steps earlier: the exchange runs while the trainer
/// computes. The trainer calls `step()` after each inner optimizer step, on every rank.
template <class O = outer_sgd>
class streaming_diloco {
  static_assert(outer_optimizer<O>,
                "ddp::streaming_diloco<O>: O must model ddp::outer_optimizer (copyable, with prepare(params), "
                "step(params, outer_grads) and state() -> std::vector<ddp::tensor_view>); see ddp::outer_sgd");

 public:
  /// Registers `params` (host, floating point; they must outlive this object), split by
  /// `split_fragments`, and anchors them.
  /// @throws usage_error on a bad parameter or knob
  streaming_diloco(communicator_ref comm, std::vector<tensor_view> params, streaming_diloco_options<O> options = {})
      : options_(std::move(options)) {
    const char* caller = "streaming_diloco";
    detail::check_local_steps(comm, params, options_.sync_every, caller);
    const int h = options_.sync_every;
    const int f = options_.fragments;
    if (f < 1 || static_cast<std::size_t>(f) > params.size() || h % f != 0) {
      throw usage_error(comm.rank(), caller,
                        std::to_string(f) + " fragments of " + std::to_string(params.size()) +
                            " tensors with sync_every " + std::to_string(h) +
                            ": need 1 <= fragments <= tensors, and fragments dividing sync_every");
    }
    if (options_.delay < 0 || options_.delay >= h / f) {
      throw usage_error(comm.rank(), caller,
                        "delay " + std::to_string(options_.delay) +
                            " is outside [0, sync_every / fragments = " + std::to_string(h / f) + ")");
    }
    if (!(options_.alpha >= 0 && options_.alpha <= 1)) {
      throw usage_error(comm.rank(), caller, "alpha " + std::to_string(options_.alpha) + " is outside [0, 1]");
    }
    if (options_.broadcast_initial) comm.broadcast(params, 0).wait();
    for (std::vector<tensor_view>& group : split_fragments(params, f)) {
      fragments_.emplace_back(comm, std::move(group), options_.outer, options_.wire, caller);
    }
  }

  /// Counts one inner step: sends the outer gradients of the fragments due to leave now, merges
  /// those due back, and drives the others forward.
  /// @return true if a fragment took its outer step in this call
  bool step() {
    ++steps_;
    bool merged = false;
    const std::int64_t h = options_.sync_every;
    for (std::size_t f = 0; f < fragments_.size(); ++f) {
      const std::int64_t due = offset(f);
      if ((steps_ + options_.delay) % h == due) fragments_[f].start();
      if (steps_ % h == due && fragments_[f].in_flight()) {
        fragments_[f].finish(options_.alpha);
        merged = true;
      } else {
        fragments_[f].poll();
      }
    }
    return merged;
  }

  /// Completes the exchanges in flight and merges them now, without waiting for their merge
  /// step: call it on every rank after the same inner step, before the trainer stops, evaluates
  /// or saves the global model. The schedule goes on unchanged afterwards.
  /// @return the fragments merged
  std::size_t flush() {
    std::size_t merged = 0;
    for (auto& f : fragments_) {
      if (!f.in_flight()) continue;
      f.finish(options_.alpha);
      ++merged;
    }
    return merged;
  }

  /// Inner steps counted so far.
  [[nodiscard]] std::int64_t inner_steps() const noexcept { return steps_; }

  /// Records each fragment's outer exchange as a span in `rec` (track "local_steps <fragment>",
  /// from its send to its merge; null: stop).
  void set_recorder(timeline::recorder* rec) noexcept {
    for (std::size_t f = 0; f < fragments_.size(); ++f) fragments_[f].set_recorder(rec, static_cast<int>(f));
  }

  /// Number of fragments.
  [[nodiscard]] std::size_t fragments() const noexcept { return fragments_.size(); }

  /// What a recovering replica must receive besides the parameters, fragment after fragment: its
  /// anchor, then its outer optimizer's state. (Exchanges in flight are not part of it.)
  [[nodiscard]] std::vector<tensor_view> state() {
    std::vector<tensor_view> s;
    for (auto& f : fragments_) {
      for (const tensor_view& t : f.state()) s.push_back(t);
    }
    return s;
  }

 private:
  // The step (mod H) at which fragment f merges.
  [[nodiscard]] std::int64_t offset(std::size_t f) const noexcept {
    const std::int64_t h = options_.sync_every;
    return static_cast<std::int64_t>(f + 1) * (h / options_.fragments) % h;
  }

  streaming_diloco_options<O> options_;
  std::int64_t steps_ = 0;
  std::vector<detail::outer_fragment<O>> fragments_;
};

}  // namespace ddp
