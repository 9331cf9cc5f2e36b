#pragma once
/// @file shm/segment.hpp
/// @brief `segment`: memory that the ranks of one node have mapped (each at its own address),
/// and `segment_error`, raised when such memory cannot be created or mapped.

#include <cstddef>
#include <string>
#include <utility>

#include <ddp/error.hpp>

namespace ddp::shm {

/// Creating, sizing or mapping shared memory failed. Carries the errno (0 if the failure was
/// not a system call's, e.g. an MPI error) and names the call and its error text in `what()`.
class segment_error : public communication_error {
 public:
  segment_error(int rank, std::string operation, const std::string& message, int errno_value = 0)
      : communication_error(rank, std::move(operation), message), errno_(errno_value) {}

  /// The errno of the failing call, or 0.
  [[nodiscard]] int errno_value() const noexcept { return errno_; }

 private:
  int errno_;
};

/// One mapping of a node's shared memory. Backings derive from it (POSIX shared memory, MPI-3
/// shared windows). Destruction unmaps this rank's view only: it never communicates.
class segment {
 public:
  segment(const segment&) = delete;
  segment& operator=(const segment&) = delete;
  virtual ~segment() = default;

  /// This rank's address of the first byte (page aligned).
  [[nodiscard]] std::byte* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }

  /// Releases the memory now, collectively over the node, where the backing needs a collective
  /// for that (an MPI window). Afterwards `data()` is null. Default: nothing to do collectively.
  virtual void close() {}

  /// Name of the backing, for messages ("posix", "mpi window").
  [[nodiscard]] virtual const char* backing() const noexcept = 0;

 protected:
  segment(std::byte* data, std::size_t size) noexcept : data_(data), size_(size) {}
  /// Points this segment at other memory (a backing that learns its address after construction).
  void assign(std::byte* data, std::size_t size) noexcept {
    data_ = data;
    size_ = size;
  }
  void forget() noexcept { assign(nullptr, 0); }

 private:
  std::byte* data_;
  std::size_t size_;
};

}  // namespace ddp::shm
