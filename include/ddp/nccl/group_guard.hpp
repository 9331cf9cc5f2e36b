#pragma once
/// @file group_guard.hpp
/// @brief RAII scope of an `ncclGroupStart` / `ncclGroupEnd` pair, used to coalesce the
/// collectives of a multi-tensor call into one NCCL launch.

#include <nccl.h>

#include <string>
#include <string_view>

#include <ddp/nccl/error.hpp>

namespace ddp::nccl {

/// Opens an NCCL group on construction. `end()` closes it and reports NCCL's verdict; if the
/// scope is left without `end()` (an exception while enqueuing), the destructor closes the group
/// silently. NCCL's group depth is per thread, so it must always be balanced, but a destructor
/// that throws while another exception unwinds would terminate the program.
/// `ncclGroupEnd` guarantees that the operations are enqueued on their streams, not completed.
class group_guard {
 public:
  /// @throws communication_error if `ncclGroupStart` fails
  group_guard(int rank, std::string_view operation) : rank_(rank), operation_(operation) {
    check_nccl(ncclGroupStart(), rank_, operation_, "ncclGroupStart");
  }
  group_guard(const group_guard&) = delete;
  group_guard& operator=(const group_guard&) = delete;
  ~group_guard() {
    if (open_) (void)ncclGroupEnd();
  }

  /// Closes the group, launching its operations.
  /// @param comm  communicator of the grouped calls, for NCCL's detailed error text
  /// @throws communication_error if `ncclGroupEnd` fails
  void end(ncclComm_t comm = nullptr) {
    open_ = false;
    check_nccl(ncclGroupEnd(), rank_, operation_, "ncclGroupEnd", comm);
  }

 private:
  int rank_;
  std::string operation_;
  bool open_ = true;
};

}  // namespace ddp::nccl
