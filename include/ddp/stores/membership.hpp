#pragma once
/// @file stores/membership.hpp
/// @brief `enroll`: processes that meet in a store agree on who is in the next group and on
/// everyone's rank in it. Used by survivors of a failure to find each other before building
/// the next generation's communicator; any backend can use it.
///
/// Words: a process *enrolls* in a group (membership); "join" in ddp means only uneven inputs
/// (`JoinContext`, join.hpp). (`join_group`, the former name, is gone: docs/migration.md.)
///
/// Protocol, in the (generation's) namespace it is given:
/// 1. Each process takes an arrival number from the counter `members/arrivals` and publishes
///    its id under `members/<arrival>`.
/// 2. The first arrival closes the group: as soon as `max_members` arrived, or once
///    `min_members` arrived and `settle` passed without reaching `max_members`. It writes the
///    admitted arrivals to `members/closed` in one atomic set. There is exactly one writer, so
///    every process reads the same list: no two views of the group can exist.
/// 3. Everyone reads `members/closed`. Ranks follow the order of ids (then of arrival). An
///    arrival that is not in the list (came after the group closed) gets `communication_error`
///    and should try the next generation.
/// If the first arrival dies before closing the group, the others time out: move on to the
/// next generation. Arrivals that die after closing are found by the communicator built next.

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ddp/error.hpp>
#include <ddp/progress.hpp>
#include <ddp/store.hpp>
#include <ddp/stores/backoff.hpp>
#include <ddp/stores/codec.hpp>

