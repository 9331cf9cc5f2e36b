#pragma once
/// @file manager.hpp
/// @brief `Manager`: fault-tolerant training steps over replicas that may die and come back.
///
/// torchft's protocol as one component over a rendezvous store and any communicator that can be
/// rebuilt (gloo on CPUs, NCCL on GPUs, local threads in tests). Each step the trainer calls
/// `start_quorum()` (re-forms the quorum and heals the replicas that are behind, when needed), runs
/// its gradient collectives through the Manager (it models `ddp::communicator`: their errors fail
/// the step instead of throwing), and applies its optimizer step only if `should_commit()`. The
/// protocol, the quorum rule, its failure modes and costs are in docs/fault-tolerance.md.
///
/// Files. This header is the public class; its knobs, events, counters and error are in
/// manager/options.hpp. The protocol behind it: forming a quorum in the store
/// (manager/quorum.hpp, over the records of manager/record.hpp), what the members of a new quorum
/// exchange and decide (manager/exchange.hpp), who contributes gradients (manager/participation.hpp)
/// and healing, the transfer of the state (manager/heal.hpp).

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/any_communicator.hpp>
#include <ddp/average.hpp>
#include <ddp/bucket_layout.hpp>
#include <ddp/comm_hook.hpp>
#include <ddp/communicator.hpp>
#include <ddp/detail/describe_exception.hpp>
#include <ddp/detail/step_errors.hpp>
#include <ddp/device_runtime.hpp>
#include <ddp/error.hpp>
#include <ddp/manager/decision.hpp>
#include <ddp/manager/exchange.hpp>
#include <ddp/manager/heal.hpp>
#include <ddp/manager/heal_routes.hpp>
#include <ddp/manager/options.hpp>
#include <ddp/manager/participation.hpp>
#include <ddp/manager/quorum.hpp>
#include <ddp/manager/record.hpp>
#include <ddp/progress.hpp>
#include <ddp/store.hpp>
#include <ddp/stores/codec.hpp>
#include <ddp/stores/membership.hpp>
#include <ddp/stores/prefix_store.hpp>
#include <ddp/timeline.hpp>
#include <ddp/training_state.hpp>
#include <ddp/work.hpp>

namespace ddp {

template <communicator Inner>
class GroupManager;

/// One replica's side of the fault-tolerance protocol (docs/fault-tolerance.md). Models
/// `communicator`: collectives issued through it go to the current quorum's communicator and
/// never throw; their errors fail the step instead. Neither copyable nor movable.
class Manager {
 public:
  /// @param store    shared by every replica of the job (give each job its own prefix)
  /// @param factory  builds the communicator for each quorum
  /// @param state    what a recovering replica receives (must outlive the Manager)
  /// @param options  the protocol's knobs; `replica_id` must be set
  /// @throws usage_error if `replica_id` is not a valid key, the options are inconsistent, or the
  ///   store has no `set_if_absent`
  template <store Store, transferable_state State>
  Manager(Store& store, communicator_factory factory, State& state, manager_options options)
      : store_(store),
        factory_(std::move(factory)),
        tensors_([&state] { return std::span<const tensor_view>(state.state_tensors()); }),
        scalars_([&state] { return std::span<std::int64_t>(state.state_scalars()); }),
        opts_(std::move(options)) {
    stores::detail::check_key(opts_.replica_id, "Manager replica_id");
    detail::check_options(opts_, store_.has_set_if_absent());
  }

  Manager(const Manager&) = delete;
  Manager& operator=(const Manager&) = delete;
  ~Manager() {
    if (comm_) comm_.abort();
  }

  // ---- per step ----------------------------------------------------------------------------

  /// Start of a step: forms a new quorum and heals if needed (blocking), else only writes the
  /// heartbeat when due. Clears the previous step's error.
  /// @throws manager_error if no quorum could be formed within `quorum_timeout`
  void start_quorum() {
    if (refused_) std::rethrow_exception(refused_);  // told once: its layout or step is wrong
    errors_.clear();
    heartbeat(false);
    if (needs_quorum_ || !comm_) form_quorum();
    poll_join_requests();
    errors_.start_clock(opts_.step_timeout);
  }

