// ddp::mpi::environment when nothing initialised MPI before it: it initialises MPI, and
// finalizes it when destroyed. Plain main (the Catch2 MPI main would initialise MPI itself).
#include <cstdio>
#include <memory>
#include <vector>

#include <ddp/mpi.hpp>

namespace {
int failures = 0;
void expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "FAILED: %s\n", what);
    ++failures;
  }
}
}  // namespace

int main(int argc, char** argv) {
  int initialized = 1;
  MPI_Initialized(&initialized);
  expect(!initialized, "MPI is not initialised before the environment");

  std::unique_ptr<ddp::mpi::communicator> survivor;
  {
    ddp::mpi::environment env(&argc, &argv);
    expect(env.owns_mpi(), "the environment owns the MPI it initialised");
    MPI_Initialized(&initialized);
    expect(initialized != 0, "MPI is initialised");
    int provided = MPI_THREAD_SINGLE;
    MPI_Query_thread(&provided);
    expect(static_cast<int>(env.provided()) == provided, "provided() reports MPI's thread level");

    // Errors raised on MPI_COMM_WORLD come back as codes instead of aborting the job (Open MPI
    // reports some errors of non-blocking collectives there, even on a duplicate communicator).
    MPI_Errhandler handler = MPI_ERRHANDLER_NULL;
    MPI_Comm_get_errhandler(MPI_COMM_WORLD, &handler);
    expect(handler == MPI_ERRORS_RETURN, "the environment set MPI_ERRORS_RETURN on MPI_COMM_WORLD");
    if (handler != MPI_ERRHANDLER_NULL) MPI_Errhandler_free(&handler);
    int world_size = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    int payload = 0;
    const int rc = MPI_Send(&payload, 1, MPI_INT, world_size + 1, 0, MPI_COMM_WORLD);  // no such rank
    expect(rc != MPI_SUCCESS, "an erroneous call on MPI_COMM_WORLD returns an error code");
    {
      ddp::mpi::environment nested;  // MPI already running: borrowed, not owned
      expect(!nested.owns_mpi(), "a second environment does not own MPI");
    }
    int finalized = 1;
    MPI_Finalized(&finalized);
    expect(!finalized, "the borrowing environment did not finalize MPI");

    auto comm = ddp::mpi::communicator::world();
    std::vector<float> v(1000, 1.0f);
    comm.allreduce(v, ddp::reduce_op::sum).wait();
    expect(v[999] == static_cast<float>(comm.size()), "allreduce works");
    // A communicator that outlives MPI must not call it in its destructor.
    survivor = std::make_unique<ddp::mpi::communicator>(MPI_COMM_WORLD);
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  expect(finalized != 0, "the owning environment finalized MPI");
  survivor.reset();

  bool refused = false;
  try {
    ddp::mpi::environment again;
  } catch (const ddp::usage_error&) {
    refused = true;
  }
  expect(refused, "MPI cannot be initialised again after it was finalized");
  refused = false;
  try {
    auto late = ddp::mpi::communicator::world();
  } catch (const ddp::usage_error&) {
    refused = true;
  }
  expect(refused, "a communicator needs MPI running");
  if (failures == 0) std::puts("mpi_environment: all checks passed");
  return failures == 0 ? 0 : 1;
}
