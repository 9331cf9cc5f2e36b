#pragma once
/// @file strategies/buffer_strategy.hpp
/// @brief The `buffer_strategy` concept: what a type provides to synchronise a group of buffers
/// in a `BufferReducer`.
///
/// A strategy is a plain value type (knobs are public members, `strategies::broadcast{.root = 1}`):
/// - `work sync(const buffer_group&) const`: issues this group's collective(s) and returns the
///   work. Every rank calls it for the same groups in the same order; on a joined rank
///   (`group.joined`) it must issue the same collectives with neutral data.
/// - `std::string name() const`: a stable description ("broadcast(root=0)"). Ranks compare a hash
///   of it when the reducer is built, so equal strategies must have equal names on every rank.
/// - `==`: buffers with equal strategies (and the same dtype and device) share one collective.
/// Optional members (defaults in parentheses), which let the reducer skip work:
/// - `bool communicates() const` (true): false for local-only strategies; none of their groups is
///   packed or synchronised, and they count no collective.
/// - `bool reads_local_data(const buffer_group&) const` (true): false when this rank's values do
///   not matter to the collective (a broadcast receiver, a joined rank that fills neutral data),
///   so the copy path skips packing the trainer's buffers.
/// - `bool writes_local_data(const buffer_group&) const` (true): false when the collective leaves
///   this rank's values as they were (the broadcast root), so the copy path skips unpacking.

#include <concepts>
#include <string>

#include <ddp/strategies/buffer_group.hpp>
#include <ddp/work.hpp>

namespace ddp {

/// A type that synchronises a group of buffers; see the file comment for the full contract.
template <class S>
concept buffer_strategy = requires(const S& s, const buffer_group& g) {
  { s.sync(g) } -> std::same_as<work>;
  { s.name() } -> std::convertible_to<std::string>;
}
&&std::copy_constructible<S>&& std::equality_comparable<S>;

namespace detail {

/// `s.communicates()` if the strategy has it, else true.
template <buffer_strategy S>
[[nodiscard]] bool strategy_communicates(const S& s) {
  if constexpr (requires {
                  { s.communicates() } -> std::convertible_to<bool>;
                }) {
    return s.communicates();
  } else {
    return true;
  }
}

/// `s.reads_local_data(g)` if the strategy has it, else true.
template <buffer_strategy S>
[[nodiscard]] bool strategy_reads_local_data(const S& s, const buffer_group& g) {
  if constexpr (requires {
                  { s.reads_local_data(g) } -> std::convertible_to<bool>;
                }) {
    return s.reads_local_data(g);
  } else {
    return true;
  }
}

/// `s.writes_local_data(g)` if the strategy has it, else true.
template <buffer_strategy S>
[[nodiscard]] bool strategy_writes_local_data(const S& s, const buffer_group& g) {
  if constexpr (requires {
                  { s.writes_local_data(g) } -> std::convertible_to<bool>;
                }) {
    return s.writes_local_data(g);
  } else {
    return true;
  }
}

}  // namespace detail
}  // namespace ddp
