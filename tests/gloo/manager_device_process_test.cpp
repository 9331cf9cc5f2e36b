// The Manager with device gradients over real processes (issue #45): a Bucketer built over the
// Manager before the first quorum keeps its device buckets on the replica's stream
// (manager_options::device_queue) while every quorum's communicator (the emulated device over
// gloo) runs on that stream. Three replicas: "h" trains on the host (the host reference), "d1" and
// "d2" on the emulated device, with device gradients and device training state; d2 is SIGKILLed
// in the middle of a step and restarted fresh. Every committed step has one state hash on every
// replica that committed it (host and device alike), the restarted d2 heals its device state and
// ends bit-identical, and a steady device step makes no host synchronisation but its commit vote.
#include <signal.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/bucketer.hpp>
#include <ddp/bucketing/fixed.hpp>
#include <ddp/gloo.hpp>
#include <ddp/manager.hpp>
#include <ddp/staged/owning_communicator.hpp>
#include <ddp/stores/file_store.hpp>
#include <ddp/testing/emulated.hpp>

#include "manager_trainer.hpp"
#include "process_group.hpp"

using namespace std::chrono_literals;
namespace st = ddp::stores;
using gloo_test::temp_dir;

namespace {

constexpr std::size_t dim = gloo_test::dim;
const ddp::device gpu0 = ddp::device::cuda(0);

// A quorum's communicator of a device replica: the emulated device over gloo, on the replica's
// stream (it outlives the communicator; the gloo communicator is owned here, destroyed last).
class device_comm {
 public:
  device_comm(ddp::gloo::communicator host, ddp::emulated_device::runtime& rt, ddp::device_stream stream)
      : host_(std::make_unique<ddp::gloo::communicator>(std::move(host))),
        dev_(std::make_unique<ddp::emulated_device::communicator>(
            *host_, rt, 0, ddp::emulated_device::options{.timeout = 5s, .stream = stream})) {}
  [[nodiscard]] int rank() const { return dev_->rank(); }
  [[nodiscard]] int size() const { return dev_->size(); }
  ddp::work allreduce(std::span<const ddp::tensor_view> ts, ddp::reduce_op op) { return dev_->allreduce(ts, op); }
  ddp::work allreduce_premul_sum(std::span<const ddp::tensor_view> ts, double f) {
    return dev_->allreduce_premul_sum(ts, f);
  }
  ddp::work broadcast(std::span<const ddp::tensor_view> ts, int root) { return dev_->broadcast(ts, root); }
  ddp::work allgather(ddp::tensor_view in, ddp::tensor_view out) { return dev_->allgather(in, out); }
  ddp::work reduce_scatter(ddp::tensor_view in, ddp::tensor_view out, ddp::reduce_op op) {
    return dev_->reduce_scatter(in, out, op);
  }
  ddp::work barrier() { return dev_->barrier(); }
  void abort() noexcept { dev_->abort(); }
  [[nodiscard]] ddp::device_queue device_queue() const { return dev_->device_queue(); }

 private:
  std::unique_ptr<ddp::gloo::communicator> host_;
  std::unique_ptr<ddp::emulated_device::communicator> dev_;  // declared last: destroyed first
};
static_assert(ddp::device_communicator<device_comm>);
static_assert(ddp::device_communicator<ddp::staged::owning_communicator<ddp::gloo::communicator>>);

// One replica's parameters, momentum and gradient: host vectors, or device memory of `rt`.
class replica_memory {
 public:
  replica_memory(ddp::emulated_device::runtime* rt, const std::string& id)
      : rt_(rt), host_(3, std::vector<double>(dim)) {
    for (std::size_t k = 0; k < dim; ++k) {  // a different start per replica: the first quorum heals
      host_[0][k] = static_cast<double>(std::hash<std::string>{}(id) % 13) + 0.1 * static_cast<double>(k);
      host_[1][k] = host_[2][k] = 0.0;
    }
    if (rt_ == nullptr) return;
    for (int i = 0; i < 3; ++i) {
      dev_[i] = static_cast<double*>(rt_->allocate(gpu0, dim * sizeof(double), {}));
      const ddp::copy_region r{dev_[i], host_[static_cast<std::size_t>(i)].data(), dim * sizeof(double)};
      rt_->copy(std::span<const ddp::copy_region>(&r, 1), {});
    }
    sync({});
  }
  ~replica_memory() {
    if (rt_ == nullptr) return;
    for (double* p : dev_) rt_->deallocate(p, {});
  }
  replica_memory(const replica_memory&) = delete;
  replica_memory& operator=(const replica_memory&) = delete;

