// Catch2 main for MPI test executables: every rank runs the same tests, then all ranks agree on
// the result (a test that fails on one rank fails the run on all), and only rank 0 prints unless
// something failed.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <mpi.h>

#include <cstdio>

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);

  Catch::Session session;
  if (const int rc = session.applyCommandLine(argc, argv); rc != 0) {
    MPI_Finalize();
    return rc;
  }
  const int failed = session.run();
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (any_failed && !failed) std::fprintf(stderr, "rank %d: passed, but another rank failed\n", rank);
  MPI_Finalize();
  return any_failed ? 1 : 0;
}
