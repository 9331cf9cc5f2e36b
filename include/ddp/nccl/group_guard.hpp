#pragma once
/// @file group_guard.hpp
/// @brief RAII scope of an `ncclGroupStart` / `ncclGroupEnd` pair, used to coalesce the
/// collectives of a multi-tensor call into one NCCL launch.

#include <nccl.h>

#include <chrono>
#include <string>
#include <string_view>

#include <ddp/nccl/error.hpp>
#include <ddp/nccl/nonblocking.hpp>
#include <ddp/work.hpp>

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
  /// @param comm    communicator of the grouped calls, for NCCL's detailed error text; on a
  ///                non-blocking one, `ncclGroupEnd` may report ncclInProgress: it is waited for
  /// @param within  how long to wait for that
  /// @throws communication_error if `ncclGroupEnd` fails; timeout_error if still in progress
  void end(ncclComm_t comm = nullptr, std::chrono::milliseconds within = default_timeout) {
    open_ = false;
    detail::check_settled(ncclGroupEnd(), comm, rank_, operation_, "ncclGroupEnd", within);
  }

 private:
  int rank_;
  std::string operation_;
  bool open_ = true;
};

}  // namespace ddp::nccl
