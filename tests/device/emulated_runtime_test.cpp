// The emulated device runtime (lazy ordered queues, events, stream-ordered memory) and the
// emulated device communicator over the local backend: device collectives enqueued on a stream,
// host collectives staged, error paths, no leaks.
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/average.hpp>
#include <ddp/testing/emulated.hpp>
#include <ddp/local.hpp>

using ddp::copy_region;
using ddp::device;
using ddp::device_event;
using ddp::device_stream;
using ddp::tensor_view;
using ddp::emulated_device::runtime;

namespace {

// Catch2 v2 is not thread-safe: rank threads throw, and `local::run` rethrows on the main thread.
#define EXPECT(cond, msg)                                                    \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::ostringstream os_;                                                \
      os_ << __FILE__ << ":" << __LINE__ << ": expected " #cond ": " << msg; \
      throw std::runtime_error(os_.str());                                   \
    }                                                                        \
  } while (0)

// Throws unless `fn` throws an E whose what() contains `text`.
template <class E, class F>
void expect_throw(F&& fn, const std::string& text) {
  try {
    fn();
  } catch (const E& e) {
    EXPECT(std::string(e.what()).find(text) != std::string::npos,
           "message '" << e.what() << "' lacks '" << text << "'");
    return;
  } catch (const std::exception& e) {
    throw std::runtime_error("threw the wrong exception: " + std::string(e.what()));
  }
  throw std::runtime_error("did not throw (expected '" + text + "')");
}

template <class T>
T* device_alloc(runtime& rt, std::size_t n, device_stream s, int ordinal = 0) {
  return static_cast<T*>(rt.allocate(device::cuda(ordinal), n * sizeof(T), s));
}

template <class T>
tensor_view dview(T* p, std::size_t n, int ordinal) {
  return {p, n, ddp::dtype_v<T>, device::cuda(ordinal)};
}

// Enqueues a copy of `bytes` from `src` to `dst` on `s`.
void copy1(runtime& rt, void* dst, const void* src, std::size_t bytes, device_stream s) {
  const copy_region r{dst, src, bytes};
  rt.copy({&r, 1}, s);
}

// An allreduce of one view.
ddp::work allreduce1(ddp::emulated_device::communicator& dc, tensor_view v, ddp::reduce_op op) {
  return dc.allreduce(std::span<const tensor_view>(&v, 1), op);
}

// Records a fresh event on `s`, synchronizes it, destroys it.
void sync_stream(runtime& rt, device_stream s) {
  const device_event e = rt.create_event(device::cuda(0));
  rt.record(e, s);
  rt.synchronize(e);
  rt.destroy_event(e);
}

}  // namespace

TEST_CASE("emulated runtime: stream order, lazily", "[device]") {
  runtime rt(0);
  const device_stream s = rt.create_stream(device::cuda(0));
  float* d = device_alloc<float>(rt, 4, s);
  const std::vector<float> src1{1, 2, 3, 4};
  const std::vector<float> src2{5, 6, 7, 8};
  std::vector<float> out1(4, -1);
  std::vector<float> out2(4, -1);
  copy1(rt, d, src1.data(), 16, s);
  copy1(rt, out1.data(), d, 16, s);
  copy1(rt, d, src2.data(), 16, s);
  copy1(rt, out2.data(), d, 16, s);
  CHECK(rt.pending_steps() == 4);
  CHECK(out1 == std::vector<float>(4, -1));  // nothing runs at enqueue time
  CHECK(rt.copies() == 0);
  rt.run_ready();
  CHECK(rt.pending_steps() == 0);
  CHECK(out1 == src1);
  CHECK(out2 == src2);
  CHECK(rt.copies() == 4);
  CHECK(rt.copied_bytes() == 64);
  CHECK(rt.host_syncs() == 0);
  sync_stream(rt, s);
  CHECK(rt.host_syncs() == 1);
  rt.deallocate(d, s);
  rt.destroy_stream(s);
  rt.run_ready();
  CHECK(rt.live_allocations() == 0);
  CHECK(rt.live_events() == 0);
  CHECK(rt.bad_frees() == 0);
}