  /// End of a step: true on every participant iff no participant saw an error and at least
  /// `min_replicas` took part. Advances the step counter on commit.
  /// @throws manager_error after `max_consecutive_failures` failed steps in a row
  [[nodiscard]] bool should_commit() {
    if (!comm_ && !failed()) {
      throw usage_error(rank_, "Manager::should_commit", "called before start_quorum() formed a quorum");
    }
    timeline::scoped_span span(rec_, "manager", "commit vote");
    raise_step_limit();
    std::int64_t vote[2] = {failed() ? 1 : 0, join_requested_ ? 1 : 0};
    bool vote_failed = false;  // this member voted yes, but the vote did not complete here
    if (!failed()) {
      std::vector<std::int64_t> words(vote, vote + 2);
      try {
        // Within the step's deadline, or a heartbeat timeout when the step used all of it: the
        // vote of a member that hangs fails here, and the store decides (decide()).
        communicator_ref(comm_)
            .allreduce(words, reduce_op::max)
            .wait_for(std::max(errors_.left(), opts_.heartbeat_timeout));
        vote[0] = words[0];
        vote[1] = words[1];
      } catch (...) {
        capture(std::current_exception());
        vote[0] = 1;
        vote_failed = true;
      }
    }
    bool commit = vote[0] == 0 && participants_ >= opts_.min_replicas;
    // The vote may have completed on some members and failed on others: the store decides
    // (manager/decision.hpp). A member whose vote failed commits too if the step committed: it
    // voted yes, so its own collectives of the step completed.
    auto decided = detail::commit_decision::commit;
    if (commit || (vote_failed && participants_ >= opts_.min_replicas)) {
      decided = decide(vote_failed);
      commit = decided == detail::commit_decision::commit;
    }
    span.set("commit", commit ? 1 : 0);
    if (vote[1]) needs_quorum_ = true;  // someone asked to join: re-form at the next start
    if (commit) {
      if (step_ == std::numeric_limits<std::int64_t>::max()) {
        throw manager_error(rank_, "Manager::should_commit", "the step counter would overflow");
      }
      ++step_;
      ++stats_.commits;
      consecutive_failures_ = 0;
      return true;
    }
    ++stats_.discarded;
    needs_quorum_ = true;
    emit(manager_event::kind::discarded,
         "step " + std::to_string(step_) + " discarded: " +
             (vote[0]                              ? describe_error()
              : participants_ < opts_.min_replicas ? "fewer than min_replicas participants"
              : decided == detail::commit_decision::unknown
                  ? "the store could not say whether it committed elsewhere"
                  : "the store's decision: a member's failed vote came first"));
    if (++consecutive_failures_ > opts_.max_consecutive_failures) {
      throw manager_error(
          rank_, "Manager::should_commit",
          std::to_string(consecutive_failures_) + " consecutive steps failed to commit; last: " + describe_error());
    }
    return false;
  }

  /// Comm hook for a Bucketer over this Manager: averages over the step's participants (a spare or
  /// a healed non-participant contributes zeros) by ddp's one rule (`allreduce_average`). Needed
  /// only with spares or `healed_replicas_participate = false`; otherwise the default is cheaper.
  [[nodiscard]] ddp::comm_hook comm_hook() {
    return [this](grad_bucket& b) -> work {
      const tensor_view data = b.data;
      if (!participating() && data.count) detail::zero_bucket(data, device_queue(), rank_);
      return allreduce_average(*this, data, std::max(participants_, 1), average_input::raw, "Manager comm hook");
    };
  }