namespace ddp::stores {

/// How a group forms.
struct group_options {
  int min_members = 1;        ///< the group does not form with fewer
  int max_members = INT_MAX;  ///< the group forms at once when this many arrived
  /// After `min_members` arrived, how long the first arrival waits for more before closing.
  std::chrono::milliseconds settle{200};
  std::chrono::milliseconds timeout{30000};  ///< overall deadline for forming the group
  /// Ids the group is expected to hold, if known: progress reports name those not arrived yet.
  std::vector<std::string> expected{};
  /// Reports the first arrival's wait (reported as rank 0: members present, who is missing).
  /// Default: lines on stderr for waits over 2 s (progress.hpp).
  progress_sink progress = print_progress();
  /// `enroll_any` only: whether the ids present (in arrival order) may form the group, e.g. "they
  /// hold a majority of the previous group". Null: any `min_members` may.
  std::function<bool(const std::vector<std::string>&)> admissible{};
  /// `enroll_any` only: the clock its deadline, settle time and polling follow (null: the
  /// machine's; see time_source.hpp).
  time_source* time = nullptr;
};

/// The agreed group, as one member sees it.
struct membership {
  int rank = -1;                     ///< this member's rank: its index in `members`
  std::vector<std::string> members;  ///< ids, in rank order
  /// Number of members.
  [[nodiscard]] int size() const noexcept { return static_cast<int>(members.size()); }
};

namespace detail {
/// One arrival in the member list: its arrival number and id.
struct arrival {
  std::int64_t index;  ///< arrival number (from the counter `members/arrivals`)
  std::string id;      ///< the id it published
  /// Same index and id.
  friend bool operator==(const arrival&, const arrival&) = default;
};

/// The member list as stored under `members/closed`: one "<index> <id>\n" line per arrival.
[[nodiscard]] inline std::string encode_members(const std::vector<arrival>& list) {
  std::string s;
  for (const auto& a : list) s += std::to_string(a.index) + " " + a.id + "\n";
  return s;
}

/// Parses a stored member list. Only what encode_members writes for valid ids and distinct
/// non-negative indices decodes. @throws communication_error for anything else
[[nodiscard]] inline std::vector<arrival> decode_members(std::string_view text) {
  const auto fail = [](const std::string& what) {
    return communication_error(-1, "enroll", "malformed member list in the store: " + what);
  };
  std::vector<arrival> out;
  std::size_t pos = 0;
  while (pos < text.size()) {
    const auto nl = text.find('\n', pos);
    if (nl == std::string_view::npos) throw fail("unterminated line");
    const auto line = text.substr(pos, nl - pos);
    const auto sp = line.find(' ');
    if (sp == std::string_view::npos) throw fail("line without a space");
    const auto index = parse_decimal<std::int64_t>(line.substr(0, sp));
    if (!index || *index < 0) throw fail("arrival number is not a non-negative decimal integer");
    const auto id = line.substr(sp + 1);
    if (!is_valid_key(id)) throw fail("member id is not a valid key");
    out.push_back({*index, std::string(id)});
    pos = nl + 1;
  }
  std::vector<std::int64_t> indices;
  indices.reserve(out.size());
  for (const auto& a : out) indices.push_back(a.index);
  std::sort(indices.begin(), indices.end());
  const auto twice = std::adjacent_find(indices.begin(), indices.end());
  if (twice != indices.end()) throw fail("arrival " + std::to_string(*twice) + " listed twice");
  return out;
}
// Progress of the first arrival: how many arrived and, if the expected ids are known, who not.
// Reading the ids is one store read per arrival: it stops at `deadline` (then the report names
// nobody), so a slow store or a crowd of arrivals never holds the group past its deadline.
template <store S>
void report_arrivals(S& s, progress_meter& meter, std::int64_t arrived, const group_options& opts,
                     std::chrono::steady_clock::time_point deadline) {
  std::vector<std::string> missing;
  if (!opts.expected.empty()) {
    std::vector<std::string> present;
    bool complete = true;
    for (std::int64_t i = 0; i < arrived; ++i) {
      if (std::chrono::steady_clock::now() >= deadline) {
        complete = false;
        break;
      }
      if (auto v = s.get("members/" + std::to_string(i))) present.push_back(to_text(*v));
    }
    for (const auto& id : opts.expected) {
      if (complete && std::find(present.begin(), present.end(), id) == present.end()) missing.push_back(id);
    }
  }
  const int expected = opts.expected.empty() ? opts.min_members : static_cast<int>(opts.expected.size());
  meter.members(static_cast<int>(arrived), expected, std::move(missing));
}

// This process's place in the closed list `text`, where it is arrival `me` with id `id`.
// @throws communication_error if the list names that arrival by another id (not this group's
//         list), or does not name it (the group closed without it)
[[nodiscard]] inline membership membership_in(const std::string& text, std::int64_t me, std::string_view id) {
  membership m;
  for (const auto& a : decode_members(text)) {
    if (a.index == me) {
      if (a.id != id) {
        throw communication_error(-1, "enroll",
                                  "the member list in the store names arrival " + std::to_string(me) + " '" + a.id +
                                      "', but this process is '" + std::string(id) + "'");
      }
      m.rank = static_cast<int>(m.members.size());
    }
    m.members.push_back(a.id);
  }
  if (m.rank < 0) {
    throw communication_error(-1, "enroll",
                              "arrived after the group closed with " + std::to_string(m.members.size()) +
                                  " members; enroll in the next generation");
  }
  return m;
}
// Checks the call, takes this process's arrival number from `members/arrivals` and publishes `id`
// under `members/<arrival>`. Returns the arrival number.
template <store S>
[[nodiscard]] std::int64_t arrive(S& s, std::string_view id, const group_options& opts) {
  check_key(id, "enroll");
  if (opts.min_members < 1 || opts.max_members < opts.min_members) {
    throw usage_error(-1, "enroll",
                      "need 1 <= min_members <= max_members, got " + std::to_string(opts.min_members) + " and " +
                          std::to_string(opts.max_members));
  }
  const std::int64_t counted = s.add("members/arrivals", 1);
  if (counted < 1) {  // we just added 1: only a counter someone else wrote garbage to gets here
    throw communication_error(-1, "enroll",
                              "malformed arrival counter 'members/arrivals' in the store (" + std::to_string(counted) +
                                  " after counting this arrival)");
  }
  const std::int64_t me = counted - 1;
  s.set("members/" + std::to_string(me), as_bytes(id));
  return me;
}

// The id that arrival `i` published (`text`), checked: another process wrote it, and it must be an
// id or the member list would not parse.
[[nodiscard]] inline std::string arrived_id(std::string text, std::int64_t i) {
  if (!is_valid_key(text)) {
    throw communication_error(-1, "enroll", "malformed id under 'members/" + std::to_string(i) + "' in the store");
  }
  return text;
}
}  // namespace detail

/// Enrolls this process in the group forming in `s` (give it a fresh generation's namespace; see
/// prefix_store.hpp).
/// @param s     the namespace the group forms in, shared by every process enrolling in it
/// @param id    this process's name in the group (key characters; need not be unique)
/// @param opts  how many members to wait for, and how long
/// @throws timeout_error if the group did not form in time; communication_error if it formed
///         without this process
template <store S>
[[nodiscard]] membership enroll(S& s, std::string_view id, const group_options& opts = {}) {
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + opts.timeout;
  const auto left = [&] {
    return std::max(std::chrono::milliseconds(0),
                    std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()));
  };
  const std::int64_t me = detail::arrive(s, id, opts);

