// Hierarchical composition on one machine: the world is split into simulated "nodes"
// (options::node_of_rank); each node reduces in shared memory, the node leaders allreduce over
// MPI, and each leader broadcasts in shared memory. Contiguous, interleaved and lopsided splits
// (nodes of one rank have no segment), both backings, and the generic constructor with a
// leaders' communicator made by the caller.
#include <catch2/catch.hpp>
#include <ddp/mpi.hpp>
#include <ddp/shm.hpp>
#include <ddp/shm/mpi.hpp>
#include <mpi.h>

#include <chrono>
#include <optional>
#include <thread>
#include <vector>

#include "shm_cases.hpp"

namespace {

constexpr std::size_t small_chunk = 4096;

int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

using shm_cases::halves;
// Interleaved, with arbitrary labels: {7,3}, {7,3,7}, {7,3,7,3}.
std::vector<int> interleaved(int n) {
  std::vector<int> v(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) v[static_cast<std::size_t>(r)] = r % 2 ? 3 : 7;
  return v;
}

void check_topology(const ddp::shm::mpi_communicator& comm, const std::vector<int>& labels) {
  const auto& t = comm.topology();
  const auto want = ddp::shm::node_topology::from_labels(comm.rank(), labels);
  REQUIRE(t.nodes == want.nodes);
  REQUIRE(t.node == want.node);
  REQUIRE(t.node_rank == want.node_rank);
  REQUIRE(t.node_size == want.node_size);
}

}  // namespace

TEST_CASE("shm hierarchical: two nodes (halves), MPI window", "[shm][hierarchical]") {
  const auto labels = halves(world_size());
  auto comm = ddp::shm::mpi::world({.chunk_bytes = small_chunk, .node_of_rank = labels});
  check_topology(comm, labels);
  REQUIRE(comm.topology().nodes == 2);
  REQUIRE((comm.leaders() != nullptr) == comm.topology().is_leader());
  if (comm.leaders()) REQUIRE(comm.leaders()->size() == 2);
  // The default inter-node step: ddp's sockets ring among the leaders.
  REQUIRE(comm.inter_node() ==
          (comm.topology().is_leader() ? std::optional(ddp::shm::across_nodes::sockets) : std::nullopt));
  REQUIRE_NOTHROW(shm_cases::run_all(comm, small_chunk, "2 nodes window", 2));
}

TEST_CASE("shm hierarchical: two nodes, the leaders' MPI communicator across nodes", "[shm][hierarchical]") {
  const auto labels = halves(world_size());
  auto comm = ddp::shm::mpi::world(
      {.chunk_bytes = small_chunk, .node_of_rank = labels, .inter_node = ddp::shm::across_nodes::leaders_communicator});
  REQUIRE(comm.inter_node() ==
          (comm.topology().is_leader() ? std::optional(ddp::shm::across_nodes::leaders_communicator) : std::nullopt));
  REQUIRE_NOTHROW(shm_cases::run_all(comm, small_chunk, "2 nodes leaders' communicator", 2));
}

TEST_CASE("shm hierarchical: two nodes (interleaved), POSIX segment", "[shm][hierarchical]") {
  const auto labels = interleaved(world_size());
  auto comm = ddp::shm::mpi::world({.chunk_bytes = small_chunk, .node_of_rank = labels},
                                   {.backing = ddp::shm::mpi::segment_backing::posix});
  check_topology(comm, labels);
  REQUIRE_NOTHROW(shm_cases::run_all(comm, small_chunk, "2 nodes posix", 2));
}

TEST_CASE("shm hierarchical: every rank its own node (no shared memory at all)", "[shm][hierarchical]") {
  std::vector<int> labels(static_cast<std::size_t>(world_size()));
  for (std::size_t r = 0; r < labels.size(); ++r) labels[r] = static_cast<int>(r);
  auto comm = ddp::shm::mpi::world({.chunk_bytes = small_chunk, .node_of_rank = labels});
  REQUIRE(std::string(comm.backing()) == "none");
  REQUIRE_NOTHROW(suite::run_all(comm));
  REQUIRE_NOTHROW(shm_cases::every_dtype_op_and_size(comm, small_chunk, "singletons", 2));
}