TEST_CASE("emulated runtime: an event wait orders a consumer stream after a held producer", "[device]") {
  runtime rt(0);
  const device_stream producer = rt.create_stream(device::cuda(0));
  const device_stream consumer = rt.create_stream(device::cuda(0));
  const device_stream unordered = rt.create_stream(device::cuda(0));
  auto* d = device_alloc<std::int32_t>(rt, 1, producer);
  rt.zero(d, sizeof *d, producer);
  sync_stream(rt, producer);

  rt.hold(producer);
  rt.launch(producer, [d] { *d = 42; });  // a kernel
  const device_event produced = rt.create_event(device::cuda(0));
  rt.record(produced, producer);
  rt.wait(consumer, produced);
  std::int32_t seen = -1;
  std::int32_t stale = -1;
  copy1(rt, &seen, d, sizeof seen, consumer);
  copy1(rt, &stale, d, sizeof stale, unordered);  // no wait: reads what is there now
  const device_event consumed = rt.create_event(device::cuda(0));
  rt.record(consumed, consumer);

  CHECK_FALSE(rt.query(consumed));
  CHECK_FALSE(rt.query(produced));
  CHECK(seen == -1);  // the copy waits for the kernel
  CHECK(stale == 0);  // without the wait it would have read the stale value
  rt.release(producer);
  rt.synchronize(consumed);
  CHECK(seen == 42);
  CHECK(rt.query(produced));

  rt.destroy_event(produced);
  rt.destroy_event(consumed);
  rt.deallocate(d, consumer);
  rt.run_ready();
  CHECK(rt.live_allocations() == 0);
  CHECK(rt.live_events() == 0);
}

TEST_CASE("emulated runtime: events as in CUDA (never recorded, re-recorded, waits capture a record)", "[device]") {
  runtime rt(0);
  const device_stream a = rt.create_stream(device::cuda(0));
  const device_stream b = rt.create_stream(device::cuda(0));
  const device_stream c = rt.create_stream(device::cuda(0));
  const device_event e = rt.create_event(device::cuda(0));
  CHECK(rt.query(e));  // never recorded: complete
  rt.synchronize(e);

  rt.record(e, a);
  CHECK(rt.query(e));  // the pump ran the marker
  rt.hold(b);
  rt.record(e, b);  // recording again: incomplete until the new marker runs
  CHECK_FALSE(rt.query(e));
  rt.release(b);
  CHECK(rt.query(e));

  // A wait captures the record current at the call; a later record does not release it.
  rt.hold(a);
  int x = 0;
  rt.launch(a, [&x] { x = 7; });
  rt.record(e, a);
  rt.wait(c, e);
  int y = 0;
  rt.launch(c, [&] { y = x; });
  rt.record(e, b);  // completes at once
  CHECK(rt.query(e));
  CHECK(y == 0);  // c still waits for the record on a
  rt.release(a);
  rt.run_ready();
  CHECK(y == 7);
  rt.destroy_event(e);
  CHECK(rt.live_events() == 0);
}

TEST_CASE("emulated runtime: zero fill and fresh memory", "[device]") {
  runtime rt(0);
  const device_stream s = rt.create_stream(device::cuda(1));
  auto* d = device_alloc<unsigned char>(rt, 300, s, 1);
  REQUIRE(reinterpret_cast<std::uintptr_t>(d) % runtime::alignment == 0);
  CHECK(d[0] == 0xA5);  // uninitialised, never zero
  CHECK(d[299] == 0xA5);
  CHECK(rt.is_device_memory(d, 300));
  CHECK(rt.is_device_memory(d + 100, 200));
  CHECK_FALSE(rt.is_device_memory(d + 100, 201));
  int on_stack = 0;
  CHECK_FALSE(rt.is_device_memory(&on_stack, sizeof on_stack));
  rt.zero(d + 10, 100, s);
  CHECK(d[10] == 0xA5);  // lazily
  rt.run_ready();
  CHECK(d[9] == 0xA5);
  CHECK(d[10] == 0);
  CHECK(d[109] == 0);
  CHECK(d[110] == 0xA5);
  rt.deallocate(d, s);
  rt.run_ready();
  CHECK(rt.allocate(device::cuda(0), 0, s) == nullptr);
  CHECK_THROWS_AS((void)rt.allocate(device::host(), 8, s), ddp::usage_error);
  CHECK(rt.live_allocations() == 0);
}

