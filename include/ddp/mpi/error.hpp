#pragma once
/// @file mpi/error.hpp
/// @brief `mpi_error`: an MPI call returned an error code. Carries the code, MPI's text for it,
/// the rank and the ddp operation ("allreduce #12 (sum, f32 x 1024)").

#include <mpi.h>

#include <string>
#include <utility>

#include <ddp/error.hpp>
#include <ddp/work.hpp>

namespace ddp::mpi {

/// MPI's description of an error code, e.g. "MPI_ERR_ROOT: invalid root".
[[nodiscard]] inline std::string error_string(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS || length <= 0) {
    return "unknown MPI error";
  }
  return std::string(text, static_cast<std::size_t>(length));
}

/// An MPI call failed. A `communication_error`, so code that handles any backend's failures
/// catches it; MPI-aware code can read the MPI error code.
class mpi_error : public communication_error {
 public:
  /// @param rank       rank that saw the error
  /// @param operation  the ddp operation, e.g. "allreduce #12 (sum, f32 x 1024)"
  /// @param call       the MPI function that failed ("MPI_Iallreduce")
  /// @param code       its return code
  mpi_error(int rank, std::string operation, const char* call, int code)
      : communication_error(rank, std::move(operation), message(call, code)), code_(code) {}

  /// The MPI error code the call returned.
  [[nodiscard]] int code() const noexcept { return code_; }

 private:
  static std::string message(const char* call, int code) {
    return std::string(call) + " failed: " + error_string(code) + " (MPI error code " + std::to_string(code) + ")";
  }
  int code_;
};

namespace detail {

/// Throws `mpi_error` for `code`, naming the operation. Out of line from the checks below so
/// the success path stays a compare and a branch (describe() builds strings only here).
[[noreturn]] inline void throw_mpi_error(int code, const op_info& info, const char* call) {
  throw mpi_error(info.rank, info.describe(), call, code);
}

/// Checks the return code of an MPI call made for the operation `info`.
inline void check(int code, const op_info& info, const char* call) {
  if (code != MPI_SUCCESS) [[unlikely]] {
    throw_mpi_error(code, info, call);
  }
}

/// Checks the return code of an MPI call made outside a collective (set-up, tear-down).
inline void check(int code, int rank, const char* operation, const char* call) {
  if (code != MPI_SUCCESS) [[unlikely]] {
    throw mpi_error(rank, operation, call, code);
  }
}

}  // namespace detail
}  // namespace ddp::mpi