  /// Before the first quorum: this replica's state is that of committed step `step` (a checkpoint,
  /// checkpoint.hpp). Takes effect in a fresh store (true), where the first quorum's member with
  /// the highest step starts the job; in a store where a quorum already formed it does nothing
  /// (false): the job's state wins and this replica heals from it.
  /// @throws usage_error after this replica's first quorum, or for a step outside [0, 2^62)
  bool resume(std::int64_t step) {
    if (comm_ || formed_ != 0 || step < 0 || step >= (std::int64_t{1} << 62)) {
      throw usage_error(
          rank_, "Manager::resume",
          formed_ != 0 || comm_ ? "called after a quorum formed" : "step " + std::to_string(step) + " out of range");
    }
    if (detail::latest_installed(store_, rank_).generation > 0) return false;
    step_ = step;
    (void)detail::raise_step_limit(store_, step);  // a fresh store's limit would refuse the step
    return true;
  }
  /// Takes a Bucketer's layout fingerprint before this replica's first quorum (true): every member
  /// must share it, and one that differs is named when a quorum forms. Later (false) the Bucketer
  /// checks its layout over the quorum's members itself (`layout_adopting_communicator`).
  bool adopt_layout(std::uint64_t fp) noexcept {
    if (comm_ || formed_ != 0) return false;
    layout_fingerprint_ = fp;
    return true;
  }
  /// A fingerprint of the gradient layout every member must share, from now on (any layout).
  void set_layout_fingerprint(std::uint64_t fp) noexcept { layout_fingerprint_ = fp; }
  /// Builds `grads`, a Bucketer over this Manager, which hands the Manager its layout fingerprint;
  /// refuses, at compile time, a layout policy that rebuilds (the layout is compared at every quorum).
  template <class Grads>
  requires requires(Grads& g) {
    typename Grads::policy_type;
    g.build();
  }
  void attach(Grads& grads) {
    static_assert(!rebuilding_policy<typename Grads::policy_type>,
                  "Manager::attach: the Manager compares the gradient layout at every quorum, so it needs a layout "
                  "that never changes; this Bucketer's policy rebuilds it (use bucketing::fixed or size_capped)");
    grads.build();
  }
  /// Called for every event (quorum changes, healing, discarded steps).
  void on_event(std::function<void(const manager_event&)> fn) { on_event_ = std::move(fn); }
  /// Records quorum formation, healing, commit votes and events in `rec` (track `manager`;
  /// null: stop). `rec` must outlive the Manager or be unset first.
  void set_recorder(timeline::recorder* rec) noexcept { rec_ = rec; }

  // ---- communicator concept: forwards to the current quorum, capturing errors ------------------

  /// This replica's rank in the current quorum.
  [[nodiscard]] int rank() const { return rank_; }
  /// Members of the current quorum.
  [[nodiscard]] int size() const { return size_; }
  /// Issues the collective on the current quorum's communicator. Never throws: an error, when
  /// issuing or completing, is captured (the step fails, the communicator is aborted so peers
  /// fail fast) and the returned work completes normally. Once the step failed, or without a
  /// quorum, returns a completed work and communicates nothing.
  work allreduce(std::span<const tensor_view> ts, reduce_op op) {
    return forward([&] { return comm_.allreduce(ts, op); }, "allreduce");
  }
  /// @copydoc allreduce
  work broadcast(std::span<const tensor_view> ts, int root) {
    return forward([&] { return comm_.broadcast(ts, root); }, "broadcast");
  }
  /// @copydoc allreduce
  work allgather(tensor_view in, tensor_view out) {
    return forward([&] { return comm_.allgather(in, out); }, "allgather");
  }
  /// @copydoc allreduce
  work reduce_scatter(tensor_view in, tensor_view out, reduce_op op) {
    return forward([&] { return comm_.reduce_scatter(in, out, op); }, "reduce_scatter");
  }
  /// @copydoc allreduce
  work barrier() {
    return forward([&] { return comm_.barrier(); }, "barrier");
  }
  /// The current quorum's pre-multiplied sum (`premul_sum_communicator`; averaging through it
  /// costs no pass of its own). Errors are captured as for `allreduce`. Ask `has_premul_sum()`
  /// first, as average.hpp does: through a `communicator_ref`, a call without the capability
  /// (between quorums, or a backend without it) throws `usage_error` at once; called directly,
  /// it is captured (the step fails), or skipped like every collective without a quorum.
  work allreduce_premul_sum(std::span<const tensor_view> ts, double factor) {
    return forward([&] { return comm_.allreduce_premul_sum(ts, factor); }, "allreduce_premul_sum");
  }
  /// True if the current quorum's communicator has a pre-multiplied sum (false between quorums).
  [[nodiscard]] bool has_premul_sum() const { return comm_.has_premul_sum(); }
  /// True if the current quorum's communicator stages its inputs (`staging_communicator`): read
  /// once by a Bucketer at build(), to hand it the gradients directly.
  [[nodiscard]] bool stages_input() const { return comm_.stages_input(); }
  /// Where this replica's collectives run (`device_communicator`): `manager_options::device_queue`
  /// when set, at all times (every quorum's communicator runs on it; a Bucketer reads it once, at
  /// construction). Otherwise the current quorum's queue: empty (null runtime) between quorums or
  /// over a host communicator, and a new stream with each quorum.
  [[nodiscard]] ddp::device_queue device_queue() const {
    if (opts_.device_queue.runtime != nullptr) return opts_.device_queue;
    return comm_ ? comm_.device_queue() : ddp::device_queue{};
  }
  /// The step's deadline counts again from now (`step_timeout`): for a step whose collectives come
  /// after a long phase of local work, as DiLoCo's outer exchange after its inner steps.
  void restart_deadline() { errors_.start_clock(opts_.step_timeout); }
  /// Fails this step with `e`, an error the Manager did not see (a collective outside it, another
  /// rank of a replica group): the vote refuses the step, as for a captured one.
  void report_error(std::exception_ptr e) { capture(std::move(e)); }
  /// Aborts the current quorum's communicator; the next `start_quorum()` forms a new one.
  void abort() noexcept {
    if (comm_) comm_.abort();
    needs_quorum_ = true;
  }

