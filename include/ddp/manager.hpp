#pragma once
/// @file manager.hpp
/// @brief `Manager`: fault-tolerant training steps over replicas that may die and come back.
///
/// torchft's protocol as one C++ component over a rendezvous store and any communicator backend
/// that can be rebuilt (gloo on CPUs, NCCL on GPUs, local threads in tests):
///
/// - **Each step** the trainer calls `start_quorum()`, runs forward/backward with gradient
///   collectives going through the Manager (it models `ddp::communicator`; give it to a Bucketer
///   with a fixed layout and install `comm_hook()`), then asks `should_commit()` before its
///   optimizer step. Errors of any collective are captured, never thrown mid-backward: the
///   Manager aborts its communicator (so every peer fails fast too) and the step is discarded.
/// - **Fast path.** While nothing changes, a step costs one int64 allreduce (in
///   `should_commit()`, the commit vote) plus a heartbeat written to the store at most every
///   `heartbeat_interval`. Rank 0 also reads the store's enrollment counter at that rate and
///   folds "a replica wants in" into the vote, so enrollments take effect at the next
///   `start_quorum()`.
/// - **Quorum change** (after an error, a failed vote, or an enrollment request): every live
///   replica enrolls in generation g+1 (`stores::enroll_any`), g being the latest generation
///   that closed. Each generation closes once (one atomic claim in the store), with at least
///   `min_replicas` members of which a majority are generation g's members (exactly half
///   counts if it includes g's rank 0); newcomers are admitted into that generation, never form
///   one of their own. So quorums form a chain and never commit side by side
///   (docs/fault-tolerance.md, "The quorum rule"). A new communicator is built for the group
///   through the user's factory.
/// - **Healing**: members exchange (step, fresh, layout, state size, needs healing); members
///   behind receive every registered state tensor and scalar from the previous quorum's
///   up-to-date members (never from a replica part-way through a heal), streamed in
///   chunks by broadcast, chunk k from source k mod (number of sources). A final allgather of
///   state hashes proves every member holds the same bits; only then does a receiver take the
///   sources' step (until then it reports "needs healing"). A replica whose layout differs or
///   whose step is impossible is named and left out. Healing completes inside
///   `start_quorum()`, before the step's collectives. State tensors may be in device memory when
///   the factory builds device communicators (NCCL: nccl/manager_factory.hpp): the broadcasts
///   run on the device, and the hash reads the tensors back through `device_queue()`.
/// - **Commit**: `should_commit()` is true on every member iff nobody saw an error in the step and
///   at least `min_replicas` took part. The step counter only advances on commit.
///
/// Averaging divides by the number of participants actually present.

#include <algorithm>
#include <charconv>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <ddp/any_communicator.hpp>
#include <ddp/average.hpp>
#include <ddp/comm_hook.hpp>
#include <ddp/communicator.hpp>
#include <ddp/detail/fnv1a.hpp>
#include <ddp/detail/describe_exception.hpp>
#include <ddp/detail/host_reduce.hpp>
#include <ddp/detail/device_buffer.hpp>
#include <ddp/device_runtime.hpp>
#include <ddp/error.hpp>
#include <ddp/progress.hpp>
#include <ddp/store.hpp>
#include <ddp/stores/membership.hpp>
#include <ddp/stores/prefix_store.hpp>
#include <ddp/timeline.hpp>
#include <ddp/training_state.hpp>
#include <ddp/work.hpp>

