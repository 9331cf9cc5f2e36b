#pragma once
/// @file mpi/environment.hpp
/// @brief `environment`: RAII ownership of MPI initialisation, for programs that let ddp start MPI.

#include <mpi.h>

#include <ddp/error.hpp>
#include <ddp/mpi/error.hpp>
#include <ddp/mpi/thread_level.hpp>

namespace ddp::mpi {

/// Initialises MPI unless it already is, and finalizes it on destruction only if it did.
///
/// Works whether or not the program initialised MPI itself: with MPI already running it only
/// records the thread level. MPI can be initialised once per process, so constructing an
/// environment after MPI was finalized throws `usage_error`.
///
/// When it initialises MPI it sets `MPI_ERRORS_RETURN` on `MPI_COMM_WORLD`: Open MPI reports
/// some errors of non-blocking collectives there even when they happen on a duplicate
/// communicator, and the default handler would abort the whole job instead of letting ddp turn
/// them into exceptions. (A program that initialises MPI itself keeps its own handler.)
/// @code
/// int main(int argc, char** argv) {
///   ddp::mpi::environment env(&argc, &argv);
///   auto comm = ddp::mpi::communicator::world();
/// }
/// @endcode
class environment {
 public:
  /// Requests `required` (default MPI_THREAD_MULTIPLE) if it initialises MPI.
  explicit environment(thread_level required = thread_level::multiple) : environment(nullptr, nullptr, required) {}

  /// As above, passing the program's arguments to MPI_Init_thread.
  environment(int* argc, char*** argv, thread_level required = thread_level::multiple) {
    int initialized = 0;
    int finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (finalized) {
      throw usage_error(-1, "mpi::environment", "MPI was already finalized; it cannot be initialised again");
    }
    int provided = MPI_THREAD_SINGLE;
    if (initialized) {
      detail::check(MPI_Query_thread(&provided), -1, "mpi::environment", "MPI_Query_thread");
    } else {
      detail::check(MPI_Init_thread(argc, argv, static_cast<int>(required), &provided), -1, "mpi::environment",
                    "MPI_Init_thread");
      owns_ = true;
      detail::check(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), -1, "mpi::environment",
                    "MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN)");
    }
    provided_ = static_cast<thread_level>(provided);
  }

  environment(const environment&) = delete;
  environment& operator=(const environment&) = delete;

  /// Finalizes MPI if this object initialised it (and nobody finalized it meanwhile).
  ~environment() {
    if (!owns_) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }

  /// The thread level MPI provides (may be below the one requested).
  [[nodiscard]] thread_level provided() const noexcept { return provided_; }

  /// True if this object initialised MPI and will finalize it.
  [[nodiscard]] bool owns_mpi() const noexcept { return owns_; }

 private:
  thread_level provided_ = thread_level::single;
  bool owns_ = false;
};

}  // namespace ddp::mpi