  // ---- introspection -------------------------------------------------------------------------

  /// Committed steps.
  [[nodiscard]] std::int64_t step() const noexcept { return step_; }
  /// Generation of the current quorum (`quorum_info::generation`).
  [[nodiscard]] std::uint64_t generation() const noexcept { return generation_; }
  /// Replica ids of the current quorum, in rank order.
  [[nodiscard]] const std::vector<std::string>& members() const noexcept { return members_; }
  /// Members whose gradients count in this step.
  [[nodiscard]] int participants() const noexcept { return participants_; }
  /// This member's index among the participants (`data::global_batch_sampler` splits the global
  /// batch by it), or -1 when its gradients count as zeros: a hot spare (`active_replicas`), or
  /// it received the state when the quorum formed and `healed_replicas_participate` is false.
  [[nodiscard]] int participant_rank() const noexcept { return participant_rank_; }
  /// True unless `participant_rank()` is -1.
  [[nodiscard]] bool participating() const noexcept { return participant_rank_ >= 0; }
  /// True once an error was captured in this step.
  [[nodiscard]] bool failed() const { return errors_.failed(); }
  /// The first error captured in this step, or null.
  [[nodiscard]] std::exception_ptr error() const { return errors_.error(); }
  /// Counters since construction.
  [[nodiscard]] const manager_stats& stats() const noexcept { return stats_; }
  /// The options.
  [[nodiscard]] const manager_options& options() const noexcept { return opts_; }

 private:
  template <communicator Inner>
  friend class GroupManager;  // the leader of a replica group sets group_heal_

  template <class Issue>
  work forward(Issue&& issue, const char* name) {
    return errors_.forward(static_cast<bool>(comm_), rank_, name, std::forward<Issue>(issue));
  }

  void capture(std::exception_ptr e) { errors_.capture(std::move(e)); }

  // The step's first error: tell every peer now (their pending collectives on this communicator
  // fail instead of waiting for their timeout).
  void on_first_error() {
    needs_quorum_ = true;
    if (comm_) comm_.abort();
    emit(manager_event::kind::error, describe_error());
  }

  std::string describe_error() const { return detail::describe_exception(error()); }

  void emit(manager_event::kind k, std::string text) {
    if (rec_) {
      static constexpr const char* names[] = {"quorum formed", "healed", "sent state", "discarded", "error"};
      rec_->instant("manager", names[static_cast<std::size_t>(k)], clock::now(), {{"step", static_cast<double>(step_)}},
                    text);
    }
    if (on_event_) on_event_({k, step_, std::move(text)});
  }

  // A heartbeat that fails (the store hiccups) is skipped, not thrown: heartbeats only tell the
  // others who seems alive (how long to wait for whom), never who is a member, so a missed one
  // costs at most a slower quorum. Thrown, it ended the trainer (found by the simulation, seed 9).
  // Forced heartbeats (enrolling) throw: form_quorum() retries.
  void heartbeat(bool force) {
    const auto t = now();
    if (!force && t - last_heartbeat_ < opts_.heartbeat_interval) return;
    last_heartbeat_ = t;
    try {
      store_.set("hb/" + opts_.replica_id, as_bytes(std::to_string(detail::wall_ms_of(opts_.time))));
    } catch (const ddp::error&) {
      if (force) throw;
    }
  }

