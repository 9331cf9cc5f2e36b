#pragma once
/// @file mpi/environment.hpp
/// @brief `environment`: RAII ownership of MPI initialisation, for programs that let ddp start MPI.

#include <mpi.h>

#include <cstdio>
#include <exception>
#include <memory>
#include <string>

#include <ddp/error.hpp>
#include <ddp/mpi/error.hpp>
#include <ddp/mpi/failure_record.hpp>
#include <ddp/mpi/thread_level.hpp>

namespace ddp::mpi {

/// Initialises MPI unless it already is, and finalizes it on destruction only if it did, and only
/// when finalizing cannot block on a peer that will never arrive.
///
/// Works whether or not the program initialised MPI itself: with MPI already running it only
/// records the thread level. MPI can be initialised once per process, so constructing an
/// environment after MPI was finalized throws `usage_error`.
///
/// When it initialises MPI it sets `MPI_ERRORS_RETURN` on `MPI_COMM_WORLD`: Open MPI reports
/// some errors of non-blocking collectives there even when they happen on a duplicate
/// communicator, and the default handler would abort the whole job instead of letting ddp turn
/// them into exceptions. (A program that initialises MPI itself keeps its own handler.)
///
/// Teardown: `MPI_Finalize` waits for every process, so after a communication failure it can
/// block for as long as a stuck peer stays stuck. The destructor therefore does **not** finalize
/// (it prints one line on stderr and returns at once; the process then exits without
/// MPI_Finalize and the MPI launcher ends the job) when
/// - it runs while an exception unwinds the stack (`std::uncaught_exceptions()` grew since
///   construction): typically a `timeout_error` on its way to the program's handler;
/// - a communicator made with it (`communicator::world(env)`, `communicator(env, comm)`) saw a
///   communication failure: an MPI error, a timed-out wait, or `abort()`;
/// - `abandon()` was called.
/// It never calls MPI_Abort: that would kill the process before the program's handler reported
/// the error. A program that wants the whole job gone at once calls MPI_Abort itself.
/// @code
/// int main(int argc, char** argv) {
///   ddp::mpi::environment env(&argc, &argv);
///   auto comm = ddp::mpi::communicator::world(env);
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

  /// Finalizes MPI if this object initialised it (and nobody finalized it meanwhile), unless
  /// that could block on a peer (see the class description): then it returns at once.
  ~environment() {
    if (!owns_) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    const char* why = nullptr;
    if (abandoned_) {
      why = "abandon() was called";
    } else if (std::uncaught_exceptions() > uncaught_) {
      why = "it is destroyed while an exception unwinds the stack";
    } else if (failures_->failed()) {
      why = "a communicator made with it failed";
    }
    if (why == nullptr) {
      MPI_Finalize();
      return;
    }
    int rank = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    std::string first;
    try {
      first = failures_->first();
    } catch (...) {
    }
    std::fprintf(stderr,
                 "ddp: rank %d: mpi::environment: not calling MPI_Finalize: %s%s%s%s. It would wait for every "
                 "process, and a peer that never arrives would block this one; the process exits without it and "
                 "the MPI launcher ends the job.\n",
                 rank, why, first.empty() ? "" : " (first failure: ", first.c_str(), first.empty() ? "" : ")");
    std::fflush(stderr);
  }

  /// Do not finalize MPI on destruction: e.g. after a communication error that the program
  /// handled itself on a communicator not made with this environment. The process then exits
  /// without MPI_Finalize and the MPI launcher ends the job.
  void abandon() noexcept { abandoned_ = true; }

  /// True once a communicator made with this environment saw a communication failure (an MPI
  /// error, a timed-out wait, `abort()`); the destructor will then not finalize MPI.
  [[nodiscard]] bool communication_failed() const noexcept { return failures_->failed(); }

  /// The thread level MPI provides (may be below the one requested).
  [[nodiscard]] thread_level provided() const noexcept { return provided_; }

  /// True if this object initialised MPI and will finalize it (when that cannot block).
  [[nodiscard]] bool owns_mpi() const noexcept { return owns_; }

 private:
  friend class communicator;  // made with an environment: shares its failure record

  thread_level provided_ = thread_level::single;
  bool owns_ = false;
  bool abandoned_ = false;
  int uncaught_ = std::uncaught_exceptions();
  std::shared_ptr<detail::failure_record> failures_ = std::make_shared<detail::failure_record>();
};

}  // namespace ddp::mpi
