// The Manager over a device communicator (the emulated one, over each quorum's local-thread
// communicator): training state in device memory is healed from peers, bit-identical, and the
// state hash reads it back through the communicator's device queue. The same path the NCCL
// factory (ddp/nccl/manager_factory.hpp) takes on GPUs. Also: the replica's device queue
// (manager_options::device_queue) and a Bucketer over the Manager handing it its layout.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/any_communicator.hpp>
#include <ddp/bucketer.hpp>
#include <ddp/bucketing/fixed.hpp>
#include <ddp/bucketing/rebuild_once.hpp>
#include <ddp/testing/emulated.hpp>
#include <ddp/local.hpp>
#include <ddp/manager.hpp>
#include <ddp/stores/memory_store.hpp>

#include "../common/replicas.hpp"

using namespace std::chrono_literals;

namespace {

constexpr std::size_t dim = 40;  // several heal chunks of 16 bytes
constexpr float lr = 0.05f;

// Owns a quorum's host communicator and the emulated device communicator over it.
class device_comm {
 public:
  device_comm(ddp::local::communicator host, ddp::emulated_device::runtime& rt)
      : host_(std::make_unique<ddp::local::communicator>(std::move(host))), dev_(*host_, rt, 0) {}
  [[nodiscard]] int rank() const { return dev_.rank(); }
  [[nodiscard]] int size() const { return dev_.size(); }
  ddp::work allreduce(std::span<const ddp::tensor_view> ts, ddp::reduce_op op) { return dev_.allreduce(ts, op); }
  ddp::work broadcast(std::span<const ddp::tensor_view> ts, int root) { return dev_.broadcast(ts, root); }
  ddp::work allgather(ddp::tensor_view in, ddp::tensor_view out) { return dev_.allgather(in, out); }
  ddp::work reduce_scatter(ddp::tensor_view in, ddp::tensor_view out, ddp::reduce_op op) {
    return dev_.reduce_scatter(in, out, op);
  }
  ddp::work barrier() { return dev_.barrier(); }
  void abort() noexcept { dev_.abort(); }
  [[nodiscard]] ddp::device_queue device_queue() const { return dev_.device_queue(); }

 private:
  std::unique_ptr<ddp::local::communicator> host_;  // outlives dev_ (declared first)
  ddp::emulated_device::communicator dev_;
};
static_assert(ddp::device_communicator<device_comm>);

// Device memory of one replica's runtime, freed with it.
struct device_floats {
  ddp::emulated_device::runtime& rt;
  float* p;
  device_floats(ddp::emulated_device::runtime& r, std::size_t n)
      : rt(r), p(static_cast<float*>(rt.allocate(ddp::device::cuda(0), n * sizeof(float), {}))) {}
  ~device_floats() { rt.deallocate(p, {}); }
  device_floats(const device_floats&) = delete;
  device_floats& operator=(const device_floats&) = delete;
  [[nodiscard]] ddp::tensor_view view() const { return {p, dim, ddp::dtype::f32, ddp::device::cuda(0)}; }
  // Host -> device through the runtime, then a host synchronisation.
  void upload(const std::vector<float>& host) {
    const ddp::copy_region r{p, host.data(), host.size() * sizeof(float)};
    rt.copy(std::span<const ddp::copy_region>(&r, 1), {});
    sync();
  }
  [[nodiscard]] std::vector<float> download() {
    std::vector<float> host(dim);
    const ddp::copy_region r{host.data(), p, dim * sizeof(float)};
    rt.copy(std::span<const ddp::copy_region>(&r, 1), {});
    sync();
    return host;
  }
  void sync() {
    const auto e = rt.create_event(ddp::device::cuda(0));
    rt.record(e, {});
    rt.synchronize(e);
    rt.destroy_event(e);
  }
};

struct replica_result {
  std::string error;
  std::vector<float> params, momentum;
  std::int64_t step = 0;
  std::uint64_t heals = 0, healed_bytes = 0;
  std::vector<float> initial;
  std::vector<std::string> events;
};

std::vector<float> initial_params(int replica) {
  std::vector<float> p(dim);
  for (std::size_t k = 0; k < dim; ++k) p[k] = std::sin(1.3f * static_cast<float>(replica + 1) + static_cast<float>(k));
  return p;
}

struct cluster {
  ddp::stores::memory_store store;
  ddp::local::fabric fabric{ddp::local::options{.timeout = 2000ms, .faults = {}}};
  ddp::manager_options base = replica_test::scenario_options();  // many heal chunks; the hash reads chunk by chunk

