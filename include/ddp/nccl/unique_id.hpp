#pragma once
/// @file unique_id.hpp
/// @brief The 128-byte token that names one NCCL clique, and its distribution over any ddp
/// communicator (MPI, gloo, local...) or through a rendezvous store, so creating an NCCL
/// communicator needs no MPI code.

#include <nccl.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/communicator.hpp>
#include <ddp/detail/store_token.hpp>
#include <ddp/error.hpp>
#include <ddp/nccl/error.hpp>
#include <ddp/reduce_op.hpp>
#include <ddp/store.hpp>
#include <ddp/work.hpp>

namespace ddp::nccl {

/// Opaque NCCL clique token. One rank generates it; every rank of the clique must pass the same
/// bytes to `communicator::create`.
struct unique_id {
  ncclUniqueId native{};  ///< the NCCL token (all zeros until generated or received)

  /// A fresh id (`ncclGetUniqueId`). Works without a GPU: it only opens the bootstrap socket.
  /// @param rank  for error messages
  /// @throws communication_error
  [[nodiscard]] static unique_id generate(int rank = 0) {
    unique_id id;
    check_nccl(ncclGetUniqueId(&id.native), rank, "nccl::unique_id::generate", "ncclGetUniqueId");
    return id;
  }

  /// The token's bytes, e.g. to publish it in a store.
  [[nodiscard]] std::span<const std::byte, NCCL_UNIQUE_ID_BYTES> bytes() const noexcept {
    return std::span<const std::byte, NCCL_UNIQUE_ID_BYTES>(reinterpret_cast<const std::byte*>(native.internal),
                                                            NCCL_UNIQUE_ID_BYTES);
  }

  /// Same bytes.
  friend bool operator==(const unique_id& a, const unique_id& b) noexcept {
    return std::memcmp(a.native.internal, b.native.internal, NCCL_UNIQUE_ID_BYTES) == 0;
  }
};

/// Generates a unique id on `root` and broadcasts its bytes (as u8, host memory) to every rank of
/// `over`. Collective over `over`: call on all of its ranks. If `root` cannot generate the id it
/// still takes part in the broadcast (sending a failure flag), so the other ranks fail with an
/// error instead of waiting for a broadcast that never comes.
/// @throws usage_error if `root` is not a rank of `over`
/// @throws communication_error if generation or the broadcast fails (on every rank)
[[nodiscard]] inline unique_id share_unique_id(communicator_ref over, int root = 0) {
  const char* const operation = "nccl::share_unique_id";
  if (root < 0 || root >= over.size()) {
    throw usage_error(
        over.rank(), operation,
        "root " + std::to_string(root) + " is not a rank of a communicator of size " + std::to_string(over.size()));
  }
  // Byte 0 says whether the root succeeded; the id follows.
  std::array<std::uint8_t, 1 + NCCL_UNIQUE_ID_BYTES> message{};
  std::exception_ptr root_failure;
  if (over.rank() == root) {
    try {
      const unique_id id = unique_id::generate(root);
      message[0] = 1;
      std::memcpy(message.data() + 1, id.native.internal, NCCL_UNIQUE_ID_BYTES);
    } catch (...) {
      root_failure = std::current_exception();
    }
  }
  over.broadcast(message, root).wait();
  if (root_failure) std::rethrow_exception(root_failure);
  if (message[0] != 1) {
    throw communication_error(
        over.rank(), operation,
        "rank " + std::to_string(root) + " could not generate the NCCL unique id (see its error)");
  }
  unique_id id;
  std::memcpy(id.native.internal, message.data() + 1, NCCL_UNIQUE_ID_BYTES);
  return id;
}

/// Rank 0 generates a unique id and publishes it under `key` in `store`; every other rank waits
/// up to `timeout` for it (detail/store_token.hpp). No communicator is needed: this is how the
/// Manager's NCCL factory (nccl/manager_factory.hpp) bootstraps each quorum through
/// `quorum_info::store`, a namespace of its own for every generation. `key` must not hold an id
/// of an earlier clique: use a fresh namespace (or key) per clique.
/// @param store    where the id is published (a fresh namespace per clique)
/// @param rank     this rank in the clique to be created (0 generates)
/// @param key      the key of the id in `store`
/// @param timeout  how long ranks other than 0 wait for the id
/// @throws timeout_error if rank 0 did not publish the id within `timeout` (names rank and key)
/// @throws communication_error if the stored value is not an id (wrong size), or rank 0 could not
///   generate one
[[nodiscard]] inline unique_id share_unique_id(store_ref store, int rank, std::string_view key = "nccl_unique_id",
                                               std::chrono::milliseconds timeout = default_timeout) {
  const std::vector<std::byte> bytes = ddp::detail::share_store_token(
      store, rank, key, NCCL_UNIQUE_ID_BYTES,
      [rank] {
        const unique_id id = unique_id::generate(rank);
        return std::vector<std::byte>(id.bytes().begin(), id.bytes().end());
      },
      timeout, "nccl::share_unique_id");
  unique_id id;
  std::memcpy(id.native.internal, bytes.data(), NCCL_UNIQUE_ID_BYTES);
  return id;
}

}  // namespace ddp::nccl