  // Rank 0 reads the join counter at most every heartbeat_interval; the vote spreads the news.
  void poll_join_requests() {
    if (rank_ != 0 || !comm_) return;
    const auto t = now();
    if (t - last_join_poll_ < opts_.heartbeat_interval) return;
    last_join_poll_ = t;
    try {
      join_requested_ = join_requested_ || store_.add("joins", 0) > joins_at_formation_;
    } catch (const ddp::error&) {  // the store hiccupped: the request is seen at the next poll
    }
  }

  // This member's part in the commit decision of the step (manager/decision.hpp). When it cannot
  // tell (the store failed), it does not apply the step and reports "needs healing" until it
  // receives the state from a member that holds it.
  detail::commit_decision decide(bool vote_failed) {
    const detail::commit_decision d = detail::decide_step_until(
        store_, {generation_, step_, generation_start_, vote_failed, rank_}, now() + opts_.quorum_timeout, opts_.time);
    if (d == detail::commit_decision::commit) return d;
    needs_quorum_ = true;
    if (d == detail::commit_decision::unknown) {
      needs_heal_ = true;
      emit(manager_event::kind::error,
           "step " + std::to_string(step_) + ": cannot tell whether it committed elsewhere; will receive the state");
    }
    return d;
  }

  // Rank 0 keeps the store's "step_limit" ahead of the step it votes on (detail::raise_step_limit).
  void raise_step_limit() {
    if (rank_ != 0 || failed() || step_ < step_limit_) return;
    try {
      step_limit_ = detail::raise_step_limit(store_, step_);
    } catch (...) {
      capture(std::current_exception());  // the step cannot commit without it
    }
  }

  void form_quorum() {
    timeline::scoped_span span(rec_, "manager", "quorum");
    const auto deadline = now() + opts_.quorum_timeout;
    std::string last_problem = "no attempt";
    std::chrono::milliseconds pause{10};
    for (bool first = true;; first = false) {
      if (!first) detail::pause_before_retry(store_, opts_, pause, deadline, [this] { heartbeat(false); });
      if (now() >= deadline) {
        throw manager_error(
            rank_, "Manager::start_quorum",
            "no quorum within " + std::to_string(opts_.quorum_timeout.count()) + " ms (need at least " +
                std::to_string(opts_.min_replicas) +
                " replicas, a majority of them members of the previous quorum); last problem: " + last_problem);
      }
      drop_communicator();
      try {
        if (try_form_quorum(deadline)) {
          span.set("generation", static_cast<double>(generation_));
          span.set("size", size_);
          return;
        }
      } catch (const detail::state_placement_error&) {  // the same on every attempt: fail now
        drop_communicator();
        throw;
      } catch (const replica_group_error&) {  // a rank of this replica group is gone: the group restarts
        drop_communicator();
        throw;
      } catch (const ddp::error& e) {  // a dead peer, a group that formed without us, a slow store: try again
        if (refused_) {                // this replica's layout or step is wrong: retrying cannot help
          drop_communicator();
          std::rethrow_exception(refused_);
        }
        last_problem = e.what();
      }
    }
  }

  void drop_communicator() noexcept {
    if (comm_) comm_.abort();
    comm_ = any_communicator();
  }

