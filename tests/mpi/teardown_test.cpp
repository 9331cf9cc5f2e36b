// ddp::mpi::environment after a communication failure must not block in MPI_Finalize on a peer
// that never arrives. `mpi_teardown <mode>`: every rank but the last issues an allreduce that the
// last rank never joins (it holds on for 20 s, then exits normally), so the others time out after
// 500 ms. What happens then, by mode:
//   unwind: the timeout_error unwinds through the environment's destructor;
//   caught: the error is caught inside the environment's scope, which then ends normally (the
//           communicator was made from the environment, so the environment knows it failed);
//   abandon: as caught, with a communicator made without the environment, and an explicit
//           `environment::abandon()` in the handler.
// A waiting rank prints one line: the error, then how long after the wait began the environment
// was gone; "prompt" and exit code 3 if that was well before the last rank lets go, "LATE" and
// exit code 4 otherwise. The launcher then ends the job (the last rank is killed), so the run
// exits non-zero either way; ctest checks the output (cmake/ddpRunExpect.cmake).
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include <ddp/mpi.hpp>

namespace {
using namespace std::chrono_literals;
using steady = std::chrono::steady_clock;

constexpr auto timeout = 500ms;
constexpr auto hold = 20s;  // how long the last rank keeps everybody's MPI_Finalize waiting

int rank_of_world() {
  int rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}
}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "unwind";
  if (mode != "unwind" && mode != "caught" && mode != "abandon") {
    std::fprintf(stderr, "usage: mpi_teardown unwind|caught|abandon\n");
    return 2;
  }
  int rank = -1;
  steady::time_point began{};
  std::string error;
  bool recorded = false;
  try {
    ddp::mpi::environment env(&argc, &argv);
    rank = rank_of_world();
    auto comm = mode == "caught" ? ddp::mpi::communicator::world(env, {.timeout = timeout})
                                 : ddp::mpi::communicator::world({.timeout = timeout});
    if (comm.rank() == comm.size() - 1) {
      std::this_thread::sleep_for(hold);  // never calls the collective
      std::printf("rank %d: held the others for %lld s\n", rank, static_cast<long long>(hold.count()));
      return 0;
    }
    // Deliberately never freed: MPI may still write it after the timeout.
    auto& v = *new std::vector<float>(4, 1.0f);
    began = steady::now();
    if (mode == "unwind") {
      comm.allreduce(v, ddp::reduce_op::sum).wait();  // throws through ~environment
    } else {
      try {
        comm.allreduce(v, ddp::reduce_op::sum).wait();
      } catch (const ddp::timeout_error& e) {
        error = e.what();
        if (mode == "abandon") env.abandon();
        recorded = env.communication_failed();
      }
    }  // caught / abandon: the environment's scope ends normally
  } catch (const ddp::timeout_error& e) {
    error = e.what();
  }
  if (error.empty()) {
    std::printf("rank %d: no timeout_error (mode %s)\n", rank, mode.c_str());
    return 1;
  }
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(steady::now() - began).count();
  const bool prompt = steady::now() - began < hold / 3;
  std::printf(
      "rank %d: %s: %s | failure recorded in the environment: %s | environment gone %lld ms after the wait "
      "began: %s\n",
      rank, mode.c_str(), error.c_str(), recorded ? "yes" : "no", static_cast<long long>(ms),
      prompt ? "prompt" : "LATE");
  std::fflush(stdout);
  return prompt ? 3 : 4;
}
