#pragma once
/// @file buffer_reducer/options.hpp
/// @brief `buffer_reducer_options`: the knobs of a `BufferReducer` (ddp/buffer_reducer.hpp).

#include <cstdint>
#include <ostream>

namespace ddp {

/// Knobs of a `BufferReducer`.
struct buffer_reducer_options {
  /// `sync()` communicates on its calls number 0, period, 2 * period, ... and returns at once on
  /// the others (PyTorch issue #30718). 1: every call. Must be the same on every rank.
  std::uint64_t period = 1;

  /// Memberwise.
  friend bool operator==(const buffer_reducer_options&, const buffer_reducer_options&) = default;
  /// "{period=N}".
  friend std::ostream& operator<<(std::ostream& os, const buffer_reducer_options& o) {
    return os << "{period=" << o.period << "}";
  }
};

}  // namespace ddp