TEST_CASE("emulated runtime: stream-ordered free, bad frees counted", "[device]") {
  runtime rt(0);
  const device_stream s = rt.create_stream(device::cuda(0));
  const std::size_t start = rt.live_allocations();
  auto* d = device_alloc<float>(rt, 8, s);
  rt.hold(s);
  rt.launch(s, [d] { d[0] = 1; });  // still uses it
  rt.deallocate(d, s);
  rt.run_ready();
  CHECK(rt.live_allocations() == start + 1);  // live until the free step runs
  CHECK(rt.is_device_memory(d, 32));
  rt.deallocate(d, s);  // a second free while the first is pending
  CHECK(rt.bad_frees() == 1);
  int on_stack = 0;
  rt.deallocate(&on_stack, s);  // not device memory
  CHECK(rt.bad_frees() == 2);
  rt.deallocate(nullptr, s);  // nothing
  CHECK(rt.bad_frees() == 2);
  rt.release(s);
  rt.run_ready();
  CHECK(rt.live_allocations() == start);
  CHECK_FALSE(rt.is_device_memory(d, 1));
}

TEST_CASE("emulated runtime: synchronize behind a held stream throws instead of hanging", "[device]") {
  runtime rt(3);
  const device_stream producer = rt.create_stream(device::cuda(0));
  const device_stream consumer = rt.create_stream(device::cuda(0));
  const device_event e1 = rt.create_event(device::cuda(0));
  const device_event e2 = rt.create_event(device::cuda(0));
  rt.hold(producer);
  rt.record(e1, producer);
  rt.wait(consumer, e1);
  rt.record(e2, consumer);
  REQUIRE_NOTHROW(expect_throw<ddp::usage_error>([&] { rt.synchronize(e1); }, "on held stream #1"));
  REQUIRE_NOTHROW(expect_throw<ddp::usage_error>([&] { rt.synchronize(e2); },
                                                 "would wait forever: its last record is on stream #2 (cuda:0), "
                                                 "behind held stream #1"));
  CHECK(rt.host_syncs() == 2);
  rt.release(producer);
  rt.synchronize(e2);
  CHECK(rt.host_syncs() == 3);
  rt.destroy_event(e1);
  rt.destroy_event(e2);
}

TEST_CASE("emulated runtime: synchronize has a deadline", "[device]") {
  runtime rt(0, std::chrono::milliseconds(50));
  const device_stream s = rt.create_stream(device::cuda(0));
  rt.enqueue(s, [] { return false; });  // a step that never completes
  const device_event e = rt.create_event(device::cuda(0));
  rt.record(e, s);
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(rt.synchronize(e), ddp::timeout_error);
  CHECK(std::chrono::steady_clock::now() - t0 >= std::chrono::milliseconds(50));
  rt.destroy_event(e);
}  // the destructor drops the step

