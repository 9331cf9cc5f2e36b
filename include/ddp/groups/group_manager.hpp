#pragma once
/// @file groups/group_manager.hpp
/// @brief `GroupManager`: the fault-tolerance protocol over replica groups. A replica is a group
/// of ranks that share fate (a host, a node); only the group dimension is fault tolerant. The
/// group's rank 0 (its leader) runs a `Manager` under the group's replica id; the other ranks
/// (followers) mirror it over the group's inner communicator: they build their cross
/// communicators for the leader's quorums, heal their shards alongside the leader's heal, and
/// apply the leader's commit decision. The protocol and its rules: docs/replica-groups.md
/// ("Fault tolerance between groups").

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/any_communicator.hpp>
#include <ddp/communicator.hpp>
#include <ddp/detail/describe_exception.hpp>
#include <ddp/detail/step_errors.hpp>
#include <ddp/error.hpp>
#include <ddp/groups/state_part.hpp>
#include <ddp/manager.hpp>
#include <ddp/manager/heal.hpp>
#include <ddp/manager/heal_routes.hpp>
#include <ddp/manager/options.hpp>
#include <ddp/progress.hpp>
#include <ddp/store.hpp>
#include <ddp/stores/prefix_store.hpp>
#include <ddp/training_state.hpp>
#include <ddp/work.hpp>

namespace ddp {

/// One rank's side of the fault-tolerance protocol of a replica group (docs/replica-groups.md).
/// Models `communicator` over this rank's cross communicator (its index in every live group, in
/// the quorum's group order): collectives issued through it never throw, their errors fail the
/// step, as through a `Manager`. Gradients go through a
/// `group_communicator<communicator_ref, communicator_ref>` of the inner communicator and this.
///
/// Every rank of the group calls `start_quorum()` and `should_commit()` at the same points; the
/// followers wait for the leader there over the inner communicator, so its collective timeout
/// must cover `max(quorum_timeout, step_timeout + heartbeat_timeout)` (checked where the inner
/// communicator tells its timeout). A rank that fails or leaves ends
/// its group: every other rank of it throws `replica_group_error` at its next inner exchange, and
/// the group restarts as a whole, as one replica, and heals. The protocol and its rules:
/// docs/fault-tolerance.md ("Replica groups"). Neither copyable nor movable.
template <communicator Inner>
class GroupManager {
 public:
  /// @param inner    the group's communicator (this rank's index: `inner.rank()`; the leader is
  ///                 index 0); must outlive this
  /// @param store    the job's store, shared by every rank of every group
  /// @param factory  builds this index's cross communicator of each quorum (and each heal
  ///                 route); `quorum_info::store` is this index's own namespace
  /// @param state    what this rank holds of the replica's state; must outlive this
  /// @param layout   how the group holds the state: each rank its own part (`sharded`), or every
  ///                 rank all of it (`replicated`); decides what each rank heals
  /// @param options  the group's: `replica_id` names the group, the same on each of its ranks,
  ///                 as every option is
  /// @throws usage_error for options replica groups do not support yet (hot spares, healed
  ///   replicas that sit out), and as `Manager` does
  template <store Store, transferable_state State>
  GroupManager(Inner& inner, Store& store, communicator_factory factory, State& state, group_state layout,
               manager_options options)
      : inner_(inner),
        store_(store),
        factory_(std::move(factory)),
        whole_tensors_([&state] { return std::span<const tensor_view>(state.state_tensors()); }),
        scalars_([&state] { return std::span<std::int64_t>(state.state_scalars()); }),
        layout_(layout),
        opts_(std::move(options)),
        index_(inner.rank()) {
    tensors_ = whole_tensors_;
    if (layout_ == group_state::replicated) {
      part_ = std::make_unique<detail::state_part>(whole_tensors_, scalars_, index_, inner.size());
      tensors_ = [p = part_.get()] { return p->state_tensors(); };
    }
    check_inner_timeout(inner);
    if (!opts_.healed_replicas_participate || opts_.active_replicas > 0) {
      throw usage_error(index_, "GroupManager",
                        "replica groups take part in every step they are members of: healed_replicas_participate "
                        "= false and active_replicas are not supported over groups yet");
    }
    if (index_ != 0) return;
    const communicator_factory build = [this](const quorum_info& q) { return build_as_leader(q); };
    leader_ = part_ ? std::make_unique<Manager>(store, build, *part_, opts_)
                    : std::make_unique<Manager>(store, build, state, opts_);
    leader_->group_heal_ = {
        [this](const std::vector<int>& sources, std::int64_t step) { announce_heal(sources, step); },
        [this](bool ok) { agree_on_heal(ok); }};
  }
  GroupManager(const GroupManager&) = delete;
  GroupManager& operator=(const GroupManager&) = delete;
  ~GroupManager() {
    if (cross_) cross_.abort();
  }

