#pragma once
/// @file manager/options.hpp
/// @brief What a `Manager` (ddp/manager.hpp) is told and what it reports: its knobs
/// (`manager_options`), the quorum its communicator factory builds for (`quorum_info`,
/// `communicator_factory`), its events and counters (`manager_event`, `manager_stats`) and its
/// error (`manager_error`). See docs/fault-tolerance.md.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ddp/any_communicator.hpp>
#include <ddp/device_runtime.hpp>
#include <ddp/error.hpp>
#include <ddp/progress.hpp>
#include <ddp/store.hpp>
#include <ddp/time_source.hpp>

namespace ddp {

/// How healing moves the state (docs/fault-tolerance.md, "Healing routes").
enum class heal_transport : unsigned char {
  /// Broadcasts over the quorum's communicator: every member receives every transfer, the other
  /// sources too, and transfers run one after another where the backend runs one collective at a
  /// time (gloo). Needs nothing more of the factory.
  quorum_broadcast,
  /// One communicator per source, the source and the members it heals (`quorum_info::heal_source`),
  /// built by the factory for each heal: sources send only to receivers, all at once. Needs a
  /// factory that keys its rendezvous by `quorum_info::store` (gloo, NCCL) or by `heal_source`.
  source_routes,
};

/// Knobs of the fault-tolerance protocol.
struct manager_options {
  /// This replica's name in the store (key characters). Ranks in a quorum follow name order.
  std::string replica_id;
  /// No step commits with fewer participants.
  int min_replicas = 1;
  /// The deadline of a step, counted from the end of `start_quorum()`: every collective issued
  /// through the Manager in the step (waited, tested or polled) that has not completed by then
  /// fails the step with a `timeout_error`, and so does the commit vote. A hung peer costs the
  /// others one step. It must exceed the longest healthy step (compute and communication).
  std::chrono::milliseconds step_timeout{30000};
  /// Deadline for forming a quorum (including healing) before `start_quorum()` gives up.
  std::chrono::milliseconds quorum_timeout{60000};
  /// How often a replica writes its heartbeat, and rank 0 polls for enrollment requests.
  std::chrono::milliseconds heartbeat_interval{100};
  /// A member whose heartbeat is older is presumed dead when counting the majority (a replica that
  /// hangs in a step writes none).
  std::chrono::milliseconds heartbeat_timeout{5000};
  /// After the minimum number of members arrived, how long to wait for the rest.
  std::chrono::milliseconds settle{500};
  /// `should_commit()` throws after this many consecutive failed steps.
  int max_consecutive_failures = 20;
  /// Healing broadcasts state in chunks of this size.
  std::size_t heal_chunk_bytes = std::size_t{16} << 20;
  /// How healing moves the state. Every replica must use the same.
  heal_transport heal_over = heal_transport::quorum_broadcast;
  /// true: a replica healed in `start_quorum()` contributes its real gradients in that step.
  /// false (torchft's rule): it contributes zeros and is not counted in the divisor.
  bool healed_replicas_participate = true;
  /// Hot spares: at most this many members contribute gradients in a step (0: every member). The
  /// others are spares: they take part in every collective with zeros and apply every committed
  /// step, so they hold the state warm and take a dead member's place at the next quorum without
  /// healing (docs/fault-tolerance.md, "Hot spares"). Every replica must use the same value.
  int active_replicas = 0;
  /// Reports long operations: healing (bytes, rate, time left) and quorum rendezvous (who has
  /// not arrived). Default: lines on stderr from rank 0 for operations over 2 s (progress.hpp).
  progress_sink progress = print_progress();
  /// A replica that trains on a device: the runtime, stream and device on which every quorum's
  /// communicator runs its collectives (the factory builds each one on this stream; the runtime
  /// and stream outlive the Manager). The Manager's `device_queue()` is then this queue at all
  /// times, so a Bucketer built over the Manager before the first quorum keeps its device buckets
  /// on it across quorums (docs/fault-tolerance.md, "On GPUs"). Empty (null runtime): host gradients,
  /// or a device queue that changes with each quorum's communicator.
  ddp::device_queue device_queue{};
  /// The clock the protocol's deadlines, heartbeats and polling follow (null: the machine's). The
  /// deterministic simulation passes its virtual clock (time_source.hpp); it must outlive the Manager.
  time_source* time = nullptr;

  /// Timing for a cluster whose steps take at most a few seconds: a hung or dead replica costs
  /// the others about `step_timeout` + `heartbeat_timeout` + a quorum (under 10 s), instead of the
  /// defaults' 30 s + 5 s. The table of what each field bounds: docs/fault-tolerance.md, "Timing".
  /// @param id the replica's id
  [[nodiscard]] static manager_options fast_failover(std::string id) {
    manager_options o;
    o.replica_id = std::move(id);
    o.step_timeout = std::chrono::milliseconds(5000);
    o.quorum_timeout = std::chrono::milliseconds(30000);
    o.heartbeat_interval = std::chrono::milliseconds(100);
    o.heartbeat_timeout = std::chrono::milliseconds(2000);
    o.settle = std::chrono::milliseconds(200);
    return o;
  }
};

/// A quorum as the communicator factory sees it.
struct quorum_info {
  std::uint64_t generation = 0;      ///< increases with every quorum change
  int rank = 0;                      ///< this replica's rank in the quorum
  int size = 1;                      ///< members of the quorum
  std::vector<std::string> members;  ///< replica ids in rank order
  store_ref store;                   ///< namespace reserved for this communicator's rendezvous
  /// -1: the quorum's communicator. Otherwise a heal route (heal_transport::source_routes): the
  /// communicator from the member of quorum rank `heal_source` (rank 0 here) to the members it
  /// heals; `members`, `rank` and `size` are the route's.
  int heal_source = -1;
  /// When forming this quorum gives up (`manager_options::quorum_timeout` from its start, on the
  /// machine's clock), or the epoch where unknown (heal routes, a group's followers): a factory
  /// bounds its rendezvous by it and sizes its communicator's own timeout from it
  /// (`gloo::manager_factory`, `nccl::manager_factory`).
  clock::time_point deadline{};
  /// `manager_options::step_timeout`: the Manager ends every collective of a step by then (0 where
  /// unknown).
  std::chrono::milliseconds step_timeout{0};
  /// How long a factory waits for the members to connect (`deadline` still caps it), so that a
  /// member that enrolled and then died holds the others this long, not until `deadline`: the
  /// attempt fails and the next one forms without it once its heartbeat is stale. The Manager's
  /// and a replica group's: `detail::connect_timeout_of`; 0 where unknown.
  std::chrono::milliseconds connect_timeout{0};