namespace ddp {

namespace detail {

// Records replicas read back from the store, decoded. Separate from the Manager so that they can
// be tested and fuzzed on their own (tests/fuzz/quorum_record_fuzz.cpp).

/// The latest quorum, stored under "current" by its rank 0.
struct quorum_record {
  std::uint64_t generation = 0;      ///< the quorum's generation; 0: no quorum yet
  std::int64_t joins = 0;            ///< the join counter when it formed
  std::vector<std::string> members;  ///< replica ids in rank order
  /// Same generation, join count and members.
  friend bool operator==(const quorum_record&, const quorum_record&) = default;
};

/// The stored form of a quorum record: "<generation> <joins> <id> <id> ...".
[[nodiscard]] inline std::string encode_quorum_record(const quorum_record& q) {
  std::string rec = std::to_string(q.generation) + " " + std::to_string(q.joins);
  for (const auto& id : q.members) rec += " " + id;
  return rec;
}

/// Parses a stored quorum record. Only what encode_quorum_record writes for a record a Manager
/// can write decodes: decimal numbers (no sign, spaces or leading zeros), a generation in
/// [1, 2^64 - 2] (the next one must not wrap to 0), a join count >= 0, and at least one member,
/// each a valid key, separated by single spaces.
/// @throws communication_error if it is malformed
[[nodiscard]] inline quorum_record decode_quorum_record(std::string_view text, int rank) {
  const auto fail = [rank](const std::string& what) {
    return communication_error(rank, "Manager", "malformed 'current' record in the store: " + what);
  };
  std::vector<std::string_view> fields;
  for (std::size_t pos = 0;;) {
    const auto sp = text.find(' ', pos);
    fields.push_back(text.substr(pos, sp == std::string_view::npos ? std::string_view::npos : sp - pos));
    if (sp == std::string_view::npos) break;
    pos = sp + 1;
  }
  if (fields.size() < 3) throw fail("fewer than 3 fields");
  quorum_record q;
  const auto generation = stores::detail::parse_decimal<std::uint64_t>(fields[0]);
  if (!generation || *generation == 0 || *generation == std::numeric_limits<std::uint64_t>::max()) {
    throw fail("generation is not a decimal number in [1, 2^64 - 2]");
  }
  q.generation = *generation;
  const auto joins = stores::detail::parse_decimal<std::int64_t>(fields[1]);
  if (!joins || *joins < 0) throw fail("join count is not a non-negative decimal number");
  q.joins = *joins;
  for (std::size_t i = 2; i < fields.size(); ++i) {
    if (!stores::detail::is_valid_key(fields[i])) throw fail("member " + std::to_string(i - 2) + " is not a valid id");
    q.members.emplace_back(fields[i]);
  }
  return q;
}

/// The time (ms since the epoch, >= 0) in a stored heartbeat, or nothing if it is not one.
[[nodiscard]] inline std::optional<std::int64_t> decode_heartbeat(std::string_view text) noexcept {
  const auto t = stores::detail::parse_decimal<std::int64_t>(text);
  if (!t || *t < 0) return std::nullopt;  // garbage is not a heartbeat
  return t;
}

/// Join requests made since a quorum formed: the join counter's growth since then, in [0, 2^20].
/// Overflow-free whatever the counter holds (it is read back from the store).
[[nodiscard]] constexpr int pending_joins(std::int64_t now, std::int64_t at_formation) noexcept {
  if (now <= at_formation) return 0;
  const std::uint64_t grown = static_cast<std::uint64_t>(now) - static_cast<std::uint64_t>(at_formation);
  return static_cast<int>(std::min<std::uint64_t>(grown, std::uint64_t{1} << 20));
}

}  // namespace detail

/// Knobs of the fault-tolerance protocol.
struct manager_options {
  /// This replica's name in the store (key characters). Ranks in a quorum follow name order.
  std::string replica_id;
  /// No step commits with fewer participants.
  int min_replicas = 1;
  /// Deadline for forming a quorum (including healing) before `start_quorum()` gives up.
  std::chrono::milliseconds quorum_timeout{60000};
  /// How often a replica writes its heartbeat, and rank 0 polls for enrollment requests.
  std::chrono::milliseconds heartbeat_interval{100};
  /// A member whose heartbeat is older is presumed dead when counting the majority.
  std::chrono::milliseconds heartbeat_timeout{5000};
  /// After the minimum number of members arrived, how long to wait for the rest.
  std::chrono::milliseconds settle{500};
  /// `should_commit()` throws after this many consecutive failed steps.
  int max_consecutive_failures = 20;
  /// Healing broadcasts state in chunks of this size.
  std::size_t heal_chunk_bytes = std::size_t{16} << 20;
  /// true: a replica healed in `start_quorum()` contributes its real gradients in that step.
  /// false (torchft's rule): it contributes zeros and is not counted in the divisor.
  bool healed_replicas_participate = true;
  /// Reports long operations: healing (bytes, rate, time left) and quorum rendezvous (who has
  /// not arrived). Default: lines on stderr from rank 0 for operations over 2 s (progress.hpp).
  progress_sink progress = print_progress();
};

/// A quorum as the communicator factory sees it.
struct quorum_info {
  std::uint64_t generation = 0;      ///< increases with every quorum change
  int rank = 0;                      ///< this replica's rank in the quorum
  int size = 1;                      ///< members of the quorum
  std::vector<std::string> members;  ///< replica ids in rank order
  store_ref store;                   ///< namespace reserved for this generation's rendezvous
};

/// Builds the communicator of one quorum (gloo through the store, NCCL with its unique id in
/// the store, local threads through a fabric, ...).
using communicator_factory = std::function<any_communicator(const quorum_info&)>;

/// What happened, for logs: quorum changes, discarded steps, healing.
struct manager_event {
  /// `quorum`: a new quorum formed; `healed`: this replica received state; `sent_state`: it
  /// sent state to recovering replicas; `discarded`: a step did not commit; `error`: a
  /// collective's error was captured.
  enum class kind : unsigned char { quorum, healed, sent_state, discarded, error };
  kind what = kind::quorum;  ///< kind of event
  std::int64_t step = 0;     ///< committed steps when it happened
  std::string text;          ///< human-readable details
};

/// Counters a trainer can print.
struct manager_stats {
  std::uint64_t quorums = 0;       ///< quorum changes (communicators built)
  std::uint64_t commits = 0;       ///< steps that committed
  std::uint64_t discarded = 0;     ///< steps that did not commit
  std::uint64_t heals = 0;         ///< times this replica received state
  std::uint64_t healed_bytes = 0;  ///< state bytes received, over all heals
  double heal_ms = 0;              ///< time spent in the last healing transfer
};

/// Quorum could not be formed in time, or too many steps failed in a row.
class manager_error : public communication_error {
 public:
  using communication_error::communication_error;
};

/// One replica's side of the fault-tolerance protocol (see the file description). Models
/// `communicator`: collectives issued through it go to the current quorum's communicator and
/// never throw; their errors fail the step instead. Neither copyable nor movable.
class Manager {
 public:
  /// @param store    shared by every replica of the job (give each job its own prefix)
  /// @param factory  builds the communicator for each quorum
  /// @param state    what a recovering replica receives (must outlive the Manager)
  /// @param options  the protocol's knobs; `replica_id` must be set
  /// @throws usage_error if `replica_id` is not a valid key or `min_replicas` is below 1
  template <store Store, transferable_state State>
  Manager(Store& store, communicator_factory factory, State& state, manager_options options)
      : store_(store),
        factory_(std::move(factory)),
        tensors_([&state] { return std::span<const tensor_view>(state.state_tensors()); }),
        scalars_([&state] { return std::span<std::int64_t>(state.state_scalars()); }),
        opts_(std::move(options)) {
    stores::detail::check_key(opts_.replica_id, "Manager replica_id");
    if (opts_.min_replicas < 1) throw usage_error(-1, "Manager", "min_replicas must be at least 1");
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
    {
      std::lock_guard lk(error_mutex_);
      error_ = nullptr;
    }
    heartbeat(false);
    if (needs_quorum_ || !comm_) form_quorum();
    poll_join_requests();
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
    if (!failed()) {
      std::vector<std::int64_t> words(vote, vote + 2);
      try {
        communicator_ref(comm_).allreduce(words, reduce_op::max).wait();
        vote[0] = words[0];
        vote[1] = words[1];
      } catch (...) {
        capture(std::current_exception());
        vote[0] = 1;
      }
    }
    const bool commit = vote[0] == 0 && participants_ >= opts_.min_replicas;
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
    emit(manager_event::kind::discarded, "step " + std::to_string(step_) + " discarded: " +
                                             (vote[0] ? describe_error() : "fewer than min_replicas participants"));
    if (++consecutive_failures_ > opts_.max_consecutive_failures) {
      throw manager_error(
          rank_, "Manager::should_commit",
          std::to_string(consecutive_failures_) + " consecutive steps failed to commit; last: " + describe_error());
    }
    return false;
  }