  // ---- per step ----------------------------------------------------------------------------

  /// Start of a step, on every rank of the group: the leader forms a new quorum (and the group
  /// heals) when needed; the followers follow.
  /// @throws replica_group_error if a rank of this group failed or left (the group restarts)
  /// @throws manager_error as `Manager::start_quorum` (on every rank of the group)
  void start_quorum() {
    if (leader_) {
      try {
        leader_->start_quorum();
      } catch (const std::exception& e) {
        tell_followers_and_rethrow(e);
      }
      send(command::ready, {leader_->step(), leader_->participants(), leader_->participant_rank(),
                            static_cast<std::int64_t>(leader_->stats().heals)});
      return;
    }
    errors_.clear();
    for (;;) {
      message m = receive();
      if (m.what == command::build) {
        build_as_follower(m);
      } else if (m.what == command::heal) {
        heal_as_follower(m);
      } else if (m.what == command::ready) {
        step_ = m.words[0];
        participants_ = static_cast<int>(m.words[1]);
        participant_rank_ = static_cast<int>(m.words[2]);
        heals_ = static_cast<std::uint64_t>(m.words[3]);
        errors_.start_clock(opts_.step_timeout);  // the leader's step starts now too
        return;
      } else {
        leader_failed(m);
      }
    }
  }

  /// End of a step, on every rank of the group: true on every rank of every live group iff no
  /// rank of any member group saw an error (the group's ranks agree first, then the leaders vote).
  /// @throws replica_group_error if a rank of this group failed or left (then `step()` may count
  ///   a step this rank did not apply: the group restarts and heals anyway)
  /// @throws manager_error as `Manager::should_commit` (on every rank of the group)
  [[nodiscard]] bool should_commit() {
    std::vector<std::int64_t> failed_here{failed() ? 1 : 0};
    inner_collective("should_commit: the group's error flags",
                     [&] { return communicator_ref(inner_).allreduce(failed_here, reduce_op::max); });
    if (leader_) {
      if (failed_here[0] && !leader_->failed()) {
        leader_->report_error(std::make_exception_ptr(communication_error(
            index_, "GroupManager::should_commit",
            "another rank of replica group '" + opts_.replica_id + "' failed a collective of the step")));
      }
      bool commit = false;
      try {
        commit = leader_->should_commit();
      } catch (const std::exception& e) {
        tell_followers_and_rethrow(e);
      }
      send(command::decision, {commit ? 1 : 0, leader_->step()});
      return commit;
    }
    message m = receive();
    if (m.what != command::decision) leader_failed(m);
    step_ = m.words[1];
    return m.words[0] != 0;
  }

  /// As `Manager::restart_deadline`, on every rank of the group.
  void restart_deadline() {
    if (leader_) {
      leader_->restart_deadline();
    } else {
      errors_.start_clock(opts_.step_timeout);
    }
  }

  /// A Bucketer's layout fingerprint, as `Manager::adopt_layout` (the leader's is exchanged;
  /// a follower's is not, and is taken before its first quorum all the same).
  bool adopt_layout(std::uint64_t fp) {
    if (leader_) return leader_->adopt_layout(fp);
    return !cross_ && generation_ == 0;
  }
  /// Optional: the gradient layout's fingerprint, as `Manager::set_layout_fingerprint` (the
  /// leader's is exchanged).
  void set_layout_fingerprint(std::uint64_t fp) {
    if (leader_) leader_->set_layout_fingerprint(fp);
  }
  /// The leader's Manager events (quorum changes, heals, discarded steps); none on followers.
  void on_event(std::function<void(const manager_event&)> fn) {
    if (leader_) leader_->on_event(std::move(fn));
  }