  // One attempt at the next generation (manager/quorum.hpp). Returns true once formed (and healed).
  bool try_form_quorum(clock::time_point deadline) {
    heartbeat(true);
    const detail::enrollment e =
        detail::enroll_next_generation(store_, opts_, deadline, rank_, generation_, signalled_after_);
    const stores::membership& m = e.membership;
    rank_ = m.rank;
    size_ = m.size();
    members_ = m.members;
    const std::int64_t answered = detail::publish_quorum(store_, e);
    const std::uint64_t target = e.generation;
    comm_store_ = std::make_unique<stores::prefix_store<store_ref>>(store_, "g" + std::to_string(target) + "/comm/");
    quorum_info q{target, m.rank, m.size(), m.members, store_ref(*comm_store_)};
    q.deadline = clock::now() + (deadline - now());  // the machine's clock, as a factory reads it
    q.step_timeout = opts_.step_timeout;
    q.connect_timeout = detail::connect_timeout_of(opts_);
    comm_ = factory_(q);
    detail::check_state_placement(tensors_(), comm_, rank_, generation_);
    detail::check_device_queue(opts_.device_queue, comm_, rank_, generation_);
    exchange_and_heal(deadline);
    // The communicators' keys of older generations are garbage now (gloo keys are write-once
    // anyway). Member lists, "formed" records and decision counters stay: they are small, and
    // they are the chain of generations and what it committed.
    if (m.rank == 0 && target > 2) {
      store_.erase_prefix("g" + std::to_string(target - 2) + "/comm/");
    }
    generation_start_ = step_;
    join_requested_ = false;
    joins_at_formation_ = answered;
    step_limit_ = 0;
    needs_quorum_ = false;
    ++stats_.quorums;
    std::string text = "quorum " + std::to_string(target) + " formed: " + std::to_string(m.size()) + " replicas [";
    for (std::size_t i = 0; i < m.members.size(); ++i) text += (i ? " " : "") + m.members[i];
    emit(manager_event::kind::quorum, text + "], this replica is rank " + std::to_string(m.rank));
    return true;
  }

  // The protocol's clock: deadlines, heartbeats, polling (manager_options::time).
  [[nodiscard]] clock::time_point now() const { return detail::now_of(opts_.time); }
  // Time left until `deadline` on the protocol's clock, as a wait's timeout (at least 1 ms).
  [[nodiscard]] std::chrono::milliseconds left_until(clock::time_point deadline) const {
    return std::max(std::chrono::milliseconds(1), std::chrono::ceil<std::chrono::milliseconds>(deadline - now()));
  }

  [[nodiscard]] detail::state_view state() const { return {tensors_(), scalars_()}; }

  // Members exchange their reports (manager/exchange.hpp) and those behind receive the state from
  // its holders; a replica whose words are wrong is left out for good (refused_). Forming completes
  // with this member's "formed" record, before any step (docs/fault-tolerance.md, "The quorum rule").
  void exchange_and_heal(clock::time_point deadline) {
    const auto n = static_cast<std::size_t>(size_);
    const detail::member_report report{
        step_, formed_, layout_fingerprint_, state().tensor_bytes(), needs_heal_, detail::participation_rules(opts_)};
    std::vector<std::int64_t> mine = report.encode();
    std::vector<std::int64_t> all(detail::member_report::words * n);
    comm_.allgather(view(mine), view(all)).wait_for(left_until(deadline));
    const std::int64_t formed = detail::latest_committing(store_, generation_ - 1);
    detail::heal_plan plan = detail::plan_heal(all, members_, formed, detail::read_step_limit(store_));
    if (!plan.refused.empty()) {
      const detail::refusal r = detail::refusal_for(plan.refused, rank_, generation_);
      if (r.mine) refused_ = r.error;
      std::rethrow_exception(r.error);
    }
    if (plan.sources.empty()) plan = detail::plan_without_holder(all, members_, formed, rank_, generation_);
    const std::vector<int>& sources = plan.sources;
    const bool i_recover = std::find(sources.begin(), sources.end(), rank_) == sources.end();
    const bool anyone_recovers = sources.size() < n;
    if (anyone_recovers) heal(sources, plan.step, i_recover);
    const detail::participation p =
        detail::assign_participation(n, sources, opts_.healed_replicas_participate, opts_.active_replicas);
    participants_ = p.participants;
    participant_rank_ = p.slot[static_cast<std::size_t>(rank_)];
    formed_ = static_cast<std::int64_t>(generation_);
    needs_heal_ = false;  // every member holds the sources' bits now (the hash check, or none was needed)
    detail::record_formed(store_, generation_, rank_, step_);  // before this member's first vote in the generation
  }

