#pragma once
// The components over device memory, run on the emulated device (ddp/testing/emulated.hpp) over
// any host communicator: threads (device_components_local_test.cpp) and MPI processes
// (device_components_mpi_test.cpp). Emulated device memory is host memory, so a case reads its
// results directly once it has synchronised with the stream that produced them. Failures throw
// suite::suite_failure.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ddp/bucketer.hpp>
#include <ddp/buffer_reducer.hpp>
#include <ddp/staged/communicator.hpp>
#include <ddp/testing/emulated.hpp>
#include <ddp/join.hpp>
#include <ddp/strategies/allreduce.hpp>

#include "../common/collective_suite.hpp"

namespace device_cases {

namespace emu = ddp::emulated_device;

// Rank r's value of gradient g, element k, in step t: exact in f32, differs by rank and step.
inline float grad_value(int r, std::size_t g, std::size_t k, int t) {
  return static_cast<float>((static_cast<std::size_t>(r) * 5 + g * 3 + k + static_cast<std::size_t>(t)) % 11) +
         0.25F * static_cast<float>(r % 2);
}
inline float average_of(int size, std::size_t g, std::size_t k, int t) {
  double sum = 0;
  for (int r = 0; r < size; ++r) sum += grad_value(r, g, k, t);
  return static_cast<float>(sum / size);
}
// Equal up to the rounding of f32 (the rule multiplies by 1/size first, backends sum in their order).
inline bool close(float got, float want) { return std::fabs(got - want) <= 1e-5F * (1.0F + std::fabs(want)); }

// One rank's emulated device: a runtime, the device communicator over `host` (`Comm`: the
// emulated device communicator, or the staged one), a compute stream.
template <class Comm>
struct basic_rig {
  emu::runtime rt;
  Comm comm;
  ddp::device_stream compute;
  basic_rig(ddp::communicator_ref host, int ordinal = 0)
      : rt(host.rank()), comm(make(host, rt, ordinal)), compute(rt.create_stream(ddp::device::cuda(ordinal))) {}
  basic_rig(const basic_rig&) = delete;
  basic_rig& operator=(const basic_rig&) = delete;
  ~basic_rig() {
    rt.run_ready();
    rt.destroy_stream(compute);
  }
  static Comm make(ddp::communicator_ref host, emu::runtime& rt, int ordinal) {
    if constexpr (std::is_same_v<Comm, emu::communicator>) {
      return Comm(host, rt, ordinal);
    } else {
      return Comm(host, rt, ddp::device::cuda(ordinal));
    }
  }