  // ---- communicator concept: this index's cross communicator, capturing errors --------------

  /// This group's rank in the current quorum.
  [[nodiscard]] int rank() const { return leader_ ? leader_->rank() : rank_; }
  /// Groups in the current quorum.
  [[nodiscard]] int size() const { return leader_ ? leader_->size() : size_; }
  /// Issues the collective across the groups at this index. Never throws: as `Manager::allreduce`.
  work allreduce(std::span<const tensor_view> ts, reduce_op op) {
    return leader_ ? leader_->allreduce(ts, op) : forward([&] { return cross_.allreduce(ts, op); }, "allreduce");
  }
  /// @copydoc allreduce
  work broadcast(std::span<const tensor_view> ts, int root) {
    return leader_ ? leader_->broadcast(ts, root) : forward([&] { return cross_.broadcast(ts, root); }, "broadcast");
  }
  /// @copydoc allreduce
  work allgather(tensor_view in, tensor_view out) {
    return leader_ ? leader_->allgather(in, out) : forward([&] { return cross_.allgather(in, out); }, "allgather");
  }
  /// @copydoc allreduce
  work reduce_scatter(tensor_view in, tensor_view out, reduce_op op) {
    return leader_ ? leader_->reduce_scatter(in, out, op)
                   : forward([&] { return cross_.reduce_scatter(in, out, op); }, "reduce_scatter");
  }
  /// @copydoc allreduce
  work barrier() {
    return leader_ ? leader_->barrier() : forward([&] { return cross_.barrier(); }, "barrier");
  }
  /// Aborts this rank's cross communicator (on the leader, the Manager's): the step fails, and the
  /// leader forms a new quorum at the next `start_quorum()`.
  void abort() noexcept {
    if (leader_) leader_->abort();
    if (cross_) cross_.abort();
  }

  // ---- introspection -------------------------------------------------------------------------

  /// True on the group's rank 0, which runs the group's `Manager`.
  [[nodiscard]] bool is_leader() const noexcept { return leader_ != nullptr; }
  /// This rank's index in its group.
  [[nodiscard]] int index() const noexcept { return index_; }
  /// Committed steps (the same on every rank of every live group).
  [[nodiscard]] std::int64_t step() const noexcept { return leader_ ? leader_->step() : step_; }
  /// Generation of the current quorum.
  [[nodiscard]] std::uint64_t generation() const noexcept { return leader_ ? leader_->generation() : generation_; }
  /// Group ids of the current quorum, in rank order.
  [[nodiscard]] const std::vector<std::string>& members() const noexcept {
    return leader_ ? leader_->members() : members_;
  }
  /// Groups whose gradients count in this step (`data::global_batch_sampler` counts groups).
  [[nodiscard]] int participants() const noexcept { return leader_ ? leader_->participants() : participants_; }
  /// This group's index among the participants.
  [[nodiscard]] int participant_rank() const noexcept {
    return leader_ ? leader_->participant_rank() : participant_rank_;
  }
  /// True once an error was captured on this rank in this step.
  [[nodiscard]] bool failed() const { return leader_ ? leader_->failed() : errors_.failed(); }
  /// The first error captured on this rank in this step, or null.
  [[nodiscard]] std::exception_ptr error() const { return leader_ ? leader_->error() : errors_.error(); }
  /// The leader's Manager counters; on a follower only `heals` (the group's heals, as the leader
  /// counts them), the rest zeros.
  [[nodiscard]] manager_stats stats() const {
    if (leader_) return leader_->stats();
    manager_stats s;
    s.heals = heals_;
    return s;
  }