TEST_CASE("emulated runtime: a failing step fails its stream, its events and the streams waiting for them",
          "[device]") {
  runtime rt(0);
  const device_stream s = rt.create_stream(device::cuda(0));
  const device_stream waiter = rt.create_stream(device::cuda(0));
  auto* d = device_alloc<int>(rt, 1, s);
  rt.launch(s, [] { throw ddp::communication_error(0, "kernel", "boom"); });
  bool ran = false;
  rt.launch(s, [&] { ran = true; });
  const device_event e = rt.create_event(device::cuda(0));
  rt.record(e, s);
  rt.wait(waiter, e);
  bool waiter_ran = false;
  rt.launch(waiter, [&] { waiter_ran = true; });
  const device_event f = rt.create_event(device::cuda(0));
  rt.record(f, waiter);
  rt.deallocate(d, s);  // frees still run on a failed stream
  CHECK_THROWS_WITH(rt.query(e), Catch::Contains("boom"));
  CHECK_THROWS_AS(rt.synchronize(f), ddp::communication_error);
  CHECK_FALSE(ran);
  CHECK_FALSE(waiter_ran);
  CHECK(rt.live_allocations() == 0);
  rt.launch(s, [&] { ran = true; });  // later work on the failed stream is dropped
  rt.run_ready();
  CHECK_FALSE(ran);
  CHECK(rt.pending_steps() == 0);
  rt.destroy_event(e);
  rt.destroy_event(f);
}

