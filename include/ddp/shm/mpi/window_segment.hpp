#pragma once
/// @file shm/mpi/window_segment.hpp
/// @brief `window_segment`: a node's segment as an MPI-3 shared window (MPI_Win_allocate_shared
/// over a node communicator). Link `ddp::mpi`.
///
/// Freeing a window (MPI_Win_free) is collective over the node — Open MPI's implementation
/// synchronises the node's ranks — so the destructor never frees it: call `close()` on every rank
/// of the node (`shm::communicator::close()` does), or the window stays mapped until the process
/// ends. A destructor that waited for peers could hang a rank whose peers died.

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include <ddp/mpi/error.hpp>
#include <ddp/shm/segment.hpp>

namespace ddp::shm::mpi {

/// A node's segment in an MPI-3 shared window: allocated by node rank 0, mapped by every rank of
/// the node, freed only by `close()` (see the file comment).
class window_segment final : public segment {
 public:
  /// Allocates `bytes` on node rank 0 of `node_comm`, contiguous, and maps it on every rank.
  /// Collective over `node_comm` (whose error handler must return errors). Node rank 0 zero-fills
  /// the first `zero_bytes` (MPI does not promise zeroed memory) and calls `prepare(data)` before
  /// the ranks synchronise; every rank takes every collective step even if its own checks fail.
  /// @throws segment_error naming MPI's error text; usage_error if node rank 0 allocated less
  template <class Prepare>
  [[nodiscard]] static std::unique_ptr<window_segment> allocate(MPI_Comm node_comm, std::size_t bytes,
                                                                std::size_t zero_bytes, int rank, Prepare&& prepare) {
    int node_rank = 0;
    check(MPI_Comm_rank(node_comm, &node_rank), rank, "MPI_Comm_rank");
    // Open MPI places the memory after its own header, not on a page: allocate a page more and
    // start at the first page boundary node rank 0 sees (every rank uses its offset).
    void* mine = nullptr;
    MPI_Win win = MPI_WIN_NULL;
    const MPI_Aint size = node_rank == 0 ? static_cast<MPI_Aint>(bytes + page) : 0;
    check(MPI_Win_allocate_shared(size, 1, MPI_INFO_NULL, node_comm, &mine, &win), rank, "MPI_Win_allocate_shared");
    std::unique_ptr<window_segment> seg(new window_segment(win));
    MPI_Aint got = 0;
    int unit = 0;
    void* base = nullptr;
    check(MPI_Win_shared_query(win, 0, &got, &unit, &base), rank, "MPI_Win_shared_query");
    auto at = static_cast<std::uint64_t>(-reinterpret_cast<std::uintptr_t>(base) % page);
    check(MPI_Bcast(&at, 1, MPI_UINT64_T, 0, node_comm), rank, "MPI_Bcast");
    const bool enough = static_cast<std::size_t>(got) >= bytes + at;
    const bool aligned = (reinterpret_cast<std::uintptr_t>(base) + at) % 64 == 0;
    if (enough && aligned) {
      seg->assign(static_cast<std::byte*>(base) + at, bytes);
      if (node_rank == 0) {
        std::memset(seg->data(), 0, zero_bytes);
        prepare(seg->data());
      }
    }
    check(MPI_Barrier(node_comm), rank, "MPI_Barrier");
    if (!enough) {
      throw usage_error(rank, "shm::communicator set-up",
                        "node rank 0 allocated a window of " + std::to_string(got) +
                            " bytes; this rank's options need " + std::to_string(bytes + at) +
                            " (ranks of one node passed different shm::options)");
    }
    if (!aligned) {
      throw segment_error(rank, "shm::communicator set-up",
                          "MPI_Win_allocate_shared returned memory " +
                              std::to_string(reinterpret_cast<std::uintptr_t>(base) % page) +
                              " bytes into a page; ddp needs it on the same 64-byte boundary on every rank");
    }
    return seg;
  }

  window_segment(const window_segment&) = delete;
  window_segment& operator=(const window_segment&) = delete;
  /// Never frees the window (see the file comment).
  ~window_segment() override = default;

  /// MPI_Win_free: collective over the node's ranks.
  void close() override {
    if (win_ == MPI_WIN_NULL) return;
    forget();
    MPI_Win_free(&win_);
    win_ = MPI_WIN_NULL;
  }

  /// "mpi window".
  [[nodiscard]] const char* backing() const noexcept override { return "mpi window"; }

 private:
  explicit window_segment(MPI_Win win) noexcept : segment(nullptr, 0), win_(win) {}

  static void check(int code, int rank, const char* call) {
    if (code != MPI_SUCCESS) {
      throw segment_error(rank, "shm::communicator set-up",
                          std::string(call) + " failed: " + ddp::mpi::error_string(code));
    }
  }

  static constexpr std::size_t page = 4096;
  MPI_Win win_;
};

}  // namespace ddp::shm::mpi
