#pragma once
/// @file manager/quorum.hpp
/// @brief How a `Manager` (ddp/manager.hpp) forms a quorum in the store: the quorum rule (a
/// majority of the previous generation), heartbeats, join requests and their tickets, enrollment
/// in the next generation and the "current" record. Free functions over explicit inputs, so that
/// they can run without a Manager. Not for users; the rule and why it cannot split are in
/// docs/fault-tolerance.md, "The quorum rule".

#include <algorithm>
#include <charconv>
#include <chrono>
#include <climits>
#include <optional>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <ddp/manager/decision.hpp>
#include <ddp/manager/options.hpp>
#include <ddp/manager/record.hpp>
#include <ddp/store.hpp>
#include <ddp/stores/membership.hpp>
#include <ddp/stores/prefix_store.hpp>
#include <ddp/time_source.hpp>
#include <ddp/work.hpp>

namespace ddp::detail {

/// Whether the stored heartbeat `text` is one, and younger than `timeout` at `now_ms`.
[[nodiscard]] inline bool heartbeat_fresh(std::string_view text, std::int64_t now_ms,
                                          std::chrono::milliseconds timeout) noexcept {
  const auto t = decode_heartbeat(text);
  return t && now_ms - *t < timeout.count();
}

/// Whether replica `id` counts as alive for `opts.replica_id`: itself, or a fresh heartbeat under
/// "hb/<id>".
[[nodiscard]] inline bool replica_alive(store_ref store, const std::string& id, const manager_options& opts) {
  if (id == opts.replica_id) return true;
  const auto v = store.get("hb/" + id);
  if (!v) return false;
  return heartbeat_fresh(to_text(*v), wall_ms_of(opts.time), opts.heartbeat_timeout);
}

/// The "current" record (see encode_quorum_record), or an empty one (generation 0) if none.
/// @throws communication_error if it is malformed
[[nodiscard]] inline quorum_record read_quorum_record(store_ref store, int rank) {
  const auto v = store.get("current");
  if (!v) return {};
  return decode_quorum_record(to_text(*v), rank);
}

/// The latest generation whose membership closed, and its members (empty before a job's first).
struct installed_generation {
  std::uint64_t generation = 0;      ///< 0: none closed yet
  std::vector<std::string> members;  ///< its member list, in rank order
};

/// The latest generation whose membership closed. "current" is only a hint (its writer may lag or
/// be overtaken): the closed lists, one per generation, are the truth.
[[nodiscard]] inline installed_generation latest_installed(store_ref store, int rank) {
  const auto ids = [](const store_value& list) {
    std::vector<std::string> out;
    for (auto& a : stores::detail::decode_members(to_text(list))) out.push_back(std::move(a.id));
    return out;
  };
  const quorum_record hint = read_quorum_record(store, rank);
  installed_generation latest{hint.generation, hint.members};
  for (;;) {
    const auto next = store.get("g" + std::to_string(latest.generation + 1) + "/members/closed");
    if (!next) break;
    ++latest.generation;
    latest.members = ids(*next);
  }
  if (latest.generation > hint.generation || latest.members.empty()) return latest;
  // The hint's own list, if still there, is the authority on its members.
  if (const auto own = store.get("g" + std::to_string(latest.generation) + "/members/closed")) {
    latest.members = ids(*own);
  }
  return latest;
}

/// The quorum rule. A group may form generation g+1 only if it holds more than half of
/// generation g's members `base`, or exactly half including g's rank 0 (any two such sets of g's
/// members intersect). Each generation closes once (stores::enroll_any: one claim wins), and
/// generation g+1 is only ever formed on top of g, so the quorums form one chain in which each
/// holds a member that left its predecessor: no two quorums commit side by side.
[[nodiscard]] inline bool holds_majority(const std::vector<std::string>& base, const std::vector<std::string>& ids) {
  if (base.empty()) return true;  // a job's first quorum: generation 1 closes once, whoever is in it
  std::size_t in = 0;
  for (const auto& b : base) in += std::find(ids.begin(), ids.end(), b) != ids.end() ? 1 : 0;
  if (2 * in != base.size()) return 2 * in > base.size();
  return std::find(ids.begin(), ids.end(), base.front()) != ids.end();
}

/// A non-negative decimal number (a step, a ticket), or -1.
[[nodiscard]] inline std::int64_t parse_step(std::string_view text) noexcept {
  std::int64_t v = -1;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  return ec == std::errc() && end == text.data() + text.size() && v >= 0 ? v : -1;
}

/// Replica `id`'s latest join ticket (0 if it never asked, or the record is not a number).
[[nodiscard]] inline std::int64_t ticket_of(store_ref store, const std::string& id) {
  const auto v = store.get("join_ticket/" + id);
  return v ? std::max<std::int64_t>(0, parse_step(to_text(*v))) : 0;
}

/// The highest join ticket of `members` (0 if none asked): requests up to it include theirs.
[[nodiscard]] inline std::int64_t latest_ticket(store_ref store, const std::vector<std::string>& members) {
  std::int64_t latest = 0;
  for (const auto& id : members) latest = std::max(latest, ticket_of(store, id));
  return latest;
}

/// The group that may close generation g+1 on top of g's members `base` (empty at a job's
/// start): at least `min_replicas` members holding a majority of `base`. It closes at once when
/// everyone expected arrived (the `live` members of `base` and `pending` join requests); at a
/// job's start nobody knows how many will come, so it waits `settle` after the minimum arrived.
/// Attempts are bounded (at most `left`): a member that died a moment ago still counts as alive
/// until its heartbeat expires, and each attempt reads the live members again.
[[nodiscard]] inline stores::group_options quorum_group(const std::vector<std::string>& base,
                                                        std::vector<std::string> live, int pending,
                                                        const manager_options& opts, std::chrono::milliseconds left) {
  const int alive = static_cast<int>(live.size());
  stores::group_options g;
  g.min_members = opts.min_replicas;
  g.admissible = [base](const std::vector<std::string>& ids) { return holds_majority(base, ids); };
  g.max_members = base.empty() ? INT_MAX : std::max(g.min_members, std::min(alive + pending, INT_MAX / 2));
  g.settle = opts.settle;
  g.progress = opts.progress;
  g.expected = std::move(live);  // also named by the rendezvous' progress reports while missing
  g.timeout = std::max(std::chrono::milliseconds(1), std::min(left, opts.heartbeat_timeout + 4 * opts.settle));
  g.time = opts.time;
  return g;
}

/// Between failed attempts at a quorum (Manager::form_quorum), a pause that doubles from 10 ms to
/// 1 s (`pause` is the next one): replicas that cannot form a quorum that commits (two restarted
/// ones waiting for a holder of the state) must not churn generations. It sleeps in slices of
/// `heartbeat_interval`, calling `heartbeat` after each, so this replica does not look dead, and a
/// join request (a holder coming back) ends it at once.
inline void pause_before_retry(store_ref store, const manager_options& opts, std::chrono::milliseconds& pause,
                               clock::time_point deadline, const std::function<void()>& heartbeat) {
  const auto until = std::min(deadline, now_of(opts.time) + pause);
  pause = std::min(2 * pause, std::chrono::milliseconds(1000));
  const auto joins = [&store]() -> std::int64_t {
    try {
      return store.add("joins", 0);
    } catch (const ddp::error&) {  // the store hiccupped: no news
      return -1;
    }
  };
  const std::int64_t before = joins();
  while (now_of(opts.time) < until) {
    sleep_until_of(opts.time, std::min(until, now_of(opts.time) + opts.heartbeat_interval));
    heartbeat();
    const std::int64_t seen = joins();
    if (before >= 0 && seen >= 0 && seen != before) return;
  }
}

/// One replica's enrollment in the next generation.
struct enrollment {
  std::uint64_t generation = 0;     ///< the generation enrolled in: the latest closed one + 1
  std::vector<std::string> base;    ///< the latest closed generation's members (empty at a job's start)
  std::int64_t joins_answered = 0;  ///< the join counter before enrolling: requests up to it are answered
  stores::membership membership;    ///< the group that closed, as this replica sees it
};

/// Enrolls `opts.replica_id` in generation g+1, g being the latest generation that closed. A
/// replica that is not a member of g asks the running quorum to re-form with it first (once per
/// generation): it bumps the join counter "joins" and stores the ticket it got under
/// "join_ticket/<id>", which lets the quorum that admits it count the request as answered even when
/// it was made after its rank 0 read the counter.
/// @param rank             this replica's rank so far (names it in errors)
/// @param generation       in: the generation this replica belongs to (or last tried); out: g+1,
///                         set before enrolling (also when enrolling throws)
/// @param signalled_after  in/out: the generation this replica last asked to join
/// @throws ddp::error if the group does not close in time, or the store fails
[[nodiscard]] inline enrollment enroll_next_generation(store_ref store, const manager_options& opts,
                                                       clock::time_point deadline, int rank, std::uint64_t& generation,
                                                       std::uint64_t& signalled_after) {
  const quorum_record hint = read_quorum_record(store, rank);
  installed_generation latest = latest_installed(store, rank);
  const std::uint64_t base_gen = latest.generation;
  std::vector<std::string> base = std::move(latest.members);
  const bool member_of_latest =
      generation == base_gen && std::find(base.begin(), base.end(), opts.replica_id) != base.end();
  if (!member_of_latest && signalled_after != base_gen + 1) {
    const std::int64_t ticket = store.add("joins", 1);
    store.set("join_ticket/" + opts.replica_id, as_bytes(std::to_string(ticket)));
    signalled_after = base_gen + 1;
  }
  // Join requests made before this attempt are answered by it. One made later, by a replica
  // that found this generation closed without it, is after this read: it re-forms the quorum.
  const std::int64_t joins_answered = store.add("joins", 0);
  std::vector<std::string> live;
  for (const auto& id : base) {
    if (replica_alive(store, id, opts)) live.push_back(id);
  }
  int pending = hint.generation == base_gen ? pending_joins(joins_answered, hint.joins) : 1 << 20;
  // A member restarted under its id asked to join and has a fresh heartbeat: it is expected once,
  // not twice (else the group never closes on arrival and waits out `settle`).
  for (std::size_t i = 0; i < live.size() && pending > 0 && pending < (1 << 20); ++i) {
    const std::int64_t t = ticket_of(store, live[i]);
    if (t > hint.joins && t <= joins_answered) --pending;
  }
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now_of(opts.time));
  const stores::group_options g = quorum_group(base, std::move(live), pending, opts, left);
  const std::uint64_t target = base_gen + 1;
  generation = target;
  stores::prefix_store<store_ref> gen_store(store, "g" + std::to_string(target) + "/");
  stores::membership m = stores::enroll_any(gen_store, opts.replica_id, g);
  return {target, std::move(base), joins_answered, std::move(m)};
}