  // Waits on the host for everything enqueued on the compute stream so far.
  void sync_compute() {
    const ddp::device_event e = rt.create_event(ddp::device::cuda(0));
    rt.record(e, compute);
    rt.synchronize(e);
    rt.destroy_event(e);
  }
};
using rig = basic_rig<emu::communicator>;
using staged_rig = basic_rig<ddp::staged::communicator>;

// `n` floats of device memory, released with the rig's runtime.
struct device_floats {
  emu::runtime* rt;
  float* data;
  std::size_t count;
  device_floats(emu::runtime& r, std::size_t n, ddp::device_stream s)
      : rt(&r), data(static_cast<float*>(r.allocate(ddp::device::cuda(0), n * sizeof(float), s))), count(n) {}
  device_floats(const device_floats&) = delete;
  device_floats& operator=(const device_floats&) = delete;
  device_floats(device_floats&& o) noexcept : rt(o.rt), data(std::exchange(o.data, nullptr)), count(o.count) {}
  ~device_floats() {
    if (data != nullptr) rt->deallocate(data, ddp::device_stream{});
  }
  [[nodiscard]] ddp::tensor_view view() const { return {data, count, ddp::dtype::f32, ddp::device::cuda(0)}; }
};

template <class F>
void expect_usage_error(F&& f, const std::string& needle, const std::string& what) {
  try {
    f();
  } catch (const ddp::usage_error& e) {
    SUITE_EXPECT(std::string(e.what()).find(needle) != std::string::npos,
                 what << ": the error should say '" << needle << "', it says: " << e.what());
    return;
  }
  SUITE_EXPECT(false, what << ": no usage_error");
}

// Device gradients through the Bucketer's copy path, three steps: while the compute stream is
// held (the backward kernels have not run), nothing may read the gradients, so after mark_ready
// and finalize the buckets and gradients are untouched; the step needs no host sync; once the
// stream runs, the gradients hold the average.
template <class Rig = rig>
void bucketer_copy_path(ddp::communicator_ref host) {
  Rig d(host);
  const int rank = host.rank();
  const std::vector<std::size_t> sizes{7, 300, 64, 1, 129};
  std::vector<device_floats> grads;
  for (std::size_t n : sizes) grads.emplace_back(d.rt, n, d.compute);
  ddp::Bucketer<> b(d.comm, ddp::bucketing::size_capped{.cap_bytes = 512, .small_bucket_bytes = 256});
  for (const auto& g : grads) b.add(g.view());
  b.set_compute_stream(d.compute);
  b.build();  // its layout check is a host collective: staged, one host sync
  SUITE_EXPECT(b.layout().buckets.size() >= 2, "several buckets: " << b.layout().buckets.size());

  for (int t = 0; t < 3; ++t) {
    d.sync_compute();
    for (auto& g : grads) std::fill(g.data, g.data + g.count, -1.0F);  // not yet computed
    const std::size_t syncs = d.rt.host_syncs();
    d.rt.hold(d.compute);
    d.rt.launch(d.compute, [&, t] {  // the backward pass's kernels
      for (std::size_t g = 0; g < grads.size(); ++g) {
        for (std::size_t k = 0; k < grads[g].count; ++k) grads[g].data[k] = grad_value(rank, g, k, t);
      }
    });
    for (std::size_t i = grads.size(); i-- > 0;) b.mark_ready(i);
    b.finalize();
    d.rt.run_ready();
    SUITE_EXPECT(d.rt.host_syncs() == syncs,
                 "step " << t << ": the step synchronised the host " << d.rt.host_syncs() - syncs << " time(s)");
    for (const auto& g : grads) {
      SUITE_EXPECT(g.data[0] == -1.0F, "step " << t << ": a gradient changed before its kernel ran");
    }
    if (t == 1) {  // the compute stream must wait for the communicator's stream: hold that one
      const ddp::device_stream comm_stream = d.comm.device_queue().stream;
      d.rt.hold(comm_stream);
      d.rt.release(d.compute);
      expect_usage_error([&] { d.sync_compute(); }, "held", "finalize() makes the compute stream wait");
      d.rt.release(comm_stream);
    } else {
      d.rt.release(d.compute);
    }
    d.sync_compute();  // the compute stream waited for the averages
    for (std::size_t g = 0; g < grads.size(); ++g) {
      for (std::size_t k = 0; k < grads[g].count; ++k) {
        const float want = average_of(host.size(), g, k, t);
        SUITE_EXPECT(close(grads[g].data[k], want),
                     "step " << t << ", gradient " << g << "[" << k << "]: " << grads[g].data[k] << ", want " << want);
      }
    }
    SUITE_EXPECT(b.last_step().iteration == static_cast<std::uint64_t>(t + 1), "iteration count");
    for (const auto& bs : b.last_step().buckets) {
      SUITE_EXPECT(bs.path == ddp::bucket_path::device,
                   "device buckets take the device path, not " << ddp::name_of(bs.path));
    }
  }
}

// The trainer passes the event that produced each gradient (recorded on a stream of its own), and
// waits with finalize_blocking(): the averages are there when it returns.
template <class Rig = rig>
void bucketer_events_and_blocking(ddp::communicator_ref host) {
  Rig d(host);
  const int rank = host.rank();
  ddp::device_stream side = d.rt.create_stream(ddp::device::cuda(0));
  std::vector<device_floats> grads;
  for (std::size_t n : {33U, 5U, 70U}) grads.emplace_back(d.rt, n, side);
  std::vector<ddp::device_event> produced;
  for (std::size_t i = 0; i < grads.size(); ++i) produced.push_back(d.rt.create_event(ddp::device::cuda(0)));
  {
    ddp::Bucketer<> b(d.comm, ddp::bucketing::size_capped{.cap_bytes = 128, .small_bucket_bytes = 128});
    for (const auto& g : grads) b.add(g.view());
    b.build();
    for (int t = 0; t < 2; ++t) {
      d.rt.hold(side);
      for (std::size_t i = grads.size(); i-- > 0;) {
        d.rt.launch(side, [&, i, t] {
          for (std::size_t k = 0; k < grads[i].count; ++k) grads[i].data[k] = grad_value(rank, i, k, t);
        });
        d.rt.record(produced[i], side);
        b.mark_ready(i, produced[i]);
      }
      d.rt.release(side);
      const std::size_t syncs = d.rt.host_syncs();
      b.finalize_blocking();
      SUITE_EXPECT(d.rt.host_syncs() > syncs, "finalize_blocking waits on the host");
      for (std::size_t g = 0; g < grads.size(); ++g) {
        for (std::size_t k = 0; k < grads[g].count; ++k) {
          SUITE_EXPECT(close(grads[g].data[k], average_of(host.size(), g, k, t)),
                       "step " << t << ", gradient " << g << "[" << k << "]: " << grads[g].data[k]);
        }
      }
    }
  }
  for (auto e : produced) d.rt.destroy_event(e);
  grads.clear();
  d.rt.run_ready();
  d.rt.destroy_stream(side);
}

// Zero-copy: the trainer's kernels write into gradient_view(i), which is device memory of the bucket.
template <class Rig = rig>
void bucketer_zero_copy(ddp::communicator_ref host) {
  Rig d(host);
  const int rank = host.rank();
  std::vector<device_floats> shapes;  // registered for their shapes only
  for (std::size_t n : {10U, 20U, 30U}) shapes.emplace_back(d.rt, n, d.compute);
  ddp::Bucketer<> b(d.comm, ddp::bucketing::size_capped{.cap_bytes = 64, .small_bucket_bytes = 64},
                    {.zero_copy = true});
  for (const auto& g : shapes) b.add(g.view());
  b.set_compute_stream(d.compute);
  b.build();
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    const ddp::tensor_view v = b.gradient_view(i);
    SUITE_EXPECT(v.where == ddp::device::cuda(0) && d.rt.is_device_memory(v.data, v.bytes()),
                 "gradient_view(" << i << ") is device memory of the bucket");
  }
  expect_usage_error([&] { (void)b.gradient<float>(0); }, "device memory", "a host span of a device gradient");
  for (int t = 0; t < 2; ++t) {
    d.rt.launch(d.compute, [&, t] {
      for (std::size_t i = 0; i < shapes.size(); ++i) {
        auto* p = static_cast<float*>(b.gradient_view(i).data);
        for (std::size_t k = 0; k < shapes[i].count; ++k) p[k] = grad_value(rank, i, k, t);
      }
    });
    for (std::size_t i = shapes.size(); i-- > 0;) b.mark_ready(i);
    b.finalize();
    d.sync_compute();
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      const auto* p = static_cast<const float*>(b.gradient_view(i).data);
      for (std::size_t k = 0; k < shapes[i].count; ++k) {
        SUITE_EXPECT(close(p[k], average_of(host.size(), i, k, t)), "zero-copy step " << t << ", gradient " << i);
      }
    }
    for (const auto& bs : b.last_step().buckets) {
      SUITE_EXPECT(bs.path == ddp::bucket_path::device_zero_copy,
                   "zero-copy device buckets: " << ddp::name_of(bs.path));
    }
  }
}

