// ddp::shm::communicator over the local backend (ranks as threads of one process, each with its
// own mapping of a POSIX segment): the decorator needs nothing from MPI. One node, and two
// simulated nodes whose leaders get a second local world as their communicator.
#include <catch2/catch.hpp>
#include <ddp/local.hpp>
#include <ddp/shm.hpp>

#include <memory>
#include <optional>

#include "shm_cases.hpp"

namespace {

using shm_local = ddp::shm::communicator<ddp::local::communicator>;

}  // namespace

TEST_CASE("shm over local threads: one node, every dtype, operator and size class", "[shm][local]") {
  for (int ranks : {1, 2, 3}) {
    REQUIRE_NOTHROW(ddp::local::run(ranks, [](ddp::local::communicator& c) {
      shm_local comm(std::move(c), {.chunk_bytes = 4096});  // node found by host name
      shm_cases::run_all(comm, 4096, "local");
    }));
  }
}

TEST_CASE("shm over local threads: two simulated nodes, leaders on their own local world", "[shm][local]") {
  const std::vector<int> labels{0, 0, 1, 1, 1};
  ddp::local::world leaders(2);
  REQUIRE_NOTHROW(ddp::local::run(5, [&](ddp::local::communicator& c) {
    shm_local comm(std::move(c), {.chunk_bytes = 4096, .node_of_rank = labels},
                   [&](const ddp::shm::node_topology& t) { return std::optional(leaders.rank(t.node)); });
    SUITE_EXPECT(comm.topology().nodes == 2, "two nodes");
    shm_cases::run_all(comm, 4096, "local 2 nodes", 2);
  }));
}
