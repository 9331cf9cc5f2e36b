#pragma once
// Shared by the fuzz targets: a check that aborts (libFuzzer reports it as a crash and saves the
// input), and views of the fuzzer's bytes.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string_view>

/// Aborts with the failed condition when `cond` is false (also in release builds).
#define FUZZ_CHECK(cond)                                                                   \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      std::fprintf(stderr, "FUZZ_CHECK failed: %s at %s:%d\n", #cond, __FILE__, __LINE__); \
      std::abort();                                                                        \
    }                                                                                      \
  } while (0)

namespace fuzz {

inline std::span<const std::byte> bytes(const std::uint8_t* data, std::size_t size) {
  return {reinterpret_cast<const std::byte*>(data), size};
}

inline std::string_view text(const std::uint8_t* data, std::size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

inline bool same_bytes(std::span<const std::byte> a, std::span<const std::byte> b) { return std::ranges::equal(a, b); }

}  // namespace fuzz