  /// Comm hook for a Bucketer over this Manager: averages over the participants of the step
  /// (a healing non-participant contributes zeros), by ddp's one averaging rule
  /// (`allreduce_average`). Needed only with `healed_replicas_participate = false`: otherwise
  /// every member participates, and a Bucketer's default averaging (by the communicator's size,
  /// i.e. the quorum's, read at the start of each iteration) gives the same bits and is cheaper
  /// (it divides during the copy into the bucket).
  [[nodiscard]] ddp::comm_hook comm_hook() {
    return [this](grad_bucket& b) -> work {
      const tensor_view data = b.data;
      if (!participating_ && data.count) std::memset(data.data, 0, data.bytes());
      return allreduce_average(*this, data, std::max(participants_, 1), average_input::raw, "Manager comm hook");
    };
  }
  /// The former name of `comm_hook()`.
  [[nodiscard, deprecated("use comm_hook(): it returns a Bucketer comm hook")]] ddp::comm_hook gradient_hook() {
    return comm_hook();
  }

  /// Optional: a fingerprint of the gradient layout (e.g. `Bucketer::layout_fingerprint()`) that
  /// every member must share; a replica that differs is named when the quorum forms.
  void set_layout_fingerprint(std::uint64_t fp) noexcept { layout_fingerprint_ = fp; }
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
  /// The current quorum's device queue (`device_communicator`): its runtime, stream and device;
  /// an empty queue (null runtime) between quorums or over a host communicator. It changes with
  /// every quorum (each has its own communicator and stream): a component that reads it once
  /// (a Bucketer, at construction) sees only the queue of that moment.
  [[nodiscard]] ddp::device_queue device_queue() const { return comm_ ? comm_.device_queue() : ddp::device_queue{}; }
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
  /// False if this replica received state when the current quorum formed and
  /// `healed_replicas_participate` is false: its gradients then count as zeros.
  [[nodiscard]] bool participating() const noexcept { return participating_; }
  /// True once an error was captured in this step.
  [[nodiscard]] bool failed() const {
    std::lock_guard lk(error_mutex_);
    return error_ != nullptr;
  }
  /// The first error captured in this step, or null.
  [[nodiscard]] std::exception_ptr error() const {
    std::lock_guard lk(error_mutex_);
    return error_;
  }
  /// Counters since construction.
  [[nodiscard]] const manager_stats& stats() const noexcept { return stats_; }
  /// The options.
  [[nodiscard]] const manager_options& options() const noexcept { return opts_; }