 private:
  // What the leader tells its followers, one inner broadcast of `header_words` words (and one of
  // the payload's bytes when it has some).
  enum class command : std::int64_t { build = 1, heal, ready, decision, failed };
  static constexpr std::size_t header_words = 6;  // what, payload bytes, 4 words
  // A namespace in another (prefix_store refers to its parent: the parent's reference lives here).
  struct index_namespace {
    store_ref parent;
    stores::prefix_store<store_ref> space;
    index_namespace(store_ref p, std::string prefix) : parent(p), space(parent, std::move(prefix)) {}
    index_namespace(const index_namespace&) = delete;
    index_namespace& operator=(const index_namespace&) = delete;
  };
  struct message {
    command what = command::failed;
    std::vector<std::int64_t> words;  // 4
    std::string payload;
  };

  // A follower waits for its leader over the inner communicator for up to a quorum's forming (a
  // heal included), or a step and its vote: an inner timeout shorter than that would end a
  // healthy group while its leader waits out a hung peer elsewhere. Checked where the inner
  // communicator tells its timeout (gloo); docs/fault-tolerance.md, "Timing".
  void check_inner_timeout(const Inner& inner) const {
    if constexpr (requires {
                    { inner.timeout() } -> std::convertible_to<std::chrono::milliseconds>;
                  }) {
      const std::chrono::milliseconds have = inner.timeout();
      const auto need = std::max(opts_.quorum_timeout, opts_.step_timeout + opts_.heartbeat_timeout);
      if (have < need) {
        throw usage_error(index_, "GroupManager",
                          "the inner communicator's timeout (" + std::to_string(have.count()) +
                              " ms) is shorter than the longest wait of a follower for its leader, max(quorum_timeout, "
                              "step_timeout + heartbeat_timeout) = " +
                              std::to_string(need.count()) +
                              " ms: raise the inner communicator's timeout (gloo::options::timeout) or lower those");
      }
    }
  }

  template <class Issue>
  void inner_collective(const char* what, Issue&& issue) {
    try {
      issue().wait();
    } catch (const std::exception& e) {
      if (cross_) cross_.abort();  // peers at this index fail fast instead of waiting
      if (leader_) leader_->abort();
      throw replica_group_error(index_, std::string("GroupManager, replica group '") + opts_.replica_id + "'",
                                std::string("a rank of the group failed or left (") + what + "): " + e.what());
    }
  }

  void send(command what, std::vector<std::int64_t> words, const std::string& payload = {}) {
    words.resize(header_words - 2, 0);
    std::vector<std::int64_t> header{static_cast<std::int64_t>(what), static_cast<std::int64_t>(payload.size())};
    header.insert(header.end(), words.begin(), words.end());
    inner_collective("the leader's message", [&] { return communicator_ref(inner_).broadcast(header, 0); });
    if (payload.empty()) return;
    std::vector<std::uint8_t> bytes(payload.begin(), payload.end());
    inner_collective("the leader's message", [&] { return communicator_ref(inner_).broadcast(bytes, 0); });
  }

  message receive() {
    std::vector<std::int64_t> header(header_words, 0);
    inner_collective("waiting for the leader", [&] { return communicator_ref(inner_).broadcast(header, 0); });
    message m;
    m.what = static_cast<command>(header[0]);
    m.words.assign(header.begin() + 2, header.end());
    if (header[1] > 0) {
      std::vector<std::uint8_t> bytes(static_cast<std::size_t>(header[1]));
      inner_collective("waiting for the leader", [&] { return communicator_ref(inner_).broadcast(bytes, 0); });
      m.payload.assign(bytes.begin(), bytes.end());
    }
    return m;
  }

  // The leader's start_quorum or should_commit threw: its followers throw too (if they can still
  // be told). A manager_error (no quorum in time, too many failed steps) they throw as one, so
  // that every rank of the group may call start_quorum() again together; anything else ends the
  // group, which restarts.
  [[noreturn]] void tell_followers_and_rethrow(const std::exception& e) {
    const bool retryable = dynamic_cast<const manager_error*>(&e) != nullptr;
    try {
      send(command::failed, {retryable ? 1 : 0}, e.what());
    } catch (const replica_group_error&) {  // a follower is gone too: they learn at their next exchange
    }
    throw;
  }

  [[noreturn]] void leader_failed(const message& m) {
    const std::string where = "GroupManager, replica group '" + opts_.replica_id + "'";
    if (m.what == command::failed && m.words[0] == 1) {
      throw manager_error(index_, where, "the group's leader: " + m.payload);
    }
    if (cross_) cross_.abort();
    throw replica_group_error(index_, where, "the group's leader stopped: " + m.payload);
  }

