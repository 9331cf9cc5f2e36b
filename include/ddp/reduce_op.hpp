#pragma once
/// @file reduce_op.hpp
/// @brief Reduction operators of the collectives.

#include <cstdint>
#include <ostream>
#include <string_view>

namespace ddp {

/// `avg` is the sum divided by the communicator size. For integer dtypes the division truncates
/// toward zero (C++ integer division), so every rank gets the same bits.
enum class reduce_op : std::uint8_t { sum, avg, min, max, prod };

/// Lower-case name of `op` ("sum", "avg", ...), as used in error messages; "?" if out of range.
[[nodiscard]] constexpr std::string_view name_of(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return "sum";
    case reduce_op::avg: return "avg";
    case reduce_op::min: return "min";
    case reduce_op::max: return "max";
    case reduce_op::prod: return "prod";
  }
  return "?";
}

/// Writes `name_of(op)`.
inline std::ostream& operator<<(std::ostream& os, reduce_op op) { return os << name_of(op); }

}  // namespace ddp
