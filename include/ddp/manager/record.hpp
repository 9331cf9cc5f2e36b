#pragma once
/// @file manager/record.hpp
/// @brief What a `Manager` (ddp/manager.hpp) reads back from the store, decoded: the quorum record
/// under "current" and the heartbeats under "hb/<id>". On their own so that they can be tested and
/// fuzzed alone (tests/fuzz/manager_records_fuzz.cpp). Not for users.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/error.hpp>
#include <ddp/stores/codec.hpp>

namespace ddp::detail {

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

}  // namespace ddp::detail