namespace {

// The device collectives of one rank over its own runtime (one "GPU" per rank: ordinal = rank).
void device_collectives(ddp::local::communicator& host) {
  const int r = host.rank();
  const int n = host.size();
  runtime rt(r);
  const std::size_t start = rt.live_allocations();
  {
    ddp::emulated_device::communicator dc(host, rt, r);
    const device_stream s = dc.device_queue().stream;
    EXPECT(dc.device_queue().runtime == &rt && dc.device_queue().where == device::cuda(r), "queue");
    EXPECT(dc.rank() == r && dc.size() == n, "rank/size");

    // allreduce of two tensors of different dtypes; nothing runs before the host pumps.
    float* a = device_alloc<float>(rt, 5, s, r);
    auto* b = device_alloc<std::int64_t>(rt, 3, s, r);
    for (int i = 0; i < 5; ++i) a[i] = static_cast<float>(r + i);
    for (int i = 0; i < 3; ++i) b[i] = (r + 1) * (i + 1);
    const tensor_view ab[] = {dview(a, 5, r), dview(b, 3, r)};
    rt.hold(s);
    ddp::work w = dc.allreduce(ab, ddp::reduce_op::sum);
    EXPECT(a[0] == static_cast<float>(r) && b[2] == 3 * (r + 1), "ran at enqueue time");
    EXPECT(!w.test(), "completed on a held stream");
    EXPECT(a[0] == static_cast<float>(r), "ran on a held stream");
    rt.release(s);
    w.wait();
    const int rank_sum = n * (n - 1) / 2;
    for (int i = 0; i < 5; ++i) EXPECT(a[i] == static_cast<float>(rank_sum + n * i), "allreduce f32 " << i);
    for (int i = 0; i < 3; ++i) EXPECT(b[i] == (i + 1) * (n * (n + 1) / 2), "allreduce i64 " << i);

    // Issued back to back, ordered on the stream with the copies around them, one host sync.
    const std::size_t syncs = rt.host_syncs();
    std::vector<float> in_host(4);
    for (int i = 0; i < 4; ++i) in_host[static_cast<std::size_t>(i)] = static_cast<float>(10 * r + i);
    float* bc = device_alloc<float>(rt, 4, s, r);
    copy1(rt, bc, in_host.data(), 16, s);
    const tensor_view bcv = dview(bc, 4, r);
    ddp::work wb = dc.broadcast(std::span<const tensor_view>(&bcv, 1), n - 1);
    std::vector<float> bc_out(4, -1);
    copy1(rt, bc_out.data(), bc, 16, s);

    float* gin = device_alloc<float>(rt, 2, s, r);
    float* gout = device_alloc<float>(rt, 2 * static_cast<std::size_t>(n), s, r);
    gin[0] = static_cast<float>(r);
    gin[1] = static_cast<float>(-r);
    ddp::work wg = dc.allgather(dview(gin, 2, r), dview(gout, 2 * static_cast<std::size_t>(n), r));
    // in place: this rank's block of the output
    float* gip = device_alloc<float>(rt, 3 * static_cast<std::size_t>(n), s, r);
    for (int i = 0; i < 3; ++i) gip[3 * r + i] = static_cast<float>(100 * r + i);
    ddp::work wgi = dc.allgather(dview(gip + 3 * r, 3, r), dview(gip, 3 * static_cast<std::size_t>(n), r));

    auto* rsin = device_alloc<std::int32_t>(rt, 2 * static_cast<std::size_t>(n), s, r);
    auto* rsout = device_alloc<std::int32_t>(rt, 2, s, r);
    for (int i = 0; i < 2 * n; ++i) rsin[i] = i * (r + 1);
    ddp::work wrs =
        dc.reduce_scatter(dview(rsin, 2 * static_cast<std::size_t>(n), r), dview(rsout, 2, r), ddp::reduce_op::sum);

    float* pm = device_alloc<float>(rt, 3, s, r);
    auto* pmi = device_alloc<std::int32_t>(rt, 1, s, r);
    for (int i = 0; i < 3; ++i) pm[i] = static_cast<float>(4 * (r + i));
    *pmi = r;
    const tensor_view pmv[] = {dview(pm, 3, r), dview(pmi, 1, r)};
    ddp::work wpm = dc.allreduce_premul_sum(pmv, 0.25);

    float* avg = device_alloc<float>(rt, 2, s, r);
    avg[0] = static_cast<float>(2 * r);
    avg[1] = 1.0f;
    ddp::work wavg = ddp::allreduce_average(ddp::communicator_ref(dc), dview(avg, 2, r), n);  // premul on the stream

    ddp::work wbar = dc.barrier();
    const device_event done = rt.create_event(device::cuda(r));
    rt.record(done, s);
    rt.synchronize(done);  // the only host sync
    EXPECT(rt.host_syncs() == syncs + 1, "host syncs " << rt.host_syncs() - syncs);
    for (ddp::work* x : {&wb, &wg, &wgi, &wrs, &wpm, &wavg, &wbar}) EXPECT(x->test(), "not complete after the stream");
    rt.destroy_event(done);
    EXPECT(dc.issued() == 8, "issued " << dc.issued());

    for (int i = 0; i < 4; ++i)
      EXPECT(bc_out[static_cast<std::size_t>(i)] == static_cast<float>(10 * (n - 1) + i), "bcast");
    for (int q = 0; q < n; ++q) {
      EXPECT(gout[2 * q] == static_cast<float>(q) && gout[2 * q + 1] == static_cast<float>(-q), "allgather " << q);
      for (int i = 0; i < 3; ++i) EXPECT(gip[3 * q + i] == static_cast<float>(100 * q + i), "in-place allgather " << q);
    }
    for (int i = 0; i < 2; ++i) EXPECT(rsout[i] == (2 * r + i) * (n * (n + 1) / 2), "reduce_scatter " << i);
    for (int i = 0; i < 3; ++i) EXPECT(pm[i] == static_cast<float>(rank_sum + n * i), "premul " << i);
    EXPECT(*pmi == rank_sum, "premul leaves integers unscaled");
    // The averaging rule: each rank's value times float(1/n), summed in rank order (the local backend's order).
    const float f = n > 1 ? static_cast<float>(1.0 / n) : 1.0f;
    float want0 = 0;
    float want1 = 0;
    for (int q = 0; q < n; ++q) {
      want0 += static_cast<float>(2 * q) * f;
      want1 += 1.0f * f;
    }
    EXPECT(avg[0] == want0 && avg[1] == want1, "average " << avg[0] << " " << avg[1]);

    for (void* p : std::initializer_list<void*>{a, b, bc, gin, gout, gip, rsin, rsout, pm, pmi, avg}) {
      rt.deallocate(p, s);
    }
    host.barrier().wait();  // every rank's collectives ran before any communicator goes
  }
  rt.run_ready();
  EXPECT(rt.live_allocations() == start, "leaked " << rt.live_allocations() - start);
  EXPECT(rt.live_events() == 0, "events leaked");
  EXPECT(rt.bad_frees() == 0, "bad frees");
  EXPECT(rt.pending_steps() == 0, "pending steps");
}

// Host tensors through the device communicator: staged, complete on return, one host sync each.
void staged_collectives(ddp::local::communicator& host) {
  const int r = host.rank();
  const int n = host.size();
  const auto un = static_cast<std::size_t>(n);
  runtime rt(r);
  ddp::emulated_device::communicator dc(host, rt, 0);
  const std::size_t syncs = rt.host_syncs();

  std::vector<double> x{static_cast<double>(r), 1.5};
  std::vector<std::int64_t> y{r * 10};
  const tensor_view xy[] = {ddp::view(x), ddp::view(y)};
  ddp::work w = dc.allreduce(xy, ddp::reduce_op::max);
  EXPECT(w.done(), "a staged call completes on return");
  EXPECT(x[0] == n - 1 && x[1] == 1.5 && y[0] == (n - 1) * 10, "staged allreduce");
  EXPECT(rt.host_syncs() == syncs + 1, "one host sync per staged call");

  std::vector<float> bc{static_cast<float>(r), static_cast<float>(r)};
  (void)dc.broadcast(bc, 0);
  EXPECT(bc[0] == 0 && bc[1] == 0, "staged broadcast");
  EXPECT(rt.host_syncs() == syncs + 2, "syncs");

  std::vector<std::int32_t> in{r, 2 * r};
  std::vector<std::int32_t> out(2 * un, -1);
  (void)dc.allgather(ddp::view(in), ddp::view(out));
  for (int q = 0; q < n; ++q)
    EXPECT(out[2 * static_cast<std::size_t>(q)] == q && out[2 * static_cast<std::size_t>(q) + 1] == 2 * q, "allgather");

  std::vector<std::int32_t> ip(3 * un, -7);
  for (std::size_t i = 0; i < 3; ++i) ip[3 * static_cast<std::size_t>(r) + i] = 100 * r + static_cast<int>(i);
  const tensor_view ipv = ddp::view(ip);
  (void)dc.allgather(ipv.slice(3 * static_cast<std::size_t>(r), 3), ipv);  // in place
  for (int q = 0; q < n; ++q) {
    for (int i = 0; i < 3; ++i) {
      EXPECT(ip[3 * static_cast<std::size_t>(q) + static_cast<std::size_t>(i)] == 100 * q + i, "in-place allgather");
    }
  }

  std::vector<float> rin(2 * un);
  for (std::size_t i = 0; i < rin.size(); ++i) rin[i] = static_cast<float>(i);
  const std::vector<float> rin_before = rin;
  std::vector<float> rout(2, -1);
  (void)dc.reduce_scatter(ddp::view(rin), ddp::view(rout), ddp::reduce_op::sum);
  EXPECT(rout[0] == static_cast<float>(2 * r * n) && rout[1] == static_cast<float>((2 * r + 1) * n), "reduce_scatter");
  EXPECT(rin == rin_before, "the input is not written");

  std::vector<float> pm{2.0f, 6.0f};
  const tensor_view pmv = ddp::view(pm);
  (void)dc.allreduce_premul_sum(std::span<const tensor_view>(&pmv, 1), 0.5);
  EXPECT(pm[0] == static_cast<float>(n) && pm[1] == static_cast<float>(3 * n), "staged premul");

  EXPECT(rt.host_syncs() == syncs + 6, "one host sync per staged call: " << rt.host_syncs() - syncs);
  EXPECT(dc.issued() == 6, "issued");
  EXPECT(rt.live_allocations() == 0, "staging memory leaked");
  EXPECT(rt.live_events() == 0, "staging events leaked");
}

}  // namespace