  // Moves the state of `max_step` from `sources` to the members behind (manager/heal.hpp).
  void heal(const std::vector<int>& sources, std::int64_t max_step, bool receiving) {
    const auto start = clock::now();  // a measurement (stats), not the protocol's clock
    timeline::scoped_span span(rec_, "manager", receiving ? "heal (receive)" : "heal (send)");
    const detail::state_view st = state();
    progress_meter meter(
        &opts_.progress, "heal", rank_, st.tensor_bytes(),
        (receiving ? "receiving state of step " : "sending state of step ") + std::to_string(max_step) +
            (receiving ? " from " + std::to_string(sources.size()) + " replica(s)"
                       : " to " + std::to_string(size_ - static_cast<int>(sources.size())) + " recovering replica(s)"));
    // From its first received byte until the hash check passes, a receiver holds nothing: it
    // reports "needs healing" to every later quorum, never serves as a source, keeps its step.
    if (receiving) needs_heal_ = true;
    if (group_heal_.begins) group_heal_.begins(sources, max_step);  // the group's other ranks heal alongside
    detail::healed_state healed;
    try {
      healed = detail::heal_member(opts_.heal_over, factory_, comm_, store_ref(*comm_store_), generation_, sources,
                                   rank_, members_, st, max_step, opts_.heal_chunk_bytes, meter);
    } catch (...) {
      if (group_heal_.ends) group_heal_.ends(false);  // throws replica_group_error if the group broke
      throw;
    }
    if (group_heal_.ends) group_heal_.ends(true);  // throws unless every rank of the group healed
    const std::size_t moved = healed.moved;
    if (receiving) {
      step_ = max_step;
      needs_heal_ = false;
    }
    const double ms = std::chrono::duration<double, std::milli>(clock::now() - start).count();
    meter.finish();
    span.set("bytes", static_cast<double>(moved));
    if (receiving) {
      ++stats_.heals;
      stats_.healed_bytes += moved;
      stats_.heal_ms = ms;
      emit(manager_event::kind::healed, "healed to step " + std::to_string(max_step) + ": received " +
                                            std::to_string(moved) + " bytes from " + std::to_string(sources.size()) +
                                            " up-to-date replica(s) in " + std::to_string(ms) + " ms");
    } else if (rank_ == sources.front()) {
      emit(manager_event::kind::sent_state,
           "sent state of step " + std::to_string(max_step) + " to recovering replicas");
    }
  }

  store_ref store_;
  communicator_factory factory_;
  std::function<std::span<const tensor_view>()> tensors_;
  std::function<std::span<std::int64_t>()> scalars_;
  manager_options opts_;
  std::function<void(const manager_event&)> on_event_;
  timeline::recorder* rec_ = nullptr;  // optional (set_recorder)

  std::unique_ptr<stores::prefix_store<store_ref>> comm_store_;  // outlives comm_ (declared first)
  any_communicator comm_;
  std::uint64_t generation_ = 0;
  int rank_ = 0;
  int size_ = 1;
  std::vector<std::string> members_;
  std::int64_t step_ = 0;
  std::int64_t generation_start_ = 0;  // step_ when the current quorum formed (every member's)
  std::int64_t formed_ = 0;            // the last generation whose forming this member completed (0: fresh)
  bool needs_heal_ = false;            // received part of a heal that has not passed its check
  std::int64_t step_limit_ = 0;        // rank 0: "step_limit" as last raised (steps below it may commit)
  std::exception_ptr refused_;         // this replica was left out of quorums for good (refuse())
  int participants_ = 1;
  int participant_rank_ = 0;  // -1: contributes zeros (participation.hpp)
  bool needs_quorum_ = true;
  std::uint64_t signalled_after_ = 0;  // generation this replica asked to join
  bool join_requested_ = false;
  std::int64_t joins_at_formation_ = 0;
  std::uint64_t layout_fingerprint_ = 0;
  int consecutive_failures_ = 0;
  clock::time_point last_heartbeat_{};
  clock::time_point last_join_poll_{};
  manager_stats stats_;
  detail::group_heal_hooks group_heal_;  // set by a replica group's leader (GroupManager)
  detail::step_errors errors_{[this](const std::exception_ptr&) { on_first_error(); }, opts_.time};
};

static_assert(communicator<Manager>);
static_assert(device_communicator<Manager>);
static_assert(dynamic_premul_sum_communicator<Manager>);
static_assert(staging_communicator<Manager>);

}  // namespace ddp