// Clear errors for what device buckets cannot do, or cannot know.
template <class Rig = rig>
void bucketer_errors(ddp::communicator_ref host) {
  Rig d(host);
  device_floats g(d.rt, 8, d.compute);
  std::vector<float> on_host(8);
  {
    ddp::Bucketer<> b(d.comm);
    expect_usage_error([&] { b.add(on_host); }, "host", "a host gradient on a device communicator");
    ddp::tensor_view elsewhere = g.view();
    elsewhere.where = ddp::device::cuda(1);
    expect_usage_error([&] { b.add(elsewhere); }, "cuda:1", "a gradient on another device");
  }
  {
    ddp::Bucketer<> b(host);
    expect_usage_error([&] { b.add(g.view()); }, "device communicator", "a device gradient on a host communicator");
    expect_usage_error([&] { b.set_compute_stream(d.compute); }, "host memory", "a compute stream on a host Bucketer");
  }
  {
    ddp::Bucketer<> b(d.comm);
    b.add(g.view());
    b.build();
    expect_usage_error([&] { b.mark_ready(0); }, "set_compute_stream", "mark_ready without a stream or an event");
  }
  {
    ddp::Bucketer<> b(d.comm, {}, {.find_unused_parameters = true});
    b.add(g.view());
    expect_usage_error([&] { b.build(); }, "find_unused_parameters", "find_unused_parameters on device");
  }
  d.rt.run_ready();
}