  // 0: parameters, 1: momentum, 2: gradient; on the device or the host.
  [[nodiscard]] double* data(int i) { return rt_ ? dev_[i] : host_[static_cast<std::size_t>(i)].data(); }
  [[nodiscard]] ddp::tensor_view view(int i) {
    return {data(i), dim, ddp::dtype::f64, rt_ ? gpu0 : ddp::device::host()};
  }
  // The parameters and momentum on the host (a host synchronisation on `stream` for a device replica).
  std::vector<std::vector<double>> read(ddp::device_stream stream) {
    if (rt_ == nullptr) return {host_[0], host_[1]};
    std::vector<std::vector<double>> out(2, std::vector<double>(dim));
    const ddp::copy_region r[] = {{out[0].data(), dev_[0], dim * sizeof(double)},
                                  {out[1].data(), dev_[1], dim * sizeof(double)}};
    rt_->copy(r, stream);
    sync(stream);
    return out;
  }

 private:
  void sync(ddp::device_stream stream) {
    const auto e = rt_->create_event(gpu0);
    rt_->record(e, stream);
    rt_->synchronize(e);
    rt_->destroy_event(e);
  }
  ddp::emulated_device::runtime* rt_;
  std::vector<std::vector<double>> host_;
  double* dev_[3] = {nullptr, nullptr, nullptr};
};

// How a device replica's quorum communicator reaches the others.
enum class transport { emulated, staged };

struct replica_plan {
  std::string id;
  bool on_device = false;
  transport over = transport::emulated;
  std::int64_t start_after = 0;  // waits until the job committed this many steps
  std::int64_t kill_at = -1;     // SIGKILLs itself after start_quorum() of this step
};

// Trains until step `last` is committed with every one of `ids` in the quorum; records commits
// and quorums as manager_trainer.hpp does, and at the end "syncs/<id>" (the most host
// synchronisations in the gradient phase of a step and in its commit vote, steps without a quorum
// change) and "heals/<id>".
void train(const std::filesystem::path& dir, const replica_plan& plan, std::int64_t last) {
  st::file_store store(dir);
  st::file_store records(dir);
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (records.add("progress", 0) < plan.start_after) {
    CHILD_CHECK(std::chrono::steady_clock::now() < deadline, "the job never reached step " << plan.start_after);
    std::this_thread::sleep_for(5ms);
  }
  std::unique_ptr<ddp::emulated_device::runtime> rt;
  ddp::device_stream replica_stream{}, compute{};
  if (plan.on_device) {
    rt = std::make_unique<ddp::emulated_device::runtime>(0, 20s);
    replica_stream = rt->create_stream(gpu0);
    compute = rt->create_stream(gpu0);
  }
  replica_memory mem(rt.get(), plan.id);
  ddp::training_state state;
  state.add(mem.view(0)).add(mem.view(1));
  ddp::manager_options opts;
  opts.replica_id = plan.id;
  opts.min_replicas = 2;
  opts.heartbeat_interval = 20ms;
  opts.heartbeat_timeout = 600ms;
  opts.step_timeout = 5s;
  opts.settle = 20ms;
  opts.quorum_timeout = 20s;
  opts.heal_chunk_bytes = 128;
  opts.progress = {};
  if (plan.on_device) opts.device_queue = {rt.get(), replica_stream, gpu0};
  ddp::gloo::options go;
  go.timeout = 3s;
  go.connect_timeout = 3s;
  ddp::Manager m(
      store,
      [&](const ddp::quorum_info& q) {
        ddp::gloo::communicator host(q.store, q.rank, q.size, go);
        if (!plan.on_device) return ddp::any_communicator(std::move(host));
        if (plan.over == transport::staged) {  // the library's owning wrapper (what the docs show)
          return ddp::any_communicator(ddp::staged::owning_communicator<ddp::gloo::communicator>(
              std::move(host), *rt, gpu0, {.timeout = 5s, .stream = replica_stream}));
        }
        return ddp::any_communicator(device_comm(std::move(host), *rt, replica_stream));
      },
      state, opts);
  bool new_quorum = true;
  m.on_event([&](const ddp::manager_event& e) {
    if (e.what != ddp::manager_event::kind::quorum) return;
    new_quorum = true;
    std::string members;
    for (const auto& x : m.members()) members += x + ",";
    records.set("q/" + std::to_string(m.generation()) + "/" + plan.id, ddp::as_bytes(members));
  });
  // Built before the first quorum: the Manager's queue is the replica's stream already.
  ddp::Bucketer<ddp::bucketing::fixed> grads(m);
  grads.add(mem.view(0), mem.view(2));
  if (plan.on_device) grads.set_compute_stream(compute);
  m.attach(grads);
  std::size_t most_grad_syncs = 0, most_vote_syncs = 0;
  const auto syncs = [&] { return rt ? rt->host_syncs() : std::size_t{0}; };
  for (int guard = 0;; ++guard) {
    CHILD_CHECK(guard < 3000, "no end after 3000 steps");
    new_quorum = false;
    m.start_quorum();
    const std::int64_t s = m.step();
    if (s == plan.kill_at) ::raise(SIGKILL);
    std::this_thread::sleep_for(2ms);
    double* p = mem.data(0);
    double* g = mem.data(2);
    const auto gradient = [p, g, s] {
      for (std::size_t k = 0; k < dim; ++k)
        g[k] = p[k] - std::sin(0.3 * static_cast<double>(s) + static_cast<double>(k));
    };
    const std::size_t before = syncs();
    if (rt) {
      rt->launch(compute, gradient);  // the backward "kernel", on the compute stream
    } else {
      gradient();
    }
    grads.mark_ready(0);
    grads.finalize();
    const std::size_t after_grads = syncs();
    const bool commit = m.should_commit();
    if (!new_quorum) {
      most_grad_syncs = std::max(most_grad_syncs, after_grads - before);
      most_vote_syncs = std::max(most_vote_syncs, syncs() - after_grads);
    }
    if (!commit) continue;
    double* mom = mem.data(1);
    const auto optimizer = [p, mom, g] {
      for (std::size_t k = 0; k < dim; ++k) {
        mom[k] = 0.9 * mom[k] + g[k];
        p[k] -= 0.1 * mom[k];
      }
    };
    if (rt) {
      rt->launch(compute, optimizer);  // after the averaged gradient: finalize ordered the streams
    } else {
      optimizer();
    }
    auto now = mem.read(compute);  // bookkeeping of the test, outside the counted phases
    gloo_test::record_commit(records, s, plan.id, m.members(), now[0], now[1]);
    gloo_test::record_progress(records, m.step());
    if (m.step() > last && m.members().size() == 3) break;
  }
  records.set("syncs/" + plan.id,
              ddp::as_bytes(std::to_string(most_grad_syncs) + " " + std::to_string(most_vote_syncs)));
  records.set("heals/" + plan.id, ddp::as_bytes(std::to_string(m.stats().heals)));
}

}  // namespace

