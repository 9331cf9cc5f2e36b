// ddp's one averaging rule over threads: every averaging component (Bucketer paths, hooks,
// BufferReducer's mean, the Manager's comm hook) gives the same finite bits for f16 inputs near
// 65504, over the local backend, the shared-memory backend on top of it, and a Manager's quorum.
#include <array>
#include <chrono>
#include <exception>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/any_communicator.hpp>
#include <ddp/bucketer.hpp>
#include <ddp/bucketing/size_capped.hpp>
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

namespace {

// n replicas of a Manager whose factory builds a local communicator, or (shm) the shared-memory
// backend over one; each runs every averaging caller plus the Manager's comm hook.
void manager_cases(int n, bool shm) {
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
              auto local = fabric.connect("g" + std::to_string(q.generation), q.rank, q.size);
              if (!shm) return ddp::any_communicator(std::move(local));
              return ddp::any_communicator(
                  ddp::shm::communicator<ddp::local::communicator>(std::move(local), {.chunk_bytes = 4096}));
            },
            state, opts);
        mgr.start_quorum();
        SUITE_EXPECT(mgr.size() == n, "quorum of " << mgr.size() << ", want " << n);
        // The Manager reports what the quorum's communicator has: the shared-memory backend's
        // pre-multiplied sum and staging, nothing over the plain local backend.
        const ddp::communicator_ref ref(mgr);
        SUITE_EXPECT(ref.has_premul_sum() == shm, "has_premul_sum() through the Manager: " << ref.has_premul_sum());
        SUITE_EXPECT(ref.stages_input() == shm, "stages_input() through the Manager: " << ref.stages_input());
        const average_cases::caller hook = [&mgr](ddp::communicator_ref c, ddp::dtype t) {
          return average_cases::through_bucketer(c, t, false,
                                                 [&mgr](auto& b) { b.register_comm_hook(mgr.comm_hook()); });
        };
        average_cases::every_caller_same_bits(mgr, shm ? "Manager over shm" : "Manager over local",
                                              {{"Bucketer + Manager::comm_hook", hook}});
        SUITE_EXPECT(mgr.should_commit(), "the step commits");
      } catch (...) {
        std::lock_guard lk(m);
        if (!error) error = std::current_exception();
      }
    });
  }
  for (auto& t : replicas) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace

TEST_CASE("averaging: the Manager's comm hook gives the bits of every other caller", "[local][average][manager]") {
  for (int n : {2, 3, 4}) {
    INFO("replicas " << n);
    try {
      manager_cases(n, false);
    } catch (const std::exception& e) {
      FAIL(e.what());
    }
  }
}

TEST_CASE("averaging: a Manager over shared memory averages through its pre-multiplied sum, same bits",
          "[local][average][manager][shm]") {
  for (int n : {2, 3}) {
    INFO("replicas " << n);
    try {
      manager_cases(n, true);
    } catch (const std::exception& e) {
      FAIL(e.what());
    }
  }
}

TEST_CASE("averaging: any_communicator reports the capabilities of what it owns", "[local][average]") {
  ddp::any_communicator empty;
  CHECK_FALSE(ddp::communicator_ref(empty).has_premul_sum());
  CHECK_FALSE(ddp::communicator_ref(empty).stages_input());
  REQUIRE_NOTHROW(ddp::local::run(2, [](ddp::local::communicator& c) {
    ddp::any_communicator plain(std::move(c));
    const ddp::communicator_ref ref(plain);
    SUITE_EXPECT(!ref.has_premul_sum() && !ref.stages_input(), "the local backend has neither capability");
    std::vector<float> v(8, 1.0f);
    const ddp::tensor_view t = ddp::view(v);
    bool refused = false;
    try {
      (void)ref.allreduce_premul_sum(std::span<const ddp::tensor_view>(&t, 1), 0.5);
    } catch (const ddp::usage_error& e) {
      refused = std::string(e.what()).find("no pre-multiplied sum") != std::string::npos;
    }
    SUITE_EXPECT(refused, "a pre-multiplied sum without the capability is a usage_error");
  }));
  REQUIRE_NOTHROW(ddp::local::run(2, [](ddp::local::communicator& c) {
    ddp::any_communicator owned(ddp::shm::communicator<ddp::local::communicator>(std::move(c), {.chunk_bytes = 4096}));
    const ddp::communicator_ref ref(owned);
    SUITE_EXPECT(ref.has_premul_sum() && ref.stages_input(), "the shared-memory backend's capabilities forwarded");
    // A Bucketer with its defaults takes the direct path through the wrapper, as over the backend.
    std::vector<float> g(100, 1.0f);
    ddp::Bucketer<ddp::bucketing::size_capped> b(owned);
    b.add(g);
    b.build();
    SUITE_EXPECT(b.direct(), "the Bucketer over any_communicator(shm) took the direct path");
    b.mark_ready(0);
    b.finalize();
    SUITE_EXPECT(g[0] == 1.0f && g[99] == 1.0f, "the average of ones is one, got " << g[0]);
    average_cases::run_all(owned, "any_communicator over shm");
  }));
}
