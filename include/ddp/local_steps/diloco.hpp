#pragma once
/// @file local_steps/diloco.hpp
/// @brief `diloco`: replicas take `sync_every` local steps, then average their outer gradient
/// (the parameters of the last outer step minus the current ones) and apply it with an outer
/// optimizer (DiLoCo, arXiv 2311.08105). docs/local-steps.md.

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include <ddp/communicator.hpp>
#include <ddp/local_steps/fragment.hpp>
#include <ddp/local_steps/outer_exchange.hpp>
#include <ddp/local_steps/outer_sgd.hpp>
#include <ddp/tensor.hpp>

namespace ddp {

/// Knobs of `diloco`; `O` is the outer optimizer policy.
template <class O = outer_sgd>
struct diloco_options {
  int sync_every = 100;                  ///< H: inner steps between two outer steps
  O outer = {};                          ///< the outer optimizer (the paper's: lr 0.7, Nesterov momentum 0.9)
  outer_wire wire = outer_wire::native;  ///< the type outer gradients travel in
  bool broadcast_initial = true;         ///< construction broadcasts the parameters from rank 0 (a collective)
};

/// DiLoCo over any communicator. The trainer runs its own (inner) optimizer and calls `step()`
/// after each of its steps, on every rank; every `sync_every`-th call is an outer step, after
/// which every replica holds the same parameters.
template <class O = outer_sgd>
class diloco {
  static_assert(outer_optimizer<O>,
                "ddp::diloco<O>: O must model ddp::outer_optimizer (copyable, with prepare(params), "
                "step(params, outer_grads) and state() -> std::vector<ddp::tensor_view>); see ddp::outer_sgd");

 public:
  /// Registers `params` (host, floating point; they must outlive this object) and anchors them.
  /// @throws usage_error on a bad parameter, `sync_every` < 1, or a bad outer optimizer knob
  diloco(communicator_ref comm, std::vector<tensor_view> params, diloco_options<O> options = {})
      : sync_every_(options.sync_every) {
    detail::check_local_steps(comm, params, options.sync_every, "diloco");
    if (options.broadcast_initial) comm.broadcast(params, 0).wait();
    fragment_.emplace(comm, std::move(params), std::move(options.outer), options.wire, "diloco");
  }

  /// Counts one inner step; every `sync_every`-th is an outer step (blocking).
  /// @return true if this call took an outer step
  bool step() {
    ++steps_;
    if (steps_ % sync_every_ != 0) return false;
    fragment_->start();
    fragment_->finish(1.0);
    return true;
  }

  /// Inner steps counted so far.
  [[nodiscard]] std::int64_t inner_steps() const noexcept { return steps_; }

  /// What a recovering replica must receive besides the parameters: the anchor (the parameters of
  /// the last outer step), then the outer optimizer's state.
  [[nodiscard]] std::vector<tensor_view> state() { return fragment_->state(); }

  /// The outer optimizer.
  [[nodiscard]] const O& outer() const noexcept { return fragment_->outer(); }

  /// Records each outer exchange as a span in `rec` (track "local_steps 0"; null: stop).
  void set_recorder(timeline::recorder* rec) noexcept { fragment_->set_recorder(rec, 0); }

 private:
  int sync_every_;
  std::int64_t steps_ = 0;
  std::optional<detail::outer_fragment<O>> fragment_;
};

}  // namespace ddp