  /// What is left until `deadline`, `longest` at most (and where it is unknown), 1 ms at least:
  /// the budget of a factory's rendezvous.
  [[nodiscard]] std::chrono::milliseconds time_left(std::chrono::milliseconds longest) const {
    if (deadline == clock::time_point{}) return longest;
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - clock::now());
    return std::clamp(left, std::chrono::milliseconds(1), std::max(longest, std::chrono::milliseconds(1)));
  }
  /// `time_left` for a rendezvous: `longest`, `connect_timeout` and `deadline` at most.
  [[nodiscard]] std::chrono::milliseconds connect_time_left(std::chrono::milliseconds longest) const {
    return time_left(connect_timeout > std::chrono::milliseconds(0) ? std::min(longest, connect_timeout) : longest);
  }
  /// A communicator's own collective timeout for this quorum, `longest` at most: its exchange and
  /// heal end by `deadline`, a step's collectives by the Manager's step deadline, so the backend's
  /// timeout is a backstop that never fires before those (docs/fault-tolerance.md, "Timing").
  [[nodiscard]] std::chrono::milliseconds communicator_timeout(std::chrono::milliseconds longest) const {
    return std::min(longest, std::max(time_left(longest), step_timeout));
  }
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

namespace detail {
/// A Manager's options and store, checked. @throws usage_error naming what is wrong
inline void check_options(const manager_options& o, bool first_write_store) {
  if (o.min_replicas < 1) throw usage_error(-1, "Manager", "min_replicas must be at least 1");
  const auto ms = [](std::chrono::milliseconds d) { return std::to_string(d.count()) + " ms"; };
  if (o.step_timeout.count() <= 0 || o.quorum_timeout.count() <= 0 || o.heartbeat_interval.count() <= 0 ||
      o.settle.count() < 0) {
    throw usage_error(-1, "Manager", "step_timeout, quorum_timeout and heartbeat_interval must be positive");
  }
  if (o.heartbeat_timeout < 2 * o.heartbeat_interval) {
    throw usage_error(-1, "Manager",
                      "heartbeat_timeout (" + ms(o.heartbeat_timeout) +
                          ") must be at least twice heartbeat_interval (" + ms(o.heartbeat_interval) +
                          "): a live replica would be presumed dead between two heartbeats; raise heartbeat_timeout");
  }
  if (o.quorum_timeout <= o.heartbeat_timeout + o.settle) {
    throw usage_error(-1, "Manager",
                      "quorum_timeout (" + ms(o.quorum_timeout) + ") must exceed heartbeat_timeout + settle (" +
                          ms(o.heartbeat_timeout + o.settle) +
                          "): a quorum without a hung or dead member forms only after its heartbeat is that old; "
                          "raise quorum_timeout");
  }
  if (o.active_replicas < 0 || (o.active_replicas > 0 && o.active_replicas < o.min_replicas)) {
    throw usage_error(-1, "Manager",
                      "active_replicas (" + std::to_string(o.active_replicas) +
                          ") must be 0 (every member) or at least min_replicas (" + std::to_string(o.min_replicas) +
                          "): no step could commit");
  }
  if (!first_write_store) {
    throw usage_error(-1, "Manager",
                      "the store must write a key only if it has none (set_if_absent: ddp::first_write_store); the "
                      "commit decision and the quorum's membership rely on it");
  }
}

/// `quorum_info::connect_timeout` of a quorum formed with `o`: twice `heartbeat_timeout` (a member
/// silent that long is taken as dead), 5 s at least (a busy machine's set-up).
[[nodiscard]] inline std::chrono::milliseconds connect_timeout_of(const manager_options& o) {
  return std::max(2 * o.heartbeat_timeout, std::chrono::milliseconds(5000));
}
}  // namespace detail

/// Quorum could not be formed in time, or too many steps failed in a row.
class manager_error : public communication_error {
 public:
  using communication_error::communication_error;
};

/// A rank of this replica group failed or left (GroupManager): the group shares its fate, so every
/// rank of it stops, and the group restarts as one replica.
class replica_group_error : public communication_error {
 public:
  using communication_error::communication_error;
};

namespace detail {
/// How a replica group's leader tells the group's other ranks of a heal (GroupManager): `begins`
/// before the transfers, with the sources and the step; `ends` after, with whether this rank's
/// part passed, throwing `replica_group_error` unless every rank's did.
struct group_heal_hooks {
  std::function<void(const std::vector<int>& sources, std::int64_t step)> begins;
  std::function<void(bool ok)> ends;
};
}  // namespace detail

}  // namespace ddp
