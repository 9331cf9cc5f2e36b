#pragma once
/// @file device.hpp
/// @brief Where a tensor's memory lives.

#include <compare>
#include <ostream>
#include <string>

namespace ddp {

/// Memory location of a tensor: host memory, or the memory of CUDA device `index`.
struct device {
  /// Kind of memory.
  enum class kind : unsigned char { host, cuda };
  kind type = kind::host;  ///< host or CUDA memory
  int index = 0;           ///< CUDA device ordinal; 0 for host

  /// Host memory.
  [[nodiscard]] static constexpr device host() noexcept { return {}; }
  /// Memory of CUDA device `ordinal`.
  [[nodiscard]] static constexpr device cuda(int ordinal) noexcept { return {kind::cuda, ordinal}; }
  /// True for host memory.
  [[nodiscard]] constexpr bool is_host() const noexcept { return type == kind::host; }
  /// True for CUDA device memory.
  [[nodiscard]] constexpr bool is_cuda() const noexcept { return type == kind::cuda; }

  /// Memberwise: equal when kind and ordinal are equal; ordered by kind, then ordinal.
  friend constexpr auto operator<=>(const device&, const device&) = default;
  /// Memberwise (implied by `<=>`; declared because nvcc 13 does not define the implied one).
  friend constexpr bool operator==(const device&, const device&) = default;

  /// "host" or "cuda:<index>".
  [[nodiscard]] std::string str() const { return is_host() ? "host" : "cuda:" + std::to_string(index); }
  /// Writes `str()`.
  friend std::ostream& operator<<(std::ostream& os, const device& d) { return os << d.str(); }
};

}  // namespace ddp