  if (me == 0) {  // the first arrival closes the group
    progress_meter meter(&opts.progress, "rendezvous", 0, 0, {}, std::chrono::milliseconds(500));
    std::int64_t arrived = 1;
    std::chrono::steady_clock::time_point enough_since{};
    bool enough = false;
    stores::detail::backoff pause(std::chrono::milliseconds(5));
    for (;;) {
      arrived = s.add("members/arrivals", 0);
      if (arrived >= opts.max_members) break;
      if (meter.due()) detail::report_arrivals(s, meter, arrived, opts, deadline);
      const auto now = std::chrono::steady_clock::now();
      if (arrived >= opts.min_members) {
        if (!enough) {
          enough = true;
          enough_since = now;
        }
        if (now - enough_since >= opts.settle) break;
      }
      if (now >= deadline) {
        if (enough) break;
        throw timeout_error(-1, "enroll",
                            "only " + std::to_string(arrived) + " of at least " + std::to_string(opts.min_members) +
                                " members arrived within " + std::to_string(opts.timeout.count()) + " ms");
      }
      pause.sleep_until_next(deadline);
    }
    const std::int64_t n = std::min<std::int64_t>(arrived, opts.max_members);
    std::vector<detail::arrival> list;
    for (std::int64_t i = 0; i < n; ++i) {
      // Arrival i counted itself before publishing its id: give it the time that is left.
      list.push_back({i, detail::arrived_id(to_text(wait_get(s, "members/" + std::to_string(i), left())), i)});
    }
    std::stable_sort(list.begin(), list.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
    s.set("members/closed", as_bytes(detail::encode_members(list)));
    meter.members(static_cast<int>(n), static_cast<int>(opts.expected.empty() ? n : opts.expected.size()));
    meter.finish();
  }

  return detail::membership_in(to_text(wait_get(s, "members/closed", left())), me, id);
}

/// Like `enroll`, but any arrival may close the group, so a group whose first arrival left or
/// died still forms; the Manager forms its quorums with it. Ids must name processes uniquely:
/// an id that arrives again replaces its earlier arrival.
///
/// Protocol, in the namespace it is given:
/// 1. Each process takes an arrival number from `members/arrivals` and publishes its id under
///    `members/<arrival>`.
/// `max_members` here only closes at once: every id present then is admitted.
/// 2. Every arrival polls the ids present (published, not marked `members/gone/<arrival>`). Once
///    they number `max_members`, or `min_members` and `settle` passed, and `opts.admissible`
///    accepts them, it closes the group: with a `first_write_store`, by
///    `set_if_absent("members/closed", list)` (the first list written is the list); otherwise
///    it claims the close, `add("members/claim", 1) == 1`, and the one winner writes the list.
///    Every process reads that one list, so one membership per namespace exists, ever.
/// 3. An arrival that times out marks itself gone (a closer that has not read the mark yet may
///    still list it: then it is a member after all, if the list appeared meanwhile).
/// Without `set_if_absent`, a process that dies between winning the claim and writing the list
/// (one store write) leaves the namespace unclosed: its group never forms (fault-tolerance.md).
/// @throws timeout_error if no group including this process formed in time; communication_error
///         if it formed without this process
template <store S>
[[nodiscard]] membership enroll_any(S& s, std::string_view id, const group_options& opts = {}) {
  const auto now_time = [&opts] { return ddp::detail::now_of(opts.time); };
  const auto deadline = now_time() + opts.timeout;
  const std::int64_t me = detail::arrive(s, id, opts);
  const auto result = [&](const store_value& v) { return detail::membership_in(to_text(v), me, id); };
  progress_meter meter(&opts.progress, "rendezvous", 0, 0, {}, std::chrono::milliseconds(500));
  stores::detail::backoff pause(std::chrono::milliseconds(5));
  bool enough = false;
  std::chrono::steady_clock::time_point enough_since{};
  bool claimed_by_other = false;
  for (;;) {
    if (auto v = s.get("members/closed")) return result(*v);
    const auto now = now_time();
    if (now >= deadline) {
      s.set("members/gone/" + std::to_string(me), as_bytes(std::string_view("1")));
      if (auto v = s.get("members/closed")) return result(*v);  // listed before the mark was read
      throw timeout_error(-1, "enroll",
                          "no group formed within " + std::to_string(opts.timeout.count()) + " ms (at least " +
                              std::to_string(opts.min_members) + " members" +
                              (opts.admissible ? " that the caller admits" : "") + ")");
    }
    if (!claimed_by_other) {
      const std::int64_t arrived = s.add("members/arrivals", 0);
      std::vector<detail::arrival> present;
      bool scanned = true;  // every arrival read before the deadline: a partial view never closes
      for (std::int64_t i = 0; i < arrived; ++i) {
        if (now_time() >= deadline) {
          scanned = false;
          break;
        }
        const auto v = s.get("members/" + std::to_string(i));
        if (!v || s.get("members/gone/" + std::to_string(i))) continue;  // not published yet, or left
        detail::arrival a{i, detail::arrived_id(to_text(*v), i)};
        // An id that arrived again (its process timed out and enrolled anew, or restarted) keeps
        // only its latest arrival: listing the old one too would give one process two ranks.
        const auto same = std::find_if(present.begin(), present.end(), [&](const auto& p) { return p.id == a.id; });
        if (same != present.end()) {
          *same = std::move(a);
        } else {
          present.push_back(std::move(a));
        }
      }
      if (!scanned) continue;  // the top of the loop times out
      std::vector<std::string> ids;
      for (const auto& a : present) ids.push_back(a.id);
      const int n = static_cast<int>(present.size());
      const bool ok = n >= opts.min_members && (!opts.admissible || opts.admissible(ids));
      if (!ok) enough = false;
      if (ok && !enough) {
        enough = true;
        enough_since = now;
      }
      if (me == 0 && meter.due()) {
        meter.members(n, opts.expected.empty() ? opts.min_members : static_cast<int>(opts.expected.size()));
      }
      if (ok && (n >= opts.max_members || now - enough_since >= opts.settle)) {
        std::stable_sort(present.begin(), present.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
        if constexpr (requires { s.set_if_absent(std::string_view(), std::span<const std::byte>()); }) {
          if (ddp::detail::has_set_if_absent(s)) {  // the first list written is the list: one operation
            const store_value closed = s.set_if_absent("members/closed", as_bytes(detail::encode_members(present)));
            meter.finish();
            return result(closed);
          }
        }
        if (s.add("members/claim", 1) == 1) {  // the one closer of this namespace
          s.set("members/closed", as_bytes(detail::encode_members(present)));
          meter.finish();
          continue;
        }
        claimed_by_other = true;  // its list appears in a moment
      }
    }
    pause.sleep_until_next(deadline, opts.time);
  }
}

}  // namespace ddp::stores
