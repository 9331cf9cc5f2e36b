#pragma once
/// @file detail/xxh64.hpp
/// @brief (detail) `detail::xxh64`: xxHash's 64-bit hash, the one the Manager's state hash and the
/// checkpoint files use.

#include <cstddef>
#include <cstdint>
#include <span>

// xxHash (Debian: libxxhash-dev) header-only: every function inline, under XXH_INLINE_ALL's own
// namespace prefix, so no library is linked and a program that also links libxxhash sees no
// clash. The macro is not left defined for the includer.
#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#define DDP_XXH_INLINE_ALL_DEFINED_HERE
#endif
#include <xxhash.h>
#ifdef DDP_XXH_INLINE_ALL_DEFINED_HERE
#undef XXH_INLINE_ALL
#undef DDP_XXH_INLINE_ALL_DEFINED_HERE
#endif

namespace ddp::detail {

/// XXH64 (xxHash's 64-bit hash, from the xxHash library: <xxhash.h>, header-only) of `bytes`,
/// from `seed`. The state hash's function: FNV-1a (detail/fnv1a.hpp) is one dependent multiply
/// per byte, under 1 GB/s, slower than the transfer it checks; XXH64 takes 32 bytes a round in
/// four independent lanes (about 19 GB/s on the 2-core test machine, 1-3% faster than ddp's own
/// XXH64 it replaced, with the same values: docs/fault-tolerance.md).
[[nodiscard]] inline std::uint64_t xxh64(std::span<const std::byte> bytes, std::uint64_t seed = 0) noexcept {
  return XXH64(bytes.data(), bytes.size(), seed);
}

}  // namespace ddp::detail