  void run(int replica, std::int64_t steps, int want_members, replica_result& out) {
    // One runtime per replica, outliving the Manager and every communicator its factory builds.
    ddp::emulated_device::runtime rt(replica);
    device_floats params(rt, dim), momentum(rt, dim), grad(rt, dim);
    out.initial = initial_params(replica);
    params.upload(out.initial);
    momentum.upload(std::vector<float>(dim, 0.0f));
    ddp::training_state state;
    state.add(params.view()).add(momentum.view());
    auto opts = base;
    opts.replica_id = "r" + std::to_string(replica);
    try {
      ddp::Manager m(
          store,
          [this, &rt](const ddp::quorum_info& q) {
            return ddp::any_communicator(
                device_comm(fabric.connect("g" + std::to_string(q.generation), q.rank, q.size), rt));
          },
          state, opts);
      m.on_event([&](const ddp::manager_event& e) { out.events.push_back(e.text); });
      while (m.step() < steps || static_cast<int>(m.members().size()) < want_members) {
        if (m.step() > steps + 2000) throw std::runtime_error("the quorum never reached its size");
        m.start_quorum();
        if (m.device_queue().runtime != &rt) throw std::runtime_error("the Manager does not forward the device queue");
        std::this_thread::sleep_for(1ms);
        // This replica's gradient: a function of the parameters, its id and the step.
        std::vector<float> p = params.download(), g(dim);
        for (std::size_t k = 0; k < dim; ++k) {
          g[k] = p[k] -
                 std::cos(static_cast<float>(replica) + 0.3f * static_cast<float>(m.step()) + static_cast<float>(k));
        }
        grad.upload(g);
        const ddp::tensor_view gv = grad.view();
        m.allreduce(std::span<const ddp::tensor_view>(&gv, 1), ddp::reduce_op::sum).wait();
        if (m.should_commit()) {
          // The optimizer, on the host (emulated device memory is host memory, nothing pending).
          const auto sum = grad.download();
          auto mom = momentum.download();
          const float n = static_cast<float>(m.size());
          for (std::size_t k = 0; k < dim; ++k) {
            mom[k] = 0.9f * mom[k] + sum[k] / n;
            p[k] -= lr * mom[k];
          }
          params.upload(p);
          momentum.upload(mom);
        }
      }
      out.step = m.step();
      out.heals = m.stats().heals;
      out.healed_bytes = m.stats().healed_bytes;
    } catch (const std::exception& e) {
      out.error = e.what();
    }
    out.params = params.download();  // read back from the emulated device memory
    out.momentum = momentum.download();
  }
};

}  // namespace

TEST_CASE("Manager over a device communicator: a late replica heals its device state from the others",
          "[local][manager][device]") {
  constexpr int replicas = 3;
  constexpr std::int64_t steps = 8;
  cluster c;
  std::vector<replica_result> results(replicas);
  std::vector<std::thread> threads;
  for (int r = 0; r < replicas; ++r) {
    threads.emplace_back([&, r] {
      if (r == replicas - 1) std::this_thread::sleep_for(200ms);  // joins a running job
      c.run(r, steps, replicas, results[static_cast<std::size_t>(r)]);
    });
  }
  for (auto& t : threads) t.join();
  std::string history;
  for (int r = 0; r < replicas; ++r) {
    history += "r" + std::to_string(r) + ": " + results[static_cast<std::size_t>(r)].error + "\n";
    for (const auto& e : results[static_cast<std::size_t>(r)].events) history += "    " + e + "\n";
  }
  INFO(history);
  for (const auto& r : results) REQUIRE(r.error.empty());
  const auto& late = results.back();
  CHECK(late.heals >= 1);
  CHECK(late.healed_bytes >= 2 * dim * sizeof(float));
  CHECK(late.params != late.initial);
  for (const auto& r : results) {
    CHECK(r.step == results.front().step);
    CHECK(r.step >= steps);
    // Bit-identical device memory on every replica.
    CHECK(std::memcmp(r.params.data(), results.front().params.data(), dim * sizeof(float)) == 0);
    CHECK(std::memcmp(r.momentum.data(), results.front().momentum.data(), dim * sizeof(float)) == 0);
  }
}

TEST_CASE("Manager: device state over a host communicator is a usage_error naming the tensor",
          "[local][manager][device]") {
  ddp::stores::memory_store store;
  ddp::local::fabric fabric;
  ddp::emulated_device::runtime rt(0);
  device_floats params(rt, dim);
  std::vector<double> host(4, 1.0);
  ddp::training_state state;
  state.add(host).add(params.view());
  ddp::manager_options opts;
  opts.replica_id = "solo";
  opts.quorum_timeout = 20s;
  opts.settle = 10ms;
  ddp::Manager m(
      store,
      [&](const ddp::quorum_info& q) {
        return ddp::any_communicator(fabric.connect("g" + std::to_string(q.generation), q.rank, q.size));
      },
      state, opts);
  const auto start = std::chrono::steady_clock::now();
  try {
    m.start_quorum();
    FAIL("no error");
  } catch (const ddp::usage_error& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(what.find("state tensor 1 is on cuda:0") != std::string::npos);
    CHECK(what.find("no device queue") != std::string::npos);
  }
  CHECK(std::chrono::steady_clock::now() - start < 10s);  // not retried until the quorum timeout
  CHECK(m.device_queue().runtime == nullptr);
}