/// The latest generation at or below `from` that committed a step, or 0 if none did: one whose
/// forming every member completed (each wrote its "g<k>/formed/<rank>" record, holding the
/// generation's first step, before its first vote there; a commit needs every member's vote) and
/// whose first step committed (manager/decision.hpp). This reader settles that step: it proposes
/// "abort" itself, so a member that has not decided yet (cut off from the store) can no longer
/// commit it after this quorum went on without it. Its members, and those of later generations
/// (which started from its state and committed nothing), hold the latest committed state.
[[nodiscard]] inline std::int64_t latest_committing(store_ref store, std::uint64_t from) {
  for (std::uint64_t k = from; k > 0; --k) {
    const std::string g = "g" + std::to_string(k) + "/";
    const auto list = store.get(g + "members/closed");
    if (!list) continue;
    const std::size_t n = stores::detail::decode_members(to_text(*list)).size();
    bool complete = n > 0;
    std::optional<store_value> first_step;  // rank 0's formed record: the generation's first step
    for (std::size_t r = 0; r < n && complete; ++r) {
      auto formed = store.get(g + "formed/" + std::to_string(r));
      complete = formed.has_value();
      if (r == 0) first_step = std::move(formed);
    }
    if (!complete) continue;
    const std::int64_t s0 = first_step ? parse_step(to_text(*first_step)) : -1;
    if (s0 < 0 || propose_decision(store, k, s0, false) != commit_decision::abort) return static_cast<std::int64_t>(k);
  }
  return 0;
}

/// Records that rank `rank` completed the forming of generation `g`, whose first step is `step`
/// (see latest_committing).
inline void record_formed(store_ref store, std::uint64_t g, int rank, std::int64_t step) {
  store.set("g" + std::to_string(g) + "/formed/" + std::to_string(rank), as_bytes(std::to_string(step)));
}

/// After `e` closed: the join requests its quorum answers, and, by its rank 0, the "current"
/// record (unless a later quorum's rank 0 wrote one already). Rank 0 polls the join counter from
/// now on, so it answers every member's own request too (up to their highest ticket).
[[nodiscard]] inline std::int64_t publish_quorum(store_ref store, const enrollment& e) {
  const stores::membership& m = e.membership;
  const std::int64_t answered =
      m.rank == 0 ? std::max(e.joins_answered, latest_ticket(store, m.members)) : e.joins_answered;
  if (m.rank == 0 && read_quorum_record(store, m.rank).generation < e.generation) {
    const quorum_record rec{e.generation, answered, m.members};
    store.set("current", as_bytes(encode_quorum_record(rec)));
  }
  return answered;
}

}  // namespace ddp::detail