// BufferReducer over device buffers: a mean (the backend's average), a broadcast from rank 0 and a
// max; the strategies' collectives are enqueued on the stream and the reducer's control messages
// are staged.
template <class Rig = rig>
void buffer_reducer_on_device(ddp::communicator_ref host) {
  Rig d(host);
  const int rank = host.rank();
  device_floats mean(d.rt, 6, d.comm.device_queue().stream);
  device_floats from_root(d.rt, 4, d.comm.device_queue().stream);
  device_floats biggest(d.rt, 3, d.comm.device_queue().stream);
  ddp::BufferReducer buffers(d.comm);
  buffers.add(mean.view(), ddp::strategies::allreduce_mean{});
  buffers.add(from_root.view());
  buffers.add(biggest.view(), ddp::strategies::allreduce_max{});
  buffers.build();
  d.rt.run_ready();
  for (int t = 0; t < 2; ++t) {
    for (std::size_t k = 0; k < mean.count; ++k) mean.data[k] = grad_value(rank, 0, k, t);
    std::fill(from_root.data, from_root.data + from_root.count, static_cast<float>(rank + 10 * t));
    std::fill(biggest.data, biggest.data + biggest.count, static_cast<float>(rank * (t + 1)));
    buffers.sync();  // waits for the collectives (work::wait: completed on the device)
    for (std::size_t k = 0; k < mean.count; ++k) {
      SUITE_EXPECT(close(mean.data[k], average_of(host.size(), 0, k, t)), "mean[" << k << "]: " << mean.data[k]);
    }
    SUITE_EXPECT(from_root.data[3] == static_cast<float>(10 * t), "broadcast from rank 0: " << from_root.data[3]);
    SUITE_EXPECT(biggest.data[2] == static_cast<float>((host.size() - 1) * (t + 1)), "max: " << biggest.data[2]);
  }
}

// Uneven inputs on the device: rank r trains 2 + r batches with a device Bucketer and a device
// BufferReducer in one JoinContext. A joined rank shadows with device zeros (its buckets are
// zeroed on the stream) and its max buffer contributes the identity; at the end every rank holds
// the authoritative rank's parameters (the final broadcast of device parameters).
template <class Rig = rig>
void join_on_device(ddp::communicator_ref host) {
  Rig d(host);
  const int rank = host.rank();
  const int size = host.size();
  device_floats param(d.rt, 16, d.compute);
  device_floats grad(d.rt, 16, d.compute);
  device_floats biggest(d.rt, 2, d.compute);
  ddp::Bucketer<> b(d.comm);
  b.add(param.view(), grad.view());
  b.set_compute_stream(d.compute);
  ddp::BufferReducer buffers(d.comm);
  buffers.add(biggest.view(), ddp::strategies::allreduce_max{});
  std::fill(param.data, param.data + param.count, 0.0F);
  const int batches = 2 + rank;
  {
    ddp::JoinContext join({}, b, buffers);
    for (int t = 0; t < batches; ++t) {
      const ddp::join_round& round = join.notify();
      d.sync_compute();
      std::fill(biggest.data, biggest.data + biggest.count, static_cast<float>(rank + 1));
      buffers.sync();
      SUITE_EXPECT(biggest.data[0] == static_cast<float>(size), "step " << t
                                                                        << ": max over the ranks, joined ones "
                                                                           "contributing the identity: "
                                                                        << biggest.data[0]);
      d.rt.launch(d.compute, [&] { std::fill(grad.data, grad.data + grad.count, 1.0F); });
      b.mark_ready(0);
      b.finalize();
      d.sync_compute();
      // Every training rank contributes 1, joined ones 0: the round's divisor decides the value.
      const float want = static_cast<float>(round.training) / static_cast<float>(round.divisor());
      SUITE_EXPECT(close(grad.data[0], want), "step " << t << ": gradient " << grad.data[0] << ", want " << want << " ("
                                                      << round.training << " training)");
      d.rt.launch(d.compute, [&] {  // the optimizer: ranks that train longer move further
        for (std::size_t k = 0; k < param.count; ++k) param.data[k] -= grad.data[k] + static_cast<float>(rank);
      });
    }
    d.sync_compute();
    join.finish();
  }
  d.rt.run_ready();
  std::vector<float> all(static_cast<std::size_t>(size));
  std::vector<float> mine{param.data[5]};
  host.allgather(ddp::view(mine), ddp::view(all)).wait();
  for (int r = 0; r < size; ++r) {
    SUITE_EXPECT(all[static_cast<std::size_t>(r)] == all[0],
                 "rank " << r << " ends with parameter " << all[static_cast<std::size_t>(r)] << ", rank 0 with "
                         << all[0] << ": the final broadcast must make them equal");
  }
}

// Every case over the device communicator of `Rig`: `rig` (the emulated device communicator) or
// `staged_rig` (ddp::staged::communicator, the host copies behind gates).
template <class Rig = rig>
void run_all(ddp::communicator_ref host) {
  bucketer_copy_path<Rig>(host);
  bucketer_events_and_blocking<Rig>(host);
  bucketer_zero_copy<Rig>(host);
  bucketer_errors<Rig>(host);
  buffer_reducer_on_device<Rig>(host);
  join_on_device<Rig>(host);
}

}  // namespace device_cases
