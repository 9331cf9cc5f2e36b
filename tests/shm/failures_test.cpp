// Failures of the shared-memory path: they must surface as ddp errors naming rank and operation
// on every rank, promptly (no rank left spinning until a long timeout), and leave the
// communicator refusing further allreduces.
#include <catch2/catch.hpp>
#include <ddp/mpi.hpp>
#include <ddp/shm.hpp>
#include <ddp/shm/mpi.hpp>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace std::chrono_literals;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("shm failures: different counts on different ranks are a mismatch_error everywhere", "[shm][failures]") {
  auto comm = ddp::shm::mpi::world({.chunk_bytes = 4096, .timeout = 20s});
  std::vector<float> x(comm.rank() == 0 ? 100 : 200, 1.0f);
  ddp::work w = comm.allreduce(x, ddp::reduce_op::sum);
  try {
    w.wait();
    FAIL("expected mismatch_error");
  } catch (const ddp::mismatch_error& e) {
    INFO(e.what());
    REQUIRE(e.rank() == comm.rank());
    REQUIRE(contains(e.what(), "different collectives"));
  }
  REQUIRE_THROWS_AS(comm.allreduce(x, ddp::reduce_op::sum), ddp::usage_error);
}

TEST_CASE("shm failures: different operators are a mismatch_error", "[shm][failures]") {
  auto comm = ddp::shm::mpi::world({.timeout = 20s});
  std::vector<double> x(1000, 1.0);
  REQUIRE_THROWS_AS(comm.allreduce(x, comm.rank() == 0 ? ddp::reduce_op::max : ddp::reduce_op::sum).wait(),
                    ddp::mismatch_error);
}

TEST_CASE("shm failures: a rank that aborts makes its peers fail at once", "[shm][failures]") {
  auto comm = ddp::shm::mpi::world({.timeout = 60s});
  std::vector<float> x(1 << 16, 1.0f);
  if (comm.rank() == comm.size() - 1) {
    comm.abort();
    REQUIRE_THROWS_AS(comm.allreduce(x, ddp::reduce_op::sum), ddp::usage_error);
  } else {
    const auto start = std::chrono::steady_clock::now();
    try {
      comm.allreduce(x, ddp::reduce_op::sum).wait();
      FAIL("expected communication_error");
    } catch (const ddp::communication_error& e) {
      INFO(e.what());
      REQUIRE(contains(e.what(), "aborted"));
      REQUIRE(contains(e.what(), "allreduce #0"));
    }
    REQUIRE(std::chrono::steady_clock::now() - start < 30s);  // not the 60 s timeout
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("shm failures: a missing peer is a timeout_error naming it; peers then fail fast", "[shm][failures]") {
  auto comm = ddp::shm::mpi::world({.timeout = 300ms});
  std::vector<float> x(4096, 1.0f);
  if (comm.rank() == 0) {
    try {
      comm.allreduce(x, ddp::reduce_op::sum).wait();
      FAIL("expected timeout_error");
    } catch (const ddp::timeout_error& e) {
      INFO(e.what());
      REQUIRE(contains(e.what(), "did not"));
      REQUIRE(contains(e.what(), "within 300 ms"));
    }
    MPI_Barrier(MPI_COMM_WORLD);
  } else {
    MPI_Barrier(MPI_COMM_WORLD);  // arrives after rank 0 gave up
    REQUIRE_THROWS_AS(comm.allreduce(x, ddp::reduce_op::sum).wait(), ddp::communication_error);
  }
}

TEST_CASE("shm failures: usage errors are local and leave the communicator usable", "[shm][failures]") {
  auto comm = ddp::shm::mpi::world();
  std::vector<float> x(8, 1.0f);
  ddp::tensor_view on_gpu = ddp::view(x);
  on_gpu.where = ddp::device::cuda(1);
  try {
    (void)comm.allreduce(std::span<const ddp::tensor_view>(&on_gpu, 1), ddp::reduce_op::sum);
    FAIL("expected usage_error");
  } catch (const ddp::usage_error& e) {
    REQUIRE(contains(e.what(), "cuda:1"));
    REQUIRE(e.rank() == comm.rank());
  }
  ddp::tensor_view no_data{nullptr, 4, ddp::dtype::f32, ddp::device::host()};
  REQUIRE_THROWS_AS(comm.allreduce(std::span<const ddp::tensor_view>(&no_data, 1), ddp::reduce_op::sum),
                    ddp::usage_error);
  comm.allreduce(x, ddp::reduce_op::sum).wait();
  REQUIRE(x[0] == static_cast<float>(comm.size()));
}

TEST_CASE("shm failures: different options on different ranks fail set-up on every rank", "[shm][failures]") {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  for (auto backing : {ddp::shm::mpi::segment_backing::window, ddp::shm::mpi::segment_backing::posix}) {
    const std::size_t chunk = rank == 1 ? 8192 : 4096;
    CHECK_THROWS_AS(ddp::shm::mpi::world({.chunk_bytes = chunk}, {.backing = backing}), ddp::usage_error);
  }
}

TEST_CASE("shm failures: POSIX segment errors carry errno text", "[shm][failures]") {
  auto r = ddp::shm::posix_segment::open("/ddp-shm-does-not-exist", 4096);
  REQUIRE(!r.segment);
  REQUIRE(r.failed == ddp::shm::posix_segment::step::shm_open);
  REQUIRE(r.error == ENOENT);
}
