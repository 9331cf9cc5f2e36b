#pragma once
/// @file local_steps/fault_tolerant_diloco.hpp
/// @brief `fault_tolerant_diloco`: DiLoCo whose outer steps are the steps of a `Manager`. Each
/// outer step starts with `begin()` (the quorum re-forms and a replica that is behind heals the
/// global parameters and the outer optimizer's state) and ends with `end()` (the outer gradients
/// are averaged through the Manager, and the outer step is applied only if every replica votes
/// to commit it). A replica that dies costs its own inner steps; with `reuse_outer_gradients` the
/// survivors' are kept. A replica may be a group of ranks (`GroupManager`): its outer gradients
/// then travel over the group's `group_communicator`, 1/k of them across per rank.
/// docs/local-steps.md ("Fault tolerance"), docs/replica-groups.md.

#include <algorithm>
#include <cstdint>
#include <span>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ddp/communicator.hpp>
#include <ddp/error.hpp>
#include <ddp/local_steps/fragment.hpp>
#include <ddp/local_steps/outer_exchange.hpp>
#include <ddp/local_steps/outer_sgd.hpp>
#include <ddp/manager.hpp>
#include <ddp/tensor.hpp>
#include <ddp/training_state.hpp>

namespace ddp {

/// Knobs of `fault_tolerant_diloco`; `O` is the outer optimizer policy.
template <class O = outer_sgd>
struct fault_tolerant_diloco_options {
  int sync_every = 100;                  ///< H: inner steps in an outer step
  O outer = {};                          ///< the outer optimizer (the paper's: lr 0.7, Nesterov momentum 0.9)
  outer_wire wire = outer_wire::native;  ///< the type outer gradients travel in
  /// false: an outer step whose vote fails is dropped on every replica (the parameters go back to
  /// the anchor) and redone by the next quorum; every sample is trained exactly once.
  /// true: the survivors re-form the quorum at once and average the outer gradients they already
  /// computed, so a death costs only the dead replica's inner steps; its share of the step's
  /// samples is then not trained (docs/local-steps.md, "Reusing the survivors' inner steps").
  bool reuse_outer_gradients = false;
};

/// DiLoCo over a `Manager` (or a `GroupManager`: `Replica`): its step is the outer step. Usage,
/// the protocol and what it guarantees: docs/local-steps.md ("Fault tolerance").
///
///     while (m.step() < outer_steps) {
///       for (int h = 0, n = outer.begin(); h < n; ++h) inner_step(...);
///       if (outer.end()) sampler.commit();
///     }
template <class O = outer_sgd, class Replica = Manager>
class fault_tolerant_diloco {
  static_assert(outer_optimizer<O>,
                "ddp::fault_tolerant_diloco<O>: O must model ddp::outer_optimizer (copyable, with prepare(params), "
                "step(params, outer_grads) and state() -> std::vector<ddp::tensor_view>); see ddp::outer_sgd");

 public:
  /// Registers `params` (host, floating point; they must outlive this object) and adds the
  /// anchor and the outer optimizer's state to `state`, the Manager's training state: construct
  /// it before the Manager's first `start_quorum()`. The parameters need not agree across
  /// replicas: the first quorum gives every replica its rank 0's.
  /// @throws usage_error on a bad parameter or knob
  fault_tolerant_diloco(Replica& manager, training_state& state, std::vector<tensor_view> params,
                        fault_tolerant_diloco_options<O> options = {})
      : fault_tolerant_diloco(manager, manager, state, std::move(params), std::move(options)) {}

  /// The same, with the outer gradients averaged over `outer`, every rank of every replica: a
  /// replica group's `group_communicator(inner, manager)`, whose ranks of a group hold the same
  /// outer gradient (DDP inside the group). The average counts each replica once.
  fault_tolerant_diloco(Replica& manager, communicator_ref outer, training_state& state,
                        std::vector<tensor_view> params, fault_tolerant_diloco_options<O> options = {})
      : m_(manager), outer_(outer), sync_every_(options.sync_every), reuse_(options.reuse_outer_gradients) {
    detail::check_local_steps(outer_, params, options.sync_every, caller);
    if (manager.step() != 0 || manager.generation() != 0) {
      throw usage_error(m_.rank(), caller, "constructed after the Manager's first quorum; its state could not heal");
    }
    fragment_.emplace(outer_, std::move(params), std::move(options.outer), options.wire, caller);
    for (const tensor_view& t : fragment_->state()) state.add(t);
  }

