// ddp's one averaging rule over threads: every averaging component (Bucketer paths, hooks,
// BufferReducer's mean, the Manager's comm hook) gives the same finite bits for f16 inputs near
// 65504, over the local backend, the shared-memory backend on top of it, and a Manager's quorum.
#include <array>
#include <chrono>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/local.hpp>
#include <ddp/manager.hpp>
#include <ddp/shm.hpp>
#include <ddp/stores/memory_store.hpp>

#include "average_cases.hpp"

using namespace std::chrono_literals;

TEST_CASE("averaging: every caller, the same bits, no f16 overflow (threads)", "[local][average]") {
  for (int n : {1, 2, 3, 4}) {
    INFO("ranks " << n);
    REQUIRE_NOTHROW(ddp::local::run(n, [](ddp::local::communicator& c) { average_cases::run_all(c, "local"); }));
  }
}

TEST_CASE("averaging: every caller over the shared-memory backend, one node and two", "[local][average][shm]") {
  using shm_local = ddp::shm::communicator<ddp::local::communicator>;
  for (int n : {2, 3}) {
    INFO("ranks " << n);
    REQUIRE_NOTHROW(ddp::local::run(n, [](ddp::local::communicator& c) {
      shm_local comm(std::move(c), {.chunk_bytes = 4096});
      average_cases::run_all(comm, "shm");
    }));
  }
  const std::vector<int> labels{0, 0, 1, 1};
  ddp::local::world leaders(2);
  REQUIRE_NOTHROW(ddp::local::run(4, [&](ddp::local::communicator& c) {
    shm_local comm(std::move(c), {.chunk_bytes = 4096, .node_of_rank = labels},
                   [&](const ddp::shm::node_topology& t) { return std::optional(leaders.rank(t.node)); });
    average_cases::run_all(comm, "shm, 2 nodes");
  }));
}

TEST_CASE("averaging: the Manager's comm hook gives the bits of every other caller", "[local][average][manager]") {
  for (int n : {2, 3, 4}) {
    INFO("replicas " << n);
    ddp::stores::memory_store store;
    ddp::local::fabric fabric(ddp::local::options{.timeout = 20s, .faults = {}});
    std::mutex m;
    std::exception_ptr error;
    std::vector<std::thread> replicas;
    for (int r = 0; r < n; ++r) {
      replicas.emplace_back([&, r] {
        try {
          std::vector<double> p(4, 0.0);
          ddp::training_state state;
          state.add(p);
          ddp::manager_options opts;
          opts.replica_id = "replica-" + std::to_string(r);
          opts.min_replicas = n;
          opts.quorum_timeout = 30s;
          opts.heartbeat_interval = 10ms;
          opts.heartbeat_timeout = 2s;
          opts.settle = 50ms;
          ddp::Manager mgr(
              store,
              [&](const ddp::quorum_info& q) {
                return ddp::any_communicator(fabric.connect("g" + std::to_string(q.generation), q.rank, q.size));
              },
              state, opts);
          mgr.start_quorum();
          SUITE_EXPECT(mgr.size() == n, "quorum of " << mgr.size() << ", want " << n);
          const average_cases::caller hook = [&mgr](ddp::communicator_ref c, ddp::dtype t) {
            return average_cases::through_bucketer(c, t, false,
                                                   [&mgr](auto& b) { b.register_comm_hook(mgr.comm_hook()); });
          };
          average_cases::every_caller_same_bits(mgr, "Manager over local", {{"Bucketer + Manager::comm_hook", hook}});
          SUITE_EXPECT(mgr.should_commit(), "the step commits");
        } catch (...) {
          std::lock_guard lk(m);
          if (!error) error = std::current_exception();
        }
      });
    }
    for (auto& t : replicas) t.join();
    if (error) {
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        FAIL(e.what());
      }
    }
  }
}