  template <class Issue>
  work forward(Issue&& issue, const char* name) {
    return errors_.forward(static_cast<bool>(cross_), rank_, name, std::forward<Issue>(issue));
  }

  // This index's communicator of quorum `q`: `q` with its own namespace in q's, kept while the
  // quorum's communicators live (until the next quorum's is built).
  any_communicator build_at_index(const quorum_info& q) {
    if (q.heal_source < 0) stores_.clear();
    stores_.push_back(std::make_unique<index_namespace>(q.store, "index" + std::to_string(index_) + "/"));
    quorum_info mine = q;
    mine.store = store_ref(stores_.back()->space);
    return factory_(mine);
  }

  // The leader's factory: announces each quorum to the followers, builds index 0's, and learns
  // whether every index built its own (else the Manager tries the quorum again, as for a factory
  // that throws).
  any_communicator build_as_leader(const quorum_info& q) {
    if (q.heal_source >= 0) return build_at_index(q);  // a heal route: each index builds its own in its heal
    std::string members;
    for (const std::string& id : q.members) members += id + '\n';
    send(command::build, {static_cast<std::int64_t>(q.generation), q.rank, q.size}, members);
    any_communicator comm;
    try {
      comm = build_at_index(q);
    } catch (...) {
      agree_on_build(false);
      throw;
    }
    if (!agree_on_build(true)) {
      comm.abort();
      throw communication_error(
          index_, "GroupManager, replica group '" + opts_.replica_id + "'",
          "another rank of the group could not build its communicator of quorum " + std::to_string(q.generation));
    }
    return comm;
  }

  // Every rank of the group built its communicator of the quorum.
  bool agree_on_build(bool ok) {
    std::vector<std::int64_t> all_ok{ok ? 1 : 0};
    inner_collective("the quorum's communicators",
                     [&] { return communicator_ref(inner_).allreduce(all_ok, reduce_op::min); });
    return all_ok[0] == 1;
  }

  void build_as_follower(const message& m) {
    errors_.clear();  // an earlier attempt's failure: this quorum starts afresh
    if (cross_) cross_.abort();
    cross_ = any_communicator();
    generation_ = static_cast<std::uint64_t>(m.words[0]);
    rank_ = static_cast<int>(m.words[1]);
    size_ = static_cast<int>(m.words[2]);
    members_.clear();
    for (std::size_t at = 0; at < m.payload.size();) {
      const std::size_t end = m.payload.find('\n', at);
      members_.push_back(m.payload.substr(at, end - at));
      at = end + 1;
    }
    stores_.clear();
    generation_store_ =
        std::make_unique<stores::prefix_store<store_ref>>(store_, "g" + std::to_string(generation_) + "/comm/");
    try {
      quorum_info q{generation_, rank_, size_, members_, store_ref(*generation_store_)};
      q.deadline = clock::now() + opts_.quorum_timeout;  // at most the leader's, which is already counting
      q.step_timeout = opts_.step_timeout;
      q.connect_timeout = detail::connect_timeout_of(opts_);
      cross_ = build_at_index(q);
      detail::check_state_placement(tensors_(), cross_, rank_, generation_);
    } catch (const detail::state_placement_error&) {  // the same on every attempt: this rank cannot go on
      if (cross_) cross_.abort();
      cross_ = any_communicator();
      agree_on_build(false);
      throw;
    } catch (...) {  // the leader learns of it now and tries the quorum again
      if (cross_) cross_.abort();
      cross_ = any_communicator();
      agree_on_build(false);
      return;
    }
    agree_on_build(true);
  }