 private:
  // A work whose failure is recorded in the Manager instead of thrown: the gradients may be
  // garbage, but should_commit() will refuse the step on every replica.
  class captured_work final : public work_state {
   public:
    captured_work(work inner, Manager* m, op_info info) : work_state(info), inner_(std::move(inner)), m_(m) {}
    bool poll() override {
      try {
        return inner_.test();
      } catch (...) {
        m_->capture(std::current_exception());
        return true;
      }
    }
    bool wait_until(clock::time_point deadline) override {
      try {
        inner_.wait_for(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now()));
      } catch (...) {
        m_->capture(std::current_exception());
      }
      return true;
    }

   private:
    work inner_;
    Manager* m_;
  };

  template <class Issue>
  work forward(Issue&& issue, const char* name) {
    if (failed() || !comm_) return work::ready();  // the step is lost anyway: skip, don't block
    op_info info;
    info.rank = rank_;
    info.name = name;
    info.timeout = std::chrono::hours(24);  // the inner work carries the real deadline
    try {
      return work(std::make_unique<captured_work>(issue(), this, info));
    } catch (...) {
      capture(std::current_exception());
      return work::ready();
    }
  }

  void capture(std::exception_ptr e) {
    {
      std::lock_guard lk(error_mutex_);
      if (error_) return;
      error_ = e;
    }
    needs_quorum_ = true;
    // Tell every peer now: their pending collectives on this communicator fail instead of
    // waiting for their timeout.
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

  static std::int64_t wall_ms() {
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  }

  void heartbeat(bool force) {
    const auto now = clock::now();
    if (!force && now - last_heartbeat_ < opts_.heartbeat_interval) return;
    last_heartbeat_ = now;
    store_.set("hb/" + opts_.replica_id, as_bytes(std::to_string(wall_ms())));
  }

  // Rank 0 reads the join counter at most every heartbeat_interval; the vote spreads the news.
  void poll_join_requests() {
    if (rank_ != 0 || !comm_) return;
    const auto now = clock::now();
    if (now - last_join_poll_ < opts_.heartbeat_interval) return;
    last_join_poll_ = now;
    join_requested_ = store_.add("joins", 0) > joins_at_formation_;
  }

  // "current": see detail::encode_quorum_record.
  detail::quorum_record read_latest() {
    const auto v = store_.get("current");
    if (!v) return {};
    return detail::decode_quorum_record(to_text(*v), rank_);
  }

  bool heartbeat_fresh(const std::string& id) {
    if (id == opts_.replica_id) return true;
    const auto v = store_.get("hb/" + id);
    if (!v) return false;
    const auto t = detail::decode_heartbeat(to_text(*v));
    return t && wall_ms() - *t < opts_.heartbeat_timeout.count();
  }

  void form_quorum() {
    timeline::scoped_span span(rec_, "manager", "quorum");
    const auto deadline = clock::now() + opts_.quorum_timeout;
    std::string last_problem = "no attempt";
    for (;;) {
      if (clock::now() >= deadline) {
        throw manager_error(
            rank_, "Manager::start_quorum",
            "no quorum within " + std::to_string(opts_.quorum_timeout.count()) + " ms (need at least " +
                std::to_string(opts_.min_replicas) +
                " replicas, a majority of them members of the previous quorum); last problem: " + last_problem);
      }
      if (comm_) comm_.abort();
      comm_ = any_communicator();
      try {
        if (try_form_quorum(deadline)) {
          span.set("generation", static_cast<double>(generation_));
          span.set("size", size_);
          return;
        }
      } catch (const state_placement_error&) {  // the same on every attempt: fail now
        if (comm_) comm_.abort();
        comm_ = any_communicator();
        throw;
      } catch (const ddp::error& e) {  // a dead peer, a group that formed without us, a slow store: try again
        if (refused_) {                // this replica's layout or step is wrong: retrying cannot help
          if (comm_) comm_.abort();
          comm_ = any_communicator();
          std::rethrow_exception(refused_);
        }
        last_problem = e.what();
      }
    }
  }

  // The latest generation whose membership closed, and its members. "current" is only a hint
  // (its writer may lag or be overtaken): the closed lists, one per generation, are the truth.
  std::pair<std::uint64_t, std::vector<std::string>> latest_installed() {
    const detail::quorum_record hint = read_latest();
    std::uint64_t gen = hint.generation;
    std::vector<std::string> members = hint.members;
    for (;;) {
      const auto next = store_.get("g" + std::to_string(gen + 1) + "/members/closed");
      if (!next) break;
      ++gen;
      members.clear();
      for (auto& a : stores::detail::decode_members(to_text(*next))) members.push_back(std::move(a.id));
    }
    if (gen > hint.generation || members.empty()) return {gen, members};
    // The hint's own list, if still there, is the authority on its members.
    if (const auto own = store_.get("g" + std::to_string(gen) + "/members/closed")) {
      members.clear();
      for (auto& a : stores::detail::decode_members(to_text(*own))) members.push_back(std::move(a.id));
    }
    return {gen, members};
  }

  // The quorum rule. A group may form generation g+1 only if it holds more than half of
  // generation g's members, or exactly half including g's rank 0 (any two such sets of g's
  // members intersect). Each generation closes once (stores::enroll_any: one claim wins), and
  // generation g+1 is only ever formed on top of g, so the quorums form one chain in which each
  // holds a member that left its predecessor: no two quorums commit side by side.
  static bool holds_majority(const std::vector<std::string>& base, const std::vector<std::string>& ids) {
    if (base.empty()) return true;  // a job's first quorum: generation 1 closes once, whoever is in it
    std::size_t in = 0;
    for (const auto& b : base) in += std::find(ids.begin(), ids.end(), b) != ids.end() ? 1 : 0;
    if (2 * in != base.size()) return 2 * in > base.size();
    return std::find(ids.begin(), ids.end(), base.front()) != ids.end();
  }

  // The highest join ticket of `members` (0 if none asked): requests up to it include theirs.
  std::int64_t latest_ticket(const std::vector<std::string>& members) {
    std::int64_t latest = 0;
    for (const auto& id : members) {
      const auto v = store_.get("join_ticket/" + id);
      if (!v) continue;
      const std::string text = to_text(*v);
      std::int64_t t = 0;
      const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), t);
      if (ec == std::errc() && end == text.data() + text.size()) latest = std::max(latest, t);
    }
    return latest;
  }

  // One attempt at the next generation. Returns true once formed (and healed).
  bool try_form_quorum(clock::time_point deadline) {
    heartbeat(true);
    const detail::quorum_record hint = read_latest();
    // (no structured binding: clang < 16 cannot capture one in the admissibility lambda below)
    auto latest = latest_installed();
    const std::uint64_t base_gen = latest.first;
    std::vector<std::string> base = std::move(latest.second);
    const bool member_of_latest =
        generation_ == base_gen && std::find(base.begin(), base.end(), opts_.replica_id) != base.end();
    if (!member_of_latest && signalled_after_ != base_gen + 1) {
      // Ask the running quorum to re-form with this replica; the ticket lets the quorum that
      // admits it count the request as answered even when it was made after its rank 0 read.
      const std::int64_t ticket = store_.add("joins", 1);
      store_.set("join_ticket/" + opts_.replica_id, as_bytes(std::to_string(ticket)));
      signalled_after_ = base_gen + 1;
    }
    // Join requests made before this attempt are answered by it. One made later, by a replica
    // that found this generation closed without it, is after this read: it re-forms the quorum.
    const std::int64_t joins_answered = store_.add("joins", 0);
    std::vector<std::string> live;  // also named by the rendezvous' progress reports while missing
    for (const auto& id : base) {
      if (heartbeat_fresh(id)) live.push_back(id);
    }
    const int alive = static_cast<int>(live.size());
    const int pending = hint.generation == base_gen ? detail::pending_joins(joins_answered, hint.joins) : 1 << 20;
    stores::group_options g;
    g.min_members = opts_.min_replicas;
    g.admissible = [base](const std::vector<std::string>& ids) { return holds_majority(base, ids); };
    // Everyone expected arrived: close at once. At a job's start nobody knows how many will
    // come: wait `settle` after the minimum arrived.
    g.max_members = base.empty() ? INT_MAX : std::max(g.min_members, std::min(alive + pending, INT_MAX / 2));
    g.settle = opts_.settle;
    g.progress = opts_.progress;
    g.expected = std::move(live);
    // Bounded attempts: a member that died a moment ago still counts as alive until its
    // heartbeat expires; each attempt reads the live members again.
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now());
    g.timeout = std::max(std::chrono::milliseconds(1), std::min(left, opts_.heartbeat_timeout + 4 * opts_.settle));
    const std::uint64_t target = base_gen + 1;
    generation_ = target;
    stores::prefix_store<store_ref> gen_store(store_, "g" + std::to_string(target) + "/");
    const stores::membership m = stores::enroll_any(gen_store, opts_.replica_id, g);
    rank_ = m.rank;
    size_ = m.size();
    members_ = m.members;
    // Rank 0 polls the join counter from now on: every member's own request is answered.
    const std::int64_t answered = m.rank == 0 ? std::max(joins_answered, latest_ticket(m.members)) : joins_answered;
    if (m.rank == 0 && read_latest().generation < target) {
      const detail::quorum_record rec{target, answered, m.members};
      store_.set("current", as_bytes(detail::encode_quorum_record(rec)));
    }
    comm_store_ = std::make_unique<stores::prefix_store<store_ref>>(store_, "g" + std::to_string(target) + "/comm/");
    comm_ = factory_(quorum_info{target, m.rank, m.size(), m.members, store_ref(*comm_store_)});
    check_state_placement();
    exchange_and_heal(base);
    // The communicators' keys of older generations are garbage now (gloo keys are write-once
    // anyway). Member lists stay: they are small, and they are the chain of generations.
    if (m.rank == 0 && target > 2) store_.erase_prefix("g" + std::to_string(target - 2) + "/comm/");
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

  [[nodiscard]] std::size_t state_bytes() const {
    std::size_t n = 0;
    for (const auto& t : tensors_()) n += t.bytes();
    return n;
  }

  // A device state tensor needs a device communicator: it is healed by the communicator's
  // collectives and read back for the hash through its device queue.
  class state_placement_error final : public usage_error {
   public:
    using usage_error::usage_error;
  };
  void check_state_placement() const {
    const auto ts = tensors_();
    const auto on_device = std::find_if(ts.begin(), ts.end(), [](const tensor_view& t) { return !t.where.is_host(); });
    if (on_device == ts.end() || comm_.device_queue().runtime != nullptr) return;
    throw state_placement_error(rank_, "Manager quorum " + std::to_string(generation_),
                                "state tensor " + std::to_string(on_device - ts.begin()) + " is on " +
                                    on_device->where.str() +
                                    ", but the communicator the factory built has no device queue (device_queue()) "
                                    "to heal and hash it with: build a device communicator, or register host tensors");
  }

  // FNV-1a over the state's bytes, the scalars and the step. Device tensors are copied to the
  // host first, chunk by chunk, on the communicator's stream (after the healing broadcasts).
  [[nodiscard]] std::uint64_t state_hash(std::int64_t step) {
    std::uint64_t h = detail::fnv1a_offset_basis;
    std::vector<std::byte> host;
    for (const tensor_view& t : tensors_()) {
      if (t.where.is_host()) {
        h = detail::fnv1a(std::span<const std::byte>(t.byte_data(), t.bytes()), h);
        continue;
      }
      const ddp::device_queue q = comm_.device_queue();  // present: check_state_placement()
      const std::size_t chunk = std::max<std::size_t>(1, opts_.heal_chunk_bytes);
      host.resize(std::min(chunk, t.bytes()));
      const detail::device_event_owner done(*q.runtime, q.where);
      for (std::size_t off = 0; off < t.bytes(); off += chunk) {
        const std::size_t n = std::min(chunk, t.bytes() - off);
        const copy_region r{host.data(), t.byte_data() + off, n};
        q.runtime->copy(std::span<const copy_region>(&r, 1), q.stream);
        q.runtime->record(done.get(), q.stream);
        q.runtime->synchronize(done.get());
        h = detail::fnv1a(std::span<const std::byte>(host.data(), n), h);
      }
    }
    h = detail::fnv1a(std::as_bytes(scalars_()), h);
    return detail::fnv1a_object(step, h);
  }

  // Before a step can commit, the store's "step_limit" covers it: rank 0 raises it before the
  // vote (every commit needs rank 0's vote), 1024 steps at a time, so a reported step above it
  // is impossible. Monotone through add(): a stale rank 0 can only raise it, never lower it.
  void raise_step_limit() {
    if (rank_ != 0 || failed() || step_ < step_limit_) return;
    try {
      std::int64_t v = store_.add("step_limit", 0);
      if (v <= step_) v = store_.add("step_limit", step_ + 1024 - v);
      step_limit_ = v;
    } catch (...) {
      capture(std::current_exception());  // the step cannot commit without it
    }
  }

  // A replica whose words are wrong is left out: it is told (the error, kept in refused_, is
  // thrown by every later start_quorum()), and the others form the next generation without it.
  void refuse(const std::vector<std::pair<int, std::string>>& bad) {
    for (const auto& [r, why] : bad) {
      if (r != rank_) continue;
      const std::string op = "Manager quorum " + std::to_string(generation_);
      refused_ = why.find("layout") != std::string::npos ? std::make_exception_ptr(usage_error(rank_, op, why))
                                                         : std::make_exception_ptr(manager_error(rank_, op, why));
      std::rethrow_exception(refused_);
    }
    throw communication_error(rank_, "Manager quorum " + std::to_string(generation_),
                              "left out: " + bad.front().second + "; re-forming without it");
  }

  // Members exchange (step, fresh, layout, state size, needs healing); those behind receive the
  // state from members of the previous quorum that hold it.
  void exchange_and_heal(const std::vector<std::string>& base) {
    constexpr std::size_t words = 5;
    const auto n = static_cast<std::size_t>(size_);
    std::vector<std::int64_t> mine{step_, fresh_ ? 1 : 0, static_cast<std::int64_t>(layout_fingerprint_),
                                   static_cast<std::int64_t>(state_bytes()), needs_heal_ ? 1 : 0};
    std::vector<std::int64_t> all(words * n);
    comm_.allgather(view(mine), view(all)).wait();
    const auto word = [&](std::size_t r, std::size_t k) { return all[r * words + k]; };
    const auto carried = [&](std::size_t r) { return std::find(base.begin(), base.end(), members_[r]) != base.end(); };
    // The layout most members of the previous quorum share (of all members at a job's start);
    // ties go to the lowest rank. Replicas with another one are left out.
    std::size_t ref = 0, ref_votes = 0;
    for (std::size_t r = 0; r < n; ++r) {
      std::size_t votes = 0;
      for (std::size_t q = 0; q < n; ++q) {
        votes += (base.empty() || carried(q)) && word(q, 2) == word(r, 2) && word(q, 3) == word(r, 3) ? 1 : 0;
      }
      if (votes > ref_votes) {
        ref = r;
        ref_votes = votes;
      }
    }
    std::vector<std::pair<int, std::string>> bad;
    std::vector<bool> ok(n, true);
    for (std::size_t r = 0; r < n; ++r) {
      if (word(r, 2) != word(ref, 2) || word(r, 3) != word(ref, 3)) {
        bad.emplace_back(static_cast<int>(r), "replica " + members_[r] +
                                                  " registered a different gradient layout or state size (" +
                                                  std::to_string(word(r, 3)) + " state bytes) than replica " +
                                                  members_[ref] + " (" + std::to_string(word(ref, 3)) + ")");
        ok[r] = false;
      } else if (word(r, 1) < 0 || word(r, 1) > 1 || word(r, 4) < 0 || word(r, 4) > 1 || word(r, 0) < 0) {
        bad.emplace_back(static_cast<int>(r), "replica " + members_[r] + " reported malformed words");
        ok[r] = false;
      }
    }
    const auto up_to_date = [&](std::size_t r) { return ok[r] && word(r, 1) == 0 && word(r, 4) == 0; };
    // Who holds the committed state: members of the previous quorum that are up to date (a
    // replica that left earlier holds an older step; one that received part of a heal holds
    // nothing). Their steps differ by at most one (a vote that completed on some of them only).
    std::int64_t lo = std::numeric_limits<std::int64_t>::max();
    for (std::size_t r = 0; r < n; ++r) {
      if (carried(r) && up_to_date(r)) lo = std::min(lo, word(r, 0));
    }
    const bool have_holder = lo != std::numeric_limits<std::int64_t>::max();
    // No quorum ever committed beyond "step_limit" (raise_step_limit()).
    const std::int64_t limit = store_.add("step_limit", 0);
    for (std::size_t r = 0; r < n; ++r) {
      if (!up_to_date(r)) continue;
      const bool ahead = word(r, 0) == std::numeric_limits<std::int64_t>::max() || word(r, 0) > limit ||
                         (have_holder && word(r, 0) > lo + 1);
      if (ahead) {
        bad.emplace_back(static_cast<int>(r),
                         "replica " + members_[r] + " reported step " + std::to_string(word(r, 0)) +
                             ", ahead of every committed quorum (the previous quorum's members "
                             "hold step " +
                             (have_holder ? std::to_string(lo) : std::string("none")) +
                             ", no quorum may have committed beyond " + std::to_string(limit) + ")");
        ok[r] = false;
      }
    }
    if (!bad.empty()) refuse(bad);
    std::int64_t max_step = -1;
    std::vector<int> sources;
    for (std::size_t r = 0; r < n; ++r) {
      if (carried(r) && up_to_date(r)) max_step = std::max(max_step, word(r, 0));
    }
    for (std::size_t r = 0; r < n; ++r) {
      if (carried(r) && up_to_date(r) && word(r, 0) == max_step) sources.push_back(static_cast<int>(r));
    }
    if (sources.empty()) {
      // Nobody here holds the committed state. Before the job's first heal completed nothing was
      // committed, and any member's state may start it (a fresh one first); after, waiting for a
      // holder is the only safe course.
      if (store_.add("started", 0) > 0) {
        throw communication_error(rank_, "Manager quorum " + std::to_string(generation_),
                                  "no member holds the committed state (none of the previous quorum's up-to-date "
                                  "members is here); waiting for one");
      }
      std::size_t first = 0;
      while (first + 1 < n && word(first, 1) == 0) ++first;
      if (word(first, 1) == 0) first = 0;
      sources.push_back(static_cast<int>(first));
      max_step = word(first, 0);
    }
    const bool i_recover = std::find(sources.begin(), sources.end(), rank_) == sources.end();
    const bool anyone_recovers = sources.size() < n;
    participants_ = size_;
    participating_ = true;
    if (anyone_recovers) {
      heal(sources, max_step, i_recover);
      if (!opts_.healed_replicas_participate) {
        participants_ = static_cast<int>(sources.size());
        participating_ = !i_recover;
      }
    }
    fresh_ = false;
    if (rank_ == 0 && !started_) started_ = store_.add("started", 1) > 0;
  }

  void heal(const std::vector<int>& sources, std::int64_t max_step, bool receiving) {
    const auto start = clock::now();
    timeline::scoped_span span(rec_, "manager", receiving ? "heal (receive)" : "heal (send)");
    progress_meter meter(
        &opts_.progress, "heal", rank_, state_bytes(),
        (receiving ? "receiving state of step " : "sending state of step ") + std::to_string(max_step) +
            (receiving ? " from " + std::to_string(sources.size()) + " replica(s)"
                       : " to " + std::to_string(size_ - static_cast<int>(sources.size())) + " recovering replica(s)"));
    std::size_t chunk_index = 0;
    std::size_t moved = 0;
    // Chunk k of the concatenated state comes from sources[k % sources]: the sending load is
    // spread. Up-to-date members receive bytes identical to their own.
    // All chunks are in flight at once; waiting drives them together.
    std::vector<work> transfers;
    // From its first received byte until the hash check passes, a receiver holds nothing: it
    // reports "needs healing" to every later quorum, never serves as a source, keeps its step.
    if (receiving) needs_heal_ = true;
    for (const auto& t : tensors_()) {
      const std::size_t elem = size_of(t.type);
      const std::size_t per_chunk = std::max<std::size_t>(1, opts_.heal_chunk_bytes / elem);
      for (std::size_t off = 0; off < t.count; off += per_chunk) {
        const tensor_view chunk = t.slice(off, std::min(per_chunk, t.count - off));
        const int root = sources[chunk_index++ % sources.size()];
        transfers.push_back(
            comm_.broadcast(std::span<const tensor_view>(&chunk, 1), root).then([&meter, n = chunk.bytes()] {
              meter.add_bytes(n);
            }));
        moved += chunk.bytes();
      }
    }
    work::wait_all(transfers);  // round-robin, one deadline, an error naming the first pending chunk
    const auto sc = scalars_();
    std::vector<std::int64_t> scalars(sc.begin(), sc.end());
    scalars.push_back(max_step);
    communicator_ref(comm_).broadcast(scalars, sources.front()).wait();
    std::copy(scalars.begin(), scalars.end() - 1, sc.begin());
    if (scalars.back() != max_step) {
      throw communication_error(
          rank_, "Manager healing",
          "the sources sent step " + std::to_string(scalars.back()) + ", expected " + std::to_string(max_step));
    }
    // Proof: every member now holds the same state, the sources' (hashed at the sources' step).
    std::vector<std::int64_t> h{static_cast<std::int64_t>(state_hash(max_step))};
    std::vector<std::int64_t> all(static_cast<std::size_t>(size_));
    comm_.allgather(view(h), view(all)).wait();
    for (std::size_t r = 0; r < all.size(); ++r) {
      if (all[r] != h[0]) {
        throw communication_error(rank_, "Manager healing",
                                  "replica " + members_[r] + " holds a different state after healing");
      }
    }
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
  bool fresh_ = true;
  bool needs_heal_ = false;      // received part of a heal that has not passed its check
  bool started_ = false;         // rank 0 saw the job's first heal complete
  std::int64_t step_limit_ = 0;  // rank 0: "step_limit" as last raised (steps below it may commit)
  std::exception_ptr refused_;   // this replica was left out of quorums for good (refuse())
  int participants_ = 1;
  bool participating_ = true;
  bool needs_quorum_ = true;
  std::uint64_t signalled_after_ = 0;  // generation this replica asked to join
  bool join_requested_ = false;
  std::int64_t joins_at_formation_ = 0;
  std::uint64_t layout_fingerprint_ = 0;
  int consecutive_failures_ = 0;
  clock::time_point last_heartbeat_{};
  clock::time_point last_join_poll_{};
  manager_stats stats_;

  mutable std::mutex error_mutex_;
  std::exception_ptr error_;
};

static_assert(communicator<Manager>);
static_assert(device_communicator<Manager>);
static_assert(dynamic_premul_sum_communicator<Manager>);
static_assert(staging_communicator<Manager>);

}  // namespace ddp