TEST_CASE("shm hierarchical: default chunk size, large and > 64 MiB", "[shm][hierarchical][large]") {
  auto comm = ddp::shm::mpi::world({.node_of_rank = halves(world_size())});
  for (std::size_t n : {std::size_t{1} << 20, std::size_t{3} << 20}) {
    REQUIRE_NOTHROW(shm_cases::check_allreduce(comm, ddp::dtype::f32, ddp::reduce_op::avg, n + 5, "2 nodes", 2));
    REQUIRE_NOTHROW(shm_cases::check_allreduce(comm, ddp::dtype::f16, ddp::reduce_op::sum, n + 5, "2 nodes", 2));
  }
  REQUIRE_NOTHROW(suite::large_allreduce(comm));
}

TEST_CASE("shm hierarchical: generic constructor with a caller-made leaders' communicator", "[shm][hierarchical]") {
  const auto labels = halves(world_size());
  const auto t = ddp::shm::node_topology::from_labels(ddp::mpi::communicator::world().rank(), labels);
  MPI_Comm split = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, t.is_leader() ? 0 : MPI_UNDEFINED, t.rank, &split);
  std::optional<ddp::mpi::communicator> leaders;
  if (split != MPI_COMM_NULL) {
    leaders.emplace(split);
    MPI_Comm_free(&split);
  }
  ddp::shm::communicator<ddp::mpi::communicator> comm(
      ddp::mpi::communicator::world(), {.chunk_bytes = small_chunk, .node_of_rank = labels},
      [&](const ddp::shm::node_topology&) { return std::move(leaders); });
  REQUIRE(comm.topology().nodes == 2);
  REQUIRE_NOTHROW(shm_cases::every_dtype_op_and_size(comm, small_chunk, "generic 2 nodes", 2));
}

TEST_CASE("shm hierarchical: several nodes without a leaders' communicator is a usage error on every rank",
          "[shm][hierarchical]") {
  const auto labels = halves(world_size());
  REQUIRE_THROWS_AS(
      ddp::shm::communicator<ddp::mpi::communicator>(ddp::mpi::communicator::world(), {.node_of_rank = labels}),
      ddp::usage_error);
}

TEST_CASE("shm hierarchical: ranks that split the same elements into different tensors", "[shm][hierarchical]") {
  // Every rank its own node, so every rank is a leader: rank 0 passes 3 tensors, the others one.
  std::vector<int> labels(static_cast<std::size_t>(world_size()));
  for (std::size_t r = 0; r < labels.size(); ++r) labels[r] = static_cast<int>(r);
  auto comm = ddp::shm::mpi::world({.node_of_rank = labels});
  const int rank = comm.rank();
  std::vector<float> all(3000);
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<float>((i % 7) + static_cast<std::size_t>(rank));
  std::vector<ddp::tensor_view> views;
  if (rank == 0) {
    views = {ddp::tensor_view{all.data(), 1000, ddp::dtype::f32},
             ddp::tensor_view{all.data() + 1000, 1, ddp::dtype::f32},
             ddp::tensor_view{all.data() + 1001, 1999, ddp::dtype::f32}};
  } else {
    views = {ddp::tensor_view{all.data(), all.size(), ddp::dtype::f32}};
  }
  comm.allreduce(std::span<const ddp::tensor_view>(views), ddp::reduce_op::sum).wait();
  const int n = comm.size();
  for (std::size_t i = 0; i < all.size(); ++i) {
    REQUIRE(all[i] == static_cast<float>(n * static_cast<int>(i % 7) + n * (n - 1) / 2));
  }
}

TEST_CASE("shm hierarchical: across nodes over sockets, an allreduce runs while the caller goes on",
          "[shm][hierarchical]") {
  // Every rank its own node. Rank 1 arrives a second late: rank 0's call returns at once with a
  // pending work, which completes with the right values once rank 1 is there.
  std::vector<int> labels(static_cast<std::size_t>(world_size()));
  for (std::size_t r = 0; r < labels.size(); ++r) labels[r] = static_cast<int>(r);
  auto comm = ddp::shm::mpi::world({.node_of_rank = labels});
  if (comm.size() < 2) return;
  std::vector<float> v(100000, static_cast<float>(comm.rank() + 1));
  if (comm.rank() == 1) std::this_thread::sleep_for(std::chrono::seconds(1));
  const auto start = std::chrono::steady_clock::now();
  ddp::work w = comm.allreduce(v, ddp::reduce_op::sum);
  const auto returned = std::chrono::steady_clock::now() - start;
  if (comm.rank() == 0) {
    CHECK(returned < std::chrono::milliseconds(500));
    CHECK_FALSE(w.test());  // rank 1 is still asleep
  }
  w.wait();
  const int n = comm.size();
  for (float x : v) REQUIRE(x == static_cast<float>(n * (n + 1) / 2));
}