  /// Start of an outer step: the Manager's `start_quorum()` (a replica that is behind receives
  /// the global parameters and the outer optimizer's state, and its parameters become the global
  /// ones), then one allreduce of two words, which tells a replica that arrives while the
  /// others retry an exchange (`reuse_outer_gradients`) to join that exchange at once.
  /// @return the inner steps to take before `end()`: `sync_every`, or 0 for such a replica
  /// @throws manager_error as `Manager::start_quorum()`
  [[nodiscard]] int begin() {
    enter_quorum();
    std::int64_t words[2] = {0, 0};  // [replicas retrying an exchange, gradients they bring]
    exchange_words(words);
    if (words[0] > 0) {
      has_gradient_ = false;
      contributors_ = static_cast<int>(words[1]);
      return 0;
    }
    has_gradient_ = true;
    contributors_ = m_.size();
    return sync_every_;
  }

  /// End of an outer step: the outer gradient (anchor - parameters) averaged over the replicas
  /// that took inner steps, then the Manager's commit vote.
  /// @return true if the outer step committed: the parameters are the new global parameters, the
  ///   same bits on every replica. false: they are the last global parameters again (the inner
  ///   steps are dropped), and the next `begin()` re-forms the quorum. With
  ///   `reuse_outer_gradients`, `end()` retries over each new quorum until a vote commits.
  /// @throws manager_error after `max_consecutive_failures` failed votes in a row, or as
  ///   `Manager::start_quorum()` in a retry
  bool end() {
    m_.restart_deadline();  // the step's deadline bounds the exchange, not the inner steps before it
    for (;;) {
      fragment_->start(std::max(contributors_, 1) * copies(), has_gradient_);  // each replica counted once
      fragment_->wait();
      if (m_.should_commit()) {
        if (contributors_ > 0) {
          fragment_->apply(1.0);
        } else {
          fragment_->reset();  // every replica that brought a gradient died: an empty outer step
        }
        return true;
      }
      if (!reuse_) {
        fragment_->reset();
        return false;
      }
      // Retry with the outer gradients as computed: the anchor did not move and the parameters
      // are this replica's own, so (anchor - parameters) is recomputed bit for bit. A replica
      // that was behind (it healed now) brings nothing: its inner steps started from a stale anchor.
      if (enter_quorum() == arrival::healed) has_gradient_ = false;
      std::int64_t words[2] = {1, has_gradient_ ? 1 : 0};
      exchange_words(words);
      contributors_ = static_cast<int>(words[1]);
    }
  }

  /// The anchor (the global parameters of the last committed outer step), then the outer
  /// optimizer's state: what `state` received at construction.
  [[nodiscard]] std::vector<tensor_view> state() { return fragment_->state(); }
  /// The outer optimizer.
  [[nodiscard]] const O& outer() const noexcept { return fragment_->outer(); }
  /// Records each outer exchange as a span in `rec` (track "local_steps 0"; null: stop); the
  /// Manager's own `set_recorder` records the quorum, healing and the votes.
  void set_recorder(timeline::recorder* rec) noexcept { fragment_->set_recorder(rec, 0); }
  /// Replicas whose outer gradients the current outer step averages (set by `begin()`, and by
  /// each retry in `end()`).
  [[nodiscard]] int contributors() const noexcept { return contributors_; }
  /// True if this replica's outer gradient counts in the current outer step (false for one that
  /// joined an exchange being retried, or healed in a retry).
  [[nodiscard]] bool contributes() const noexcept { return has_gradient_; }

 private:
  static constexpr const char* caller = "fault_tolerant_diloco";
  enum class arrival { up_to_date, healed };

  // start_quorum(); a replica that received state starts from the global parameters.
  arrival enter_quorum() {
    const std::uint64_t heals = m_.stats().heals;
    m_.start_quorum();
    if (m_.stats().heals == heals) return arrival::up_to_date;
    fragment_->reset();
    return arrival::healed;
  }

  // Sums two words over the replicas through the outer exchange's communicator (a failure is
  // captured and fails the vote). Over a replica group every rank of a group brings the same words
  // and receives the same sums (the group's allgather), so its ranks agree on the inner steps.
  void exchange_words(std::int64_t (&words)[2]) {
    const tensor_view v{words, 2, dtype::i64, device::host()};
    outer_.allreduce(std::span<const tensor_view>(&v, 1), reduce_op::sum).wait();
    for (std::int64_t& w : words) w /= copies();
  }

  // Ranks of the outer exchange per replica: 1 over a Manager, k over a group of k.
  [[nodiscard]] int copies() const { return std::max(outer_.size() / std::max(m_.size(), 1), 1); }

  Replica& m_;
  communicator_ref outer_;  // the outer exchange's: the replicas' ranks
  int sync_every_;
  bool reuse_;
  bool has_gradient_ = true;
  int contributors_ = 0;
  std::optional<detail::outer_fragment<O>> fragment_;
};

}  // namespace ddp