TEST_CASE("Manager: a quorum's communicator off the replica's device queue is a usage_error naming both",
          "[local][manager][device]") {
  ddp::stores::memory_store store;
  ddp::local::fabric fabric;
  ddp::emulated_device::runtime rt(0);
  const ddp::device_stream replica = rt.create_stream(ddp::device::cuda(0));
  ddp::training_state state;
  std::vector<double> host(4, 1.0);
  state.add(host);
  ddp::manager_options opts;
  opts.replica_id = "solo";
  opts.quorum_timeout = 20s;
  opts.settle = 10ms;
  opts.device_queue = {&rt, replica, ddp::device::cuda(0)};
  ddp::Manager m(
      store,
      [&](const ddp::quorum_info& q) {  // a stream of its own, not the replica's
        return ddp::any_communicator(
            device_comm(fabric.connect("g" + std::to_string(q.generation), q.rank, q.size), rt));
      },
      state, opts);
  CHECK(m.device_queue().stream == replica);  // before any quorum: a Bucketer can be built on it
  const auto start = std::chrono::steady_clock::now();
  try {
    m.start_quorum();
    FAIL("no error");
  } catch (const ddp::usage_error& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(what.find("manager_options::device_queue") != std::string::npos);
    CHECK(what.find("another stream") != std::string::npos);
  }
  CHECK(std::chrono::steady_clock::now() - start < 10s);  // not retried until the quorum timeout
  rt.destroy_stream(replica);
}

TEST_CASE(
    "Bucketer over a Manager: built before the first quorum with the default options, it hands the Manager "
    "its layout; a rebuilding layout is refused",
    "[local][manager][device]") {
  ddp::stores::memory_store store;
  ddp::local::fabric fabric;
  std::vector<double> p(dim, 1.0), g(dim, 0.5), p2(3, 1.0), g2(3, 0.5);
  ddp::training_state state;
  state.add(p);
  ddp::manager_options opts = replica_test::scenario_options();
  opts.min_replicas = 1;
  opts.replica_id = "solo";
  ddp::Manager m(
      store,
      [&](const ddp::quorum_info& q) {
        return ddp::any_communicator(fabric.connect("g" + std::to_string(q.generation), q.rank, q.size));
      },
      state, opts);
  {
    ddp::Bucketer<ddp::bucketing::rebuild_once> rebuilding(m);
    rebuilding.add(p2, g2);
    try {
      rebuilding.build();
      FAIL("no error");
    } catch (const ddp::usage_error& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find("rebuilds the layout") != std::string::npos);
    }
  }
  ddp::Bucketer<ddp::bucketing::fixed> grads(m);  // check_layout: true, yet no collective before a quorum
  grads.add(p, g);
  m.attach(grads);
  m.start_quorum();
  grads.mark_ready(0);
  grads.finalize();
  CHECK(m.should_commit());
  CHECK(g[0] == 0.5);  // one member: its own gradient
}

TEST_CASE(
    "Manager: a Bucketer built after the first quorum checks its layout over the quorum; resume in a live "
    "store does nothing",
    "[local][manager][device]") {
  ddp::stores::memory_store store;
  ddp::local::fabric fabric;
  std::vector<double> p(dim, 1.0), g(dim, 0.5);
  ddp::training_state state;
  state.add(p);
  ddp::manager_options opts = replica_test::scenario_options();
  opts.min_replicas = 1;
  opts.replica_id = "first";
  const auto factory = [&](const ddp::quorum_info& q) {
    return ddp::any_communicator(fabric.connect("g" + std::to_string(q.generation), q.rank, q.size));
  };
  ddp::Manager m(store, factory, state, opts);
  ddp::Bucketer<ddp::bucketing::fixed> grads(m);
  grads.add(p, g);
  m.start_quorum();                 // not built yet: mark_ready builds it, and its check runs over the quorum
  CHECK_FALSE(m.adopt_layout(42));  // too late for the Manager to take a layout
  grads.mark_ready(0);
  grads.finalize();
  CHECK(m.should_commit());
  CHECK(g[0] == 0.5);
  std::vector<double> p2(dim, 2.0);
  ddp::training_state state2;
  state2.add(p2);
  opts.replica_id = "second";
  ddp::Manager late(store, factory, state2, opts);
  CHECK_FALSE(late.resume(40));  // the store holds a live job: its state wins
  CHECK(late.step() == 0);
}