  // This index's part of the leader's heal, then the group's agreement on it.
  void heal_as_follower(const message& m) {
    const std::int64_t step = m.words[0];
    std::vector<int> sources;
    for (std::size_t at = 0; at < m.payload.size(); at += 4) {
      sources.push_back(static_cast<int>(static_cast<unsigned char>(m.payload[at]) |
                                         (static_cast<unsigned char>(m.payload[at + 1]) << 8) |
                                         (static_cast<unsigned char>(m.payload[at + 2]) << 16) |
                                         (static_cast<unsigned char>(m.payload[at + 3]) << 24)));
    }
    const bool receiving = std::find(sources.begin(), sources.end(), rank_) == sources.end();
    bool ok = false;
    try {
      if (cross_) {
        const detail::state_view st{tensors_(), scalars_()};
        progress_meter meter(&opts_.progress, "heal", rank_, st.tensor_bytes(),
                             std::string(receiving ? "receiving" : "sending") + " part " + std::to_string(index_) +
                                 " of step " + std::to_string(step));
        detail::heal_member(
            opts_.heal_over, [this](const quorum_info& q) { return build_at_index(q); }, cross_,
            store_ref(*generation_store_), generation_, sources, rank_, members_, st, step, opts_.heal_chunk_bytes,
            meter);
        ok = true;
        meter.finish();
      }
    } catch (...) {  // whatever failed, the leader learns of it from the agreement and re-forms
      cross_.abort();
    }
    agree_on_heal(ok);
  }

  // The leader's heal hooks (Manager::group_heal_).
  void announce_heal(const std::vector<int>& sources, std::int64_t step) {
    std::string payload;
    for (const int s : sources) {
      for (int b = 0; b < 4; ++b) payload += static_cast<char>((static_cast<unsigned>(s) >> (8 * b)) & 0xffU);
    }
    send(command::heal, {step}, payload);
  }

  // Every rank's part of a heal passed, or the heal failed (on the leader: throws, and its
  // Manager keeps "needs healing": a group with a torn part never serves as a source once a step
  // committed). A replicated state is whole and the same on every rank afterwards: rank i
  // broadcasts its part inside, for each i; in a source group too, whose ranks may hold different
  // bytes after an earlier heal failed half-way (before any step committed, such a group may start
  // the job: what it sends is part i of rank i, and that is what its ranks must hold).
  void agree_on_heal(bool ok) {
    if (stores_.size() > 1) stores_.resize(1);  // the heal's routes are gone: only the quorum's namespace stays
    std::vector<std::int64_t> all_ok{ok ? 1 : 0};
    inner_collective("the heal's outcome", [&] { return communicator_ref(inner_).allreduce(all_ok, reduce_op::min); });
    if (all_ok[0] == 0) {
      if (leader_ && ok) {
        throw communication_error(index_, "GroupManager, replica group '" + opts_.replica_id + "'",
                                  "another rank of the group could not heal its part of the state");
      }
      return;
    }
    if (layout_ != group_state::replicated) return;
    for (int i = 0; i < inner_.size(); ++i) {
      const std::vector<tensor_view> part = detail::byte_range_part(whole_tensors_(), i, inner_.size());
      inner_collective("sharing the healed parts", [&] { return inner_.broadcast(part, i); });
    }
  }

  Inner& inner_;
  store_ref store_;
  communicator_factory factory_;
  std::function<std::span<const tensor_view>()> whole_tensors_;  // what this rank registered
  std::function<std::span<std::int64_t>()> scalars_;
  group_state layout_;
  std::unique_ptr<detail::state_part> part_;               // group_state::replicated: what this rank heals
  std::function<std::span<const tensor_view>()> tensors_;  // what this rank heals
  manager_options opts_;
  int index_;
  std::vector<std::unique_ptr<index_namespace>> stores_;  // of this quorum's communicators
  std::unique_ptr<Manager> leader_;                       // index 0 only

  // A follower's mirror of the leader's quorum.
  std::unique_ptr<stores::prefix_store<store_ref>> generation_store_;  // outlives cross_ (declared first)
  any_communicator cross_;
  std::uint64_t generation_ = 0;
  int rank_ = 0;
  int size_ = 1;
  std::vector<std::string> members_;
  std::int64_t step_ = 0;
  int participants_ = 1;
  int participant_rank_ = 0;
  std::uint64_t heals_ = 0;
  detail::step_errors errors_{[this](const std::exception_ptr&) {
                                if (cross_) cross_.abort();
                              },
                              opts_.time};
};

}  // namespace ddp
