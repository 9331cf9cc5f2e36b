#pragma once
/// @file bucketer/layout_check.hpp
/// @brief The Bucketer's cross-rank layout check (`bucketer_options::check_layout`): every rank
/// registered the same gradients and built the same buckets; and a rebuilding policy's agreed
/// ready order. Not for users.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ddp/communicator.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/tensor.hpp>

namespace ddp::detail {

/// What the check compares of one gradient: its element count, dtype and bucket.
struct layout_row {
  std::size_t count = 0;
  dtype type{};
  std::size_t bucket = 0;
};

/// The second exchange of `check_layout_across_ranks`: per gradient (count, dtype, bucket), padded
/// to `most` gradients with -1 (no such gradient). Names the first gradient that differs from
/// rank 0's. Collective.
[[nodiscard]] inline std::string first_layout_difference(communicator_ref comm, const std::vector<layout_row>& rows,
                                                         std::size_t most,
                                                         const std::function<std::string(std::size_t)>& label) {
  constexpr std::size_t words = 3;
  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<std::int64_t> mine(words * most, -1);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    mine[words * i] = static_cast<std::int64_t>(rows[i].count);
    mine[words * i + 1] = static_cast<std::int64_t>(rows[i].type);
    mine[words * i + 2] = static_cast<std::int64_t>(rows[i].bucket);
  }
  std::vector<std::int64_t> all(words * most * n);
  if (most > 0) comm.allgather(view(mine), view(all)).wait();
  const auto at = [&](std::size_t r, std::size_t i, std::size_t k) { return all[(r * most + i) * words + k]; };
  const auto describe = [&](std::size_t r, std::size_t i) {
    if (at(r, i, 0) < 0) return std::string("none (it registered fewer)");
    return std::string(name_of(static_cast<dtype>(at(r, i, 1)))) + " x " + std::to_string(at(r, i, 0));
  };
  for (std::size_t i = 0; i < most; ++i) {  // the gradients first: a different one moves the buckets too
    for (std::size_t r = 1; r < n; ++r) {
      if (at(r, i, 0) != at(0, i, 0) || at(r, i, 1) != at(0, i, 1)) {
        return label(i) + " is the first that differs: rank 0 has " + describe(0, i) + ", rank " + std::to_string(r) +
               " has " + describe(r, i);
      }
    }
  }
  for (std::size_t i = 0; i < most; ++i) {
    for (std::size_t r = 1; r < n; ++r) {
      if (at(r, i, 2) != at(0, i, 2)) {
        return "the gradients agree, but " + label(i) + " is in bucket " + std::to_string(at(0, i, 2)) +
               " on rank 0 and in bucket " + std::to_string(at(r, i, 2)) + " on rank " + std::to_string(r) +
               ": the layout policies (or their knobs) differ";
      }
    }
  }
  return "the gradients and their buckets agree, but the layouts differ (the order of gradients within a bucket?)";
}

/// One allgather of (gradient count, total elements, fingerprint) per rank. Only if the ranks
/// differ, a second one (`first_layout_difference`) names the first gradient that differs; every
/// rank sees the same data, so every rank throws the same message. Collective.
/// `label(i)` names gradient i in the message ("gradient 3 ('fc.bias')").
/// @throws usage_error if the ranks differ
inline void check_layout_across_ranks(communicator_ref comm, const std::vector<layout_row>& rows,
                                      std::uint64_t fingerprint, const std::function<std::string(std::size_t)>& label) {
  std::size_t elems = 0;
  for (const auto& r : rows) elems += r.count;
  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<std::int64_t> mine{static_cast<std::int64_t>(rows.size()), static_cast<std::int64_t>(elems),
                                 static_cast<std::int64_t>(fingerprint)};
  std::vector<std::int64_t> all(3 * n);
  comm.allgather(view(mine), view(all)).wait();
  bool same = true;
  std::size_t most = 0;  // gradients on the rank with the most
  for (std::size_t r = 0; r < n; ++r) {
    same = same && std::equal(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(3 * r));
    most = std::max(most, static_cast<std::size_t>(std::max<std::int64_t>(all[3 * r], 0)));
  }
  if (same) return;

  std::string totals;
  for (std::size_t r = 0; r < n; ++r) {
    totals += (r ? ", " : "") + std::string("rank ") + std::to_string(r) + ": " + std::to_string(all[3 * r]) +
              " gradients / " + std::to_string(all[3 * r + 1]) + " elements";
  }
  throw usage_error(
      comm.rank(), "Bucketer::build",
      "gradients or bucket layout differ across ranks: " + first_layout_difference(comm, rows, most, label) + " (" +
          totals + "). Every rank must register the same gradients, in the same order, with the same policy");
}

/// A rebuilding policy's agreed ready order: rank 0's observed order (its first `recorded`
/// entries of `observed`), completed with the registration order reversed for gradients rank 0
/// never saw, broadcast from rank 0 and checked to be a permutation of the `n` gradients.
/// Collective (one broadcast).
/// @throws mismatch_error if what rank 0 sent is not a permutation of this rank's gradients
[[nodiscard]] inline std::vector<std::size_t> agree_ready_order(communicator_ref comm,
                                                                const std::vector<std::size_t>& observed,
                                                                std::size_t recorded, std::size_t n) {
  std::vector<std::int64_t> order(n, -1);
  if (comm.rank() == 0) {
    std::vector<bool> seen(n, false);
    std::size_t k = 0;
    recorded = std::min(recorded, n);
    for (std::size_t p = 0; p < recorded; ++p) {
      order[k++] = static_cast<std::int64_t>(observed[p]);
      seen[observed[p]] = true;
    }
    for (std::size_t i = n; i-- > 0;) {
      if (!seen[i]) order[k++] = static_cast<std::int64_t>(i);
    }
  }
  comm.broadcast(order, 0).wait();
  std::vector<std::size_t> agreed(n);
  std::vector<bool> seen(n, false);
  for (std::size_t p = 0; p < n; ++p) {
    const auto v = order[p];
    if (v < 0 || static_cast<std::size_t>(v) >= n || seen[static_cast<std::size_t>(v)]) {
      throw mismatch_error(comm.rank(), "Bucketer rebuild",
                           "the ready order broadcast by rank 0 is not a permutation of this rank's " +
                               std::to_string(n) + " gradients");
    }
    seen[static_cast<std::size_t>(v)] = true;
    agreed[p] = static_cast<std::size_t>(v);
  }
  return agreed;
}

}  // namespace ddp::detail
