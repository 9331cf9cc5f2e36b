#pragma once
/// @file device.hpp
/// @brief Where a tensor's memory lives.

#include <compare>
#include <ostream>
#include <string>

namespace ddp {

/// Memory location of a tensor: host memory, or the memory of CUDA device `index`.
struct device {
  enum class kind : unsigned char { host, cuda };
  kind type = kind::host;
  int index = 0;  ///< CUDA device ordinal; 0 for host

  [[nodiscard]] static constexpr device host() noexcept { return {}; }
  [[nodiscard]] static constexpr device cuda(int ordinal) noexcept { return {kind::cuda, ordinal}; }
  [[nodiscard]] constexpr bool is_host() const noexcept { return type == kind::host; }
  [[nodiscard]] constexpr bool is_cuda() const noexcept { return type == kind::cuda; }

  friend constexpr auto operator<=>(const device&, const device&) = default;

  [[nodiscard]] std::string str() const { return is_host() ? "host" : "cuda:" + std::to_string(index); }
  friend std::ostream& operator<<(std::ostream& os, const device& d) { return os << d.str(); }
};

}  // namespace ddp