namespace {

void run_job(transport over) {
  temp_dir dir("manager-device");
  constexpr std::int64_t last = 30;
  const std::vector<replica_plan> plans{{.id = "h"},
                                        {.id = "d1", .on_device = true, .over = over},
                                        {.id = "d2", .on_device = true, .over = over, .kill_at = 8},
                                        {.id = "d2", .on_device = true, .over = over, .start_after = 12}};
  gloo_test::process_group group(
      4, [&](int rank, const gloo_test::reporter&) { train(dir.path(), plans[static_cast<std::size_t>(rank)], last); });
  const auto outs = group.wait_all(90s);
  INFO(gloo_test::describe_all(outs));
  CHECK((!outs[2].exited && outs[2].signal == SIGKILL));
  CHECK(outs[0].ok());
  CHECK(outs[1].ok());
  CHECK(outs[3].ok());
  const std::vector<std::string> ids{"h", "d1", "d2"};
  // One (members, state hash) per committed step, host and device replicas alike.
  gloo_test::check_records(dir.path(), ids, last, 400);
  st::file_store records(dir.path());
  // d2 was gone for some steps, then healed: the last steps have the same hash on all three.
  const std::int64_t end = gloo_test::first_uncommitted(records, ids);
  REQUIRE(end > last);
  std::string at_end;
  for (const auto& id : ids) {
    const std::string v = gloo_test::text_of(records.get("c/" + std::to_string(end - 1) + "/" + id));
    INFO(id << " at step " << end - 1);
    REQUIRE(!v.empty());
    if (at_end.empty()) at_end = v;
    CHECK(v == at_end);
  }
  CHECK(gloo_test::text_of(records.get("c/9/d2")).empty());  // it missed the steps after its death
  CHECK(std::stoi(gloo_test::text_of(records.get("heals/d2"))) >= 1);
  // A steady device step: no host synchronisation from the gradient to finalize(); the vote's only.
  for (const std::string id : {"d1", "d2"}) {
    const std::string v = gloo_test::text_of(records.get("syncs/" + id));
    INFO(id << ": most host syncs in a step's gradient phase, in its vote: " << v);
    CHECK(v.substr(0, v.find(' ')) == "0");
    CHECK(std::stoi(v.substr(v.find(' ') + 1)) <= 1);
  }
}

}  // namespace

TEST_CASE(
    "Manager with device gradients over gloo processes: a device replica SIGKILLed mid-step, restarted, "
    "heals bit-identical to the host replica",
    "[manager][device]") {
  run_job(transport::emulated);
}

TEST_CASE(
    "Manager with device gradients over the staged communicator (host copies over gloo behind gates): a device "
    "replica SIGKILLed mid-step, restarted, heals bit-identical to the host replica",
    "[manager][device][staged]") {
  run_job(transport::staged);
}
