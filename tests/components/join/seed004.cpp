// The six uneven-input cases of docs/join.md as a program: `seed004 <case> [--checked]
// [--timeout-ms N]` (the collectives' timeout, default 3000), rank r holding 3 + r batches.
// Cases 1 and 6 must finish with identical models equal to the serial reference; 2-5 must end
// with a clear error on the rank left waiting (exit code 3), never a hang or a garbage rank.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <ddp/mpi.hpp>

#include "join_cases.hpp"

int main(int argc, char** argv) {
  // The environment sets MPI_ERRORS_RETURN on MPI_COMM_WORLD: Open MPI reports some errors of
  // mismatched non-blocking collectives (MPI_ERR_TRUNCATE from its NBC engine) there even when
  // they happen on a duplicate, and they come back as exceptions instead of aborting the job.
  ddp::mpi::environment env(&argc, &argv);
  const int which = argc > 1 ? std::atoi(argv[1]) : 1;
  bool checked = false;
  std::chrono::milliseconds timeout{3000};
  for (int i = 2; i < argc; ++i) {
    if (std::strcmp(argv[i], "--checked") == 0) checked = true;
    if (std::strcmp(argv[i], "--timeout-ms") == 0 && i + 1 < argc)
      timeout = std::chrono::milliseconds(std::atoi(argv[++i]));
  }
  auto comm = ddp::mpi::communicator::world({.timeout = timeout});
  ddp::checked_communicator chk(comm, {.timeout = timeout});
  join_cases::train_options o;
  o.use_join = which == 1 || which == 4 || which == 6;
  o.barrier_in_loop = which == 3 || which == 4;
  o.barrier_after = which == 5 || which == 6;
  try {
    const auto m = checked ? join_cases::train(chk, o) : join_cases::train(comm, o);
    if (!o.use_join) {
      // Like the seed's script: this rank ran out of data and leaves; a rank with more data is
      // left waiting for a partner and must fail clearly.
      std::printf("rank %d: case %d: ran out of data after %d batches and leaves\n", comm.rank(), which,
                  o.base_batches + comm.rank());
      return 0;
    }
    join_cases::expect_model_matches(comm, m, join_cases::reference(comm.size(), o.base_batches, true),
                                     "uneven inputs");
    std::printf("rank %d: case %d finished, parameters identical on every rank and equal to the reference\n",
                comm.rank(), which);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: case %d: %s\n", comm.rank(), which, e.what());
    std::fflush(stderr);
    // Leave without MPI_Finalize: the peers may be stuck in a collective that will never match.
    std::_Exit(3);
  }
}
