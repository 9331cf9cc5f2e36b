#pragma once
/// @file detail/store_token.hpp
/// @brief A fixed-size token of bytes made by rank 0 and handed to every other rank through a
/// rendezvous store: how an NCCL unique id reaches the ranks of a quorum without another
/// communicator (`ddp::nccl::share_unique_id(store_ref, ...)`). Backend-free, so it is tested
/// over threads.

#include <chrono>
#include <cstddef>
#include <exception>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ddp/error.hpp>
#include <ddp/store.hpp>

namespace ddp::detail {

/// Rank 0 calls `generate()` (returning a contiguous range of `std::byte`, e.g. a
/// `std::vector<std::byte>`), checks that it is `size` bytes and publishes it under `key`; every
/// other rank waits up to `timeout` for the key and reads it back. Returns the token on every
/// rank. `key` must be fresh for each group (give each group its own store namespace, as the
/// Manager's `quorum_info::store` is): a value left by an earlier group would be read as this
/// one's.
///
/// If `generate` throws on rank 0, rank 0 publishes an empty value (so the others fail at once
/// instead of waiting for the timeout) and rethrows.
/// @param operation  named in errors, e.g. "nccl::share_unique_id"
/// @throws usage_error on rank 0 if the generated token is not `size` bytes, or `rank` < 0
/// @throws timeout_error if rank 0 did not publish `key` within `timeout` (names rank and key)
/// @throws communication_error if the stored value is not `size` bytes (names rank, key, sizes),
///   or rank 0 could not generate the token
template <class Generate>
[[nodiscard]] std::vector<std::byte> share_store_token(store_ref store, int rank, std::string_view key,
                                                       std::size_t size, Generate&& generate,
                                                       std::chrono::milliseconds timeout, const char* operation) {
  const std::string k(key);
  if (rank < 0) throw usage_error(rank, operation, "rank " + std::to_string(rank) + " is negative");
  if (rank == 0) {
    std::vector<std::byte> token;
    try {
      const auto made = std::forward<Generate>(generate)();
      const std::span<const std::byte> bytes(made);
      token.assign(bytes.begin(), bytes.end());
    } catch (...) {
      try {
        store.set(k, std::span<const std::byte>());  // tell the others: no token is coming
      } catch (...) {                                // the original error matters more
      }
      throw;
    }
    if (token.size() != size) {
      throw usage_error(rank, operation,
                        "the generated token for '" + k + "' has " + std::to_string(token.size()) +
                            " bytes, expected " + std::to_string(size));
    }
    store.set(k, token);
    return token;
  }
  store_value value;
  try {
    value = wait_get(store, k, timeout);
  } catch (const timeout_error&) {
    throw timeout_error(rank, operation,
                        "rank 0 did not publish '" + k + "' in the store within " + std::to_string(timeout.count()) +
                            " ms (is rank 0 alive, and using the same store namespace?)");
  }
  if (value.empty()) {
    throw communication_error(rank, operation, "rank 0 could not generate '" + k + "' (see its error)");
  }
  if (value.size() != size) {
    throw communication_error(rank, operation,
                              "the value of '" + k + "' in the store has " + std::to_string(value.size()) +
                                  " bytes, expected " + std::to_string(size) +
                                  " (another writer, or a different library version on rank 0?)");
  }
  return value;
}

}  // namespace ddp::detail