TEST_CASE("emulated device communicator: device collectives over local ranks", "[device][local]") {
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    REQUIRE_NOTHROW(ddp::local::run(n, device_collectives));
  }
}

TEST_CASE("emulated device communicator: host tensors are staged and complete on return", "[device][local]") {
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    REQUIRE_NOTHROW(ddp::local::run(n, staged_collectives));
  }
}

TEST_CASE("emulated device communicator: ranks sharing one runtime (one process, a device per rank)",
          "[device][local]") {
  for (int n = 1; n <= 4; ++n) {
    runtime rt(0);
    REQUIRE_NOTHROW(ddp::local::run(n, [&](ddp::local::communicator& host) {
      const int r = host.rank();
      ddp::emulated_device::communicator dc(host, rt, r);
      const device_stream s = dc.device_queue().stream;
      for (int round = 0; round < 20; ++round) {
        float* a = device_alloc<float>(rt, 16, s, r);
        for (int i = 0; i < 16; ++i) a[i] = static_cast<float>(r * round + i);
        ddp::work w = allreduce1(dc, dview(a, 16, r), ddp::reduce_op::sum);
        std::vector<float> back(16);
        copy1(rt, back.data(), a, 64, s);
        rt.deallocate(a, s);
        w.wait();
        const device_event e = rt.create_event(device::cuda(r));
        rt.record(e, s);
        rt.synchronize(e);
        rt.destroy_event(e);
        for (int i = 0; i < 16; ++i) {
          EXPECT(back[static_cast<std::size_t>(i)] == static_cast<float>(round * n * (n - 1) / 2 + n * i),
                 "round " << round);
        }
      }
      host.barrier().wait();
    }));
    CHECK(rt.live_allocations() == 0);
    CHECK(rt.live_events() == 0);
    CHECK(rt.host_syncs() == static_cast<std::size_t>(20 * n));
  }
}

