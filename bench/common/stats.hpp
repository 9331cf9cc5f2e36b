#pragma once
/// @file bench/common/stats.hpp
/// @brief Small statistics and timing helpers shared by the benchmark programs.

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <vector>

namespace bench {

/// Median of `samples` (mean of the middle two for an even count). Robust to the outliers a
/// shared machine produces, unlike the mean.
[[nodiscard]] inline double median(std::vector<double> samples) {
  if (samples.empty()) throw std::invalid_argument("bench::median of no samples");
  std::sort(samples.begin(), samples.end());
  const std::size_t n = samples.size();
  return n % 2 ? samples[n / 2] : 0.5 * (samples[n / 2 - 1] + samples[n / 2]);
}

/// Seconds since construction (steady clock).
class stopwatch {
 public:
  stopwatch() : start_(std::chrono::steady_clock::now()) {}
  void restart() { start_ = std::chrono::steady_clock::now(); }
  [[nodiscard]] double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

}  // namespace bench