TEST_CASE("emulated device communicator: error paths", "[device][local]") {
  SECTION("a tensor on another device") {
    REQUIRE_NOTHROW(ddp::local::run(1, [](ddp::local::communicator& host) {
      runtime rt(0);
      ddp::emulated_device::communicator dc(host, rt, 0);
      const device_stream s = dc.device_queue().stream;
      float* a = device_alloc<float>(rt, 2, s, 1);
      float* b = device_alloc<float>(rt, 2, s, 0);
      const tensor_view two[] = {dview(b, 2, 0), dview(a, 2, 1)};
      expect_throw<ddp::usage_error>([&] { (void)dc.allreduce(two, ddp::reduce_op::sum); },
                                     "ddp: rank 0, allreduce #0 (sum, f32 x 4): the emulated device communicator "
                                     "needs CUDA memory on cuda:0 (or host memory for every tensor of a call), got a "
                                     "tensor on cuda:1 (tensor #1 of 2)");
      expect_throw<ddp::usage_error>([&] { (void)dc.allgather(dview(a, 2, 1), dview(a, 2, 1)); }, "cuda:1");
      EXPECT(dc.issued() == 0 && rt.pending_steps() == 0, "nothing issued");
      rt.deallocate(a, s);
      rt.deallocate(b, s);
    }));
  }
  SECTION("host and device tensors in one call") {
    REQUIRE_NOTHROW(ddp::local::run(2, [](ddp::local::communicator& host) {
      runtime rt(host.rank());
      ddp::emulated_device::communicator dc(host, rt, 0);
      const device_stream s = dc.device_queue().stream;
      float* d = device_alloc<float>(rt, 4, s);
      std::vector<float> h(2);
      const tensor_view mixed[] = {dview(d, 4, 0), ddp::view(h)};
      expect_throw<ddp::usage_error>([&] { (void)dc.allreduce(mixed, ddp::reduce_op::sum); },
                                     "mixes host and device memory (tensor #1 on host, tensor #0 on cuda:0)");
      expect_throw<ddp::usage_error>([&] { (void)dc.allgather(ddp::view(h), dview(d, 4, 0)); },
                                     "input on host, output on cuda:0");
      rt.deallocate(d, s);
    }));
  }
  SECTION("abort: a pending collective fails, later calls throw") {
    REQUIRE_NOTHROW(ddp::local::run(2, [](ddp::local::communicator& host) {
      runtime rt(host.rank());
      ddp::emulated_device::communicator dc(host, rt, 0);
      const device_stream s = dc.device_queue().stream;
      float* d = device_alloc<float>(rt, 4, s);
      std::vector<float> back(4, -1);
      if (host.rank() == 0) {
        ddp::work w1 = allreduce1(dc, dview(d, 4, 0), ddp::reduce_op::sum);  // issued: waits for rank 1
        EXPECT(!w1.test(), "rank 1 never calls");
        rt.hold(s);
        ddp::work w2 = allreduce1(dc, dview(d, 4, 0), ddp::reduce_op::sum);  // not issued yet
        copy1(rt, back.data(), d, 16, s);
        dc.abort();
        rt.release(s);
        expect_throw<ddp::communication_error>([&] { w1.wait(); }, "aborted");
        expect_throw<ddp::communication_error>([&] { w2.wait(); }, "aborted");
        EXPECT(back[0] == -1, "work behind a failed collective does not run");
        expect_throw<ddp::usage_error>([&] { (void)dc.barrier(); }, "used after abort()");
        expect_throw<ddp::usage_error>([&] { (void)allreduce1(dc, dview(d, 4, 0), ddp::reduce_op::sum); },
                                       "used after abort()");
      }
      rt.deallocate(d, s);
      rt.run_ready();
      EXPECT(rt.live_allocations() == 0, "leak");
    }));
  }
  SECTION("a timed-out wait aborts the communicator") {
    REQUIRE_NOTHROW(ddp::local::run(2, [](ddp::local::communicator& host) {
      runtime rt(host.rank());
      ddp::emulated_device::communicator dc(host, rt, 0, {.timeout = std::chrono::milliseconds(100)});
      if (host.rank() != 0) return;
      float* d = device_alloc<float>(rt, 4, dc.device_queue().stream);
      ddp::work w = allreduce1(dc, dview(d, 4, 0), ddp::reduce_op::sum);
      expect_throw<ddp::timeout_error>([&] { w.wait(); }, "100 ms timeout");
      expect_throw<ddp::usage_error>([&] { (void)dc.barrier(); }, "used after abort()");
      rt.deallocate(d, dc.device_queue().stream);
    }));
  }
  SECTION("ranks issuing different collectives: the host backend's mismatch comes out of the work") {
    REQUIRE_NOTHROW(ddp::local::run(2, [](ddp::local::communicator& host) {
      runtime rt(host.rank());
      ddp::emulated_device::communicator dc(host, rt, 0);
      const device_stream s = dc.device_queue().stream;
      float* d = device_alloc<float>(rt, 4, s);
      ddp::work w = host.rank() == 0 ? allreduce1(dc, dview(d, 4, 0), ddp::reduce_op::sum) : dc.barrier();
      expect_throw<ddp::mismatch_error>([&] { w.wait(); }, "different collectives");
      // The stream failed: what is behind it fails with the same error.
      const device_event e = rt.create_event(device::cuda(0));
      rt.record(e, s);
      expect_throw<ddp::mismatch_error>([&] { rt.synchronize(e); }, "different collectives");
      rt.destroy_event(e);
      // A staged call on the failed stream fails too, and leaks nothing.
      std::vector<float> h(2);
      expect_throw<ddp::mismatch_error>([&] { (void)dc.allreduce(h, ddp::reduce_op::sum); }, "different");
      rt.deallocate(d, s);
      rt.run_ready();
      EXPECT(rt.live_allocations() == 0, "leak");
    }));
  }
  SECTION("a communicator destroyed with work pending fails that work") {
    REQUIRE_NOTHROW(ddp::local::run(1, [](ddp::local::communicator& host) {
      runtime rt(0);
      ddp::work w;
      float* d = nullptr;
      {
        ddp::emulated_device::communicator dc(host, rt, 0);
        d = device_alloc<float>(rt, 4, dc.device_queue().stream);
        rt.hold(dc.device_queue().stream);
        w = allreduce1(dc, dview(d, 4, 0), ddp::reduce_op::sum);
        rt.deallocate(d, dc.device_queue().stream);
      }
      expect_throw<ddp::communication_error>([&] { w.wait(); }, "destroyed");
      EXPECT(rt.live_allocations() == 0, "the pending free ran");
    }));
  }
}
