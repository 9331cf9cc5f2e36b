#pragma once
// Bucketer behaviour, written once against communicator_ref and run over the local backend
// (threads) and MPI (processes). Failures throw suite::suite_failure (see collective_suite.hpp).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <ddp/bucketer.hpp>
#include <ddp/bucketing/fixed.hpp>
#include <ddp/bucketing/rebuild_once.hpp>
#include <ddp/bucketing/size_capped.hpp>
#include <ddp/hooks/compress.hpp>

#include "../../common/collective_suite.hpp"
#include "../../common/fake_handle.hpp"
#include "../../common/toy_autograd.hpp"

namespace bucketer_cases {

using suite::buffer;

// Rank r's gradient g element k: exact in every dtype (including f16/bf16), differs by rank.
inline double grad_value(int r, std::size_t g, std::size_t k) {
  return static_cast<double>((static_cast<std::size_t>(r) * 3 + g + k) % 7) + 0.5 * (r % 2);
}

// What rank-average of grad_value gives for a gradient of dtype t (integers truncate toward zero).
inline double expected_average(ddp::dtype t, int size, std::size_t g, std::size_t k) {
  double sum = 0;
  for (int r = 0; r < size; ++r) {
    const double v = grad_value(r, g, k);
    sum += ddp::is_floating(t) ? v : std::trunc(v);  // integer gradients hold the truncated value
  }
  return ddp::is_floating(t) ? sum / size : std::trunc(sum / size);
}

struct model {
  std::vector<buffer> grads;
  explicit model(const std::vector<std::pair<ddp::dtype, std::size_t>>& shapes) {
    for (auto [t, n] : shapes) grads.emplace_back(t, n);
  }
  void fill(int rank) {
    for (std::size_t g = 0; g < grads.size(); ++g) {
      for (std::size_t k = 0; k < grads[g].count(); ++k) grads[g].set(k, grad_value(rank, g, k));
    }
  }
  void check_average(ddp::communicator_ref comm, const std::string& where) {
    for (std::size_t g = 0; g < grads.size(); ++g) {
      for (std::size_t k = 0; k < grads[g].count(); ++k) {
        suite::expect_close(grads[g].get(k), expected_average(grads[g].type, comm.size(), g, k), grads[g].type, [&] {
          return std::string(where + " gradient " + std::to_string(g) + "[" + std::to_string(k) + "]");
        });
      }
      suite::expect_same_bits_everywhere(comm, grads[g], where + " gradient " + std::to_string(g));
    }
  }
};

// Mixed dtypes, a tiny and an empty tensor, tensors larger than the cap.
inline std::vector<std::pair<ddp::dtype, std::size_t>> mixed_shapes() {
  using ddp::dtype;
  return {{dtype::f32, 1000}, {dtype::f64, 7}, {dtype::f16, 300}, {dtype::bf16, 300}, {dtype::i32, 10},
          {dtype::i64, 3},    {dtype::f32, 1}, {dtype::f32, 0},   {dtype::f32, 5000}, {dtype::f16, 4000},
          {dtype::f32, 17},   {dtype::i8, 33}, {dtype::u8, 9},    {dtype::f64, 800}};
}

// Marks every gradient in a rank-dependent shuffled order from `threads` threads at once.
template <class B>
void mark_all_shuffled(B& bucketer, int rank, unsigned seed, int threads) {
  std::vector<std::size_t> order(bucketer.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::mt19937 rng(seed * 977u + static_cast<unsigned>(rank));
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<std::thread> pool;
  std::atomic<std::size_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      try {
        for (std::size_t p; (p = next.fetch_add(1)) < order.size();) bucketer.mark_ready(order[p]);
      } catch (...) {
        std::lock_guard lk(error_mutex);
        error = std::current_exception();
      }
    });
  }
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

inline void average_mixed_dtypes(ddp::communicator_ref comm) {
  for (bool zero_copy : {false, true}) {
    model m(mixed_shapes());
    ddp::Bucketer<ddp::bucketing::size_capped> b(comm, {.cap_bytes = 4096, .small_bucket_bytes = 1024},
                                                 {.zero_copy = zero_copy});
    for (auto& g : m.grads) b.add(g.view());
    b.build();
    SUITE_EXPECT(b.layout().size() > 4, "expected several buckets, got " << b.layout().size());
    for (unsigned it = 0; it < 3; ++it) {
      m.fill(comm.rank());
      if (zero_copy) {  // the trainer writes its gradients straight into bucket storage
        for (std::size_t g = 0; g < m.grads.size(); ++g) {
          const auto v = b.gradient_view(g);
          if (v.count) std::memcpy(v.data, m.grads[g].bytes.data(), v.bytes());
        }
      }
      mark_all_shuffled(b, comm.rank(), it, 2);
      b.finalize();
      if (zero_copy) {
        for (std::size_t g = 0; g < m.grads.size(); ++g) {
          const auto v = b.gradient_view(g);
          if (v.count) std::memcpy(m.grads[g].bytes.data(), v.data, v.bytes());
        }
      }
      m.check_average(comm, std::string(zero_copy ? "zero-copy" : "copy") + " iteration " + std::to_string(it));
      const auto& st = b.last_step();
      SUITE_EXPECT(st.buckets.size() == b.layout().size(), "stats per bucket");
      SUITE_EXPECT(st.collectives == b.layout().size(), "one collective per bucket, got " << st.collectives);
      for (const auto& bs : st.buckets)
        SUITE_EXPECT(bs.launched_ms >= 0 && bs.completed_ms >= bs.launched_ms, "timings");
      SUITE_EXPECT(st.iteration == it + 1, "iteration count");
    }
  }
}

// Launch order is layout order on every rank, whatever order gradients become ready in.
inline void launch_order_and_custom_hook(ddp::communicator_ref comm) {
  model m({{ddp::dtype::f32, 300}, {ddp::dtype::f32, 300}, {ddp::dtype::f32, 300}, {ddp::dtype::f32, 300}});
  ddp::Bucketer b(comm, ddp::bucketing::size_capped{.cap_bytes = 1000, .small_bucket_bytes = 1000});
  std::vector<std::size_t> launched;
  // A hook that routes every bucket through another object (as the fault-tolerance manager will).
  struct router {
    std::vector<std::size_t>* log;
    ddp::work operator()(ddp::grad_bucket& bucket) const {
      log->push_back(bucket.index);
      return ddp::hooks::allreduce_average{}(bucket);
    }
  };
  b.register_comm_hook(router{&launched});
  for (auto& g : m.grads) b.add(g.view());
  for (unsigned it = 0; it < 3; ++it) {
    m.fill(comm.rank());
    // reverse on odd ranks, forward on even ranks
    for (std::size_t k = 0; k < b.size(); ++k) b.mark_ready(comm.rank() % 2 ? b.size() - 1 - k : k);
    b.finalize();
    m.check_average(comm, "custom hook");
  }
  SUITE_EXPECT(b.layout().size() == 4, "one bucket per 1200-byte gradient with a 1000-byte cap");
  std::vector<std::size_t> want;
  for (int it = 0; it < 3; ++it)
    for (std::size_t k = 0; k < 4; ++k) want.push_back(k);
  SUITE_EXPECT(launched == want, "buckets must launch in layout order on every rank");
}

inline void compression_hooks(ddp::communicator_ref comm) {
  for (int which = 0; which < 2; ++which) {
    std::vector<float> g(2000);
    std::vector<double> h(100);
    ddp::Bucketer b(comm, ddp::bucketing::size_capped{});
    if (which == 0) {
      b.register_comm_hook(ddp::hooks::fp16_compress{});
    } else {
      b.register_comm_hook(ddp::hooks::bf16_compress{});
    }
    b.add(g);
    b.add(h);
    for (int it = 0; it < 2; ++it) {
      for (std::size_t k = 0; k < g.size(); ++k) g[k] = static_cast<float>(grad_value(comm.rank(), 0, k) * 0.01);
      for (std::size_t k = 0; k < h.size(); ++k) h[k] = grad_value(comm.rank(), 1, k) * 1000.0;  // large values
      b.mark_ready(0);
      b.mark_ready(1);
      b.finalize();
      for (std::size_t k = 0; k < g.size(); ++k) {
        const double want = expected_average(ddp::dtype::f32, comm.size(), 0, k) * 0.01;
        SUITE_EXPECT(std::abs(g[k] - want) <= 2e-2 * std::max(std::abs(want), 1e-2),
                     (which ? "bf16" : "fp16") << " compress g[" << k << "] = " << g[k] << ", want " << want);
      }
      for (std::size_t k = 0; k < h.size(); ++k) {
        const double want = expected_average(ddp::dtype::f64, comm.size(), 1, k) * 1000.0;
        SUITE_EXPECT(std::abs(h[k] - want) <= 2e-2 * std::max(std::abs(want), 1.0), "compressed f64 h[" << k << "]");
      }
      buffer gb(ddp::dtype::f32, g.size());
      std::memcpy(gb.bytes.data(), g.data(), g.size() * 4);
      suite::expect_same_bits_everywhere(comm, gb, "compressed gradients");
    }
  }
}

// Rank 0 never uses gradient 1; nobody uses gradient 2.
inline void unused_parameters(ddp::communicator_ref comm) {
  std::vector<std::vector<float>> g(4, std::vector<float>(50));
  ddp::Bucketer b(comm, ddp::bucketing::size_capped{.cap_bytes = 100, .small_bucket_bytes = 100},
                  {.find_unused_parameters = true});
  for (auto& x : g) b.add(x);
  for (int it = 0; it < 2; ++it) {
    for (std::size_t i = 0; i < 4; ++i) std::fill(g[i].begin(), g[i].end(), static_cast<float>(comm.rank() + 1 + i));
    std::fill(g[2].begin(), g[2].end(), 42.0f);
    b.mark_ready(3);
    if (comm.rank() != 0) b.mark_ready(1);
    b.mark_ready(0);
    b.finalize();
    const int n = comm.size();
    const float avg0 = static_cast<float>(n * (n + 1) / 2) / static_cast<float>(n);  // sum (r+1) / n
    float sum1 = 0;
    for (int r = 1; r < n; ++r) sum1 += static_cast<float>(r + 2);
    SUITE_EXPECT(g[0][7] == avg0, "used everywhere: " << g[0][7] << " != " << avg0);
    if (n > 1) {
      SUITE_EXPECT(std::abs(g[1][7] - sum1 / static_cast<float>(n)) < 1e-6f,
                   "unused on rank 0 counts as zero there: " << g[1][7] << " != " << sum1 / static_cast<float>(n));
    } else {
      SUITE_EXPECT(g[1][7] == 2.0f, "unused on the only rank: left untouched");
    }
    SUITE_EXPECT(g[2][7] == 42.0f, "unused on every rank: gradient left untouched, got " << g[2][7]);
    SUITE_EXPECT(b.last_step().collectives == b.layout().size() + 1, "buckets + one used-map allreduce");
  }
}

// Rebuild from rank 0's ready order: every rank ends with the same layout, built from that order.
inline void rebuild_from_ready_order(ddp::communicator_ref comm) {
  for (bool zero_copy : {false, true}) {
    model m({{ddp::dtype::f32, 100},
             {ddp::dtype::f32, 100},
             {ddp::dtype::f32, 100},
             {ddp::dtype::f32, 100},
             {ddp::dtype::f32, 100},
             {ddp::dtype::f32, 100}});
    const ddp::bucketing::rebuild_once policy{.cap_bytes = 800, .small_bucket_bytes = 400};
    ddp::Bucketer b(comm, policy, {.zero_copy = zero_copy});
    std::vector<ddp::tensor_view> views(m.grads.size());
    std::size_t rebinds = 0;
    b.on_rebind([&](std::size_t i, ddp::tensor_view v) {
      views[i] = v;
      ++rebinds;
    });
    for (auto& g : m.grads) b.add(g.view());
    b.build();
    const auto initial = b.layout();
    const std::vector<std::size_t> rank0_order{2, 0, 5, 1, 4, 3};
    for (int it = 0; it < 3; ++it) {
      m.fill(comm.rank());
      if (zero_copy) {
        for (std::size_t g = 0; g < m.grads.size(); ++g) std::memcpy(views[g].data, m.grads[g].bytes.data(), 400);
      }
      std::vector<std::size_t> order = rank0_order;
      if (comm.rank() != 0) std::reverse(order.begin(), order.end());  // others see another order
      for (std::size_t i : order) b.mark_ready(i);
      b.finalize();
      if (zero_copy) {
        for (std::size_t g = 0; g < m.grads.size(); ++g) std::memcpy(m.grads[g].bytes.data(), views[g].data, 400);
      }
      m.check_average(comm, "rebuild iteration " + std::to_string(it));
      SUITE_EXPECT(b.last_step().rebuilt == (it == 0), "rebuilt exactly once, after the first iteration");
    }
    std::vector<ddp::gradient_info> infos;
    for (std::size_t i = 0; i < 6; ++i) infos.push_back({i, 100, ddp::dtype::f32, ddp::device::host()});
    const auto want = policy.rebuild(infos, rank0_order);
    SUITE_EXPECT(b.layout() == want, "layout must follow rank 0's ready order");
    SUITE_EXPECT(!(initial == want), "test needs a layout that changes");
    if (zero_copy) SUITE_EXPECT(rebinds == 12, "each gradient rebound at build and at rebuild, got " << rebinds);
    std::vector<std::int64_t> fp{static_cast<std::int64_t>(b.layout_fingerprint())};
    std::vector<std::int64_t> all(static_cast<std::size_t>(comm.size()));
    comm.allgather(ddp::view(fp), ddp::view(all)).wait();
    for (auto f : all) SUITE_EXPECT(f == fp[0], "layout fingerprint equal on every rank");
  }
}

template <class F>
void expect_usage_error(F&& f, const std::string& needle, const std::string& what) {
  try {
    f();
  } catch (const ddp::usage_error& e) {
    SUITE_EXPECT(std::string(e.what()).find(needle) != std::string::npos,
                 what << ": message '" << e.what() << "' lacks '" << needle << "'");
    return;
  }
  SUITE_EXPECT(false, what << ": no usage_error thrown");
}

// Issue #13 (9): a layout mismatch names the first differing gradient (index, count, dtype), the
// same on every rank. The last rank is the odd one.
inline void layout_mismatch_names_the_gradient(ddp::communicator_ref comm) {
  if (comm.size() < 2) return;
  const int odd = comm.size() - 1;
  const bool me_odd = comm.rank() == odd;
  const std::string names_odd = "rank " + std::to_string(odd);
  std::vector<float> a(10), b(me_odd ? 11 : 10), c(7), extra(3);
  std::vector<double> d(4);
  std::vector<float> f(4);
  {  // count differs
    ddp::Bucketer x(comm);
    x.add(a);
    x.add(b);
    x.add(c);
    expect_usage_error([&] { x.build(); },
                       "gradient 1 is the first that differs: rank 0 has f32 x 10, " + names_odd + " has f32 x 11",
                       "count differs");
  }
  {  // dtype differs
    ddp::Bucketer x(comm);
    x.add(a);
    x.add(c);
    if (me_odd) {
      x.add(d);
    } else {
      x.add(f);
    }
    expect_usage_error([&] { x.build(); },
                       "gradient 2 is the first that differs: rank 0 has f32 x 4, " + names_odd + " has f64 x 4",
                       "dtype differs");
  }
  {  // one gradient more
    ddp::Bucketer x(comm);
    x.add(a);
    if (me_odd) x.add(extra);
    expect_usage_error(
        [&] { x.build(); },
        "gradient 1 is the first that differs: rank 0 has none (it registered fewer), " + names_odd + " has f32 x 3",
        "count of gradients differs");
  }
  {  // same gradients, different layout policy knobs
    std::vector<float> g(4), h(4);
    ddp::Bucketer x(comm, ddp::bucketing::size_capped{.cap_bytes = me_odd ? 32u : 1024u, .small_bucket_bytes = 16});
    x.add(a);
    x.add(c);
    x.add(f);
    x.add(g);
    x.add(h);
    expect_usage_error([&] { x.build(); }, "the gradients agree, but gradient", "layout differs");
  }
}

inline void misuse_errors(ddp::communicator_ref comm) {
  std::vector<float> a(10), c(10);
  {
    ddp::Bucketer b(comm);
    b.add(a);
    b.add(c);
    expect_usage_error([&] { b.mark_ready(2); }, "out of range", "index out of range");
    b.mark_ready(0);
    expect_usage_error([&] { b.mark_ready(0); }, "marked ready twice", "double mark");
    expect_usage_error([&] { b.finalize(); }, "indices 1", "finalize before all marked");
    expect_usage_error([&] { b.add(a); }, "after build", "add after build");
  }
  {
    ddp::Bucketer b(comm);
    b.add(a);
    expect_usage_error([&] { b.add(a); }, "same memory as gradient 0", "gradient registered twice");
  }
  {
    std::vector<float> extra(3);
    ddp::Bucketer b(comm);
    b.add(a);
    if (comm.rank() == comm.size() - 1 && comm.size() > 1) b.add(extra);
    if (comm.size() > 1) {
      expect_usage_error([&] { b.build(); }, "differ across ranks", "layout mismatch across ranks");
    }
  }
  layout_mismatch_names_the_gradient(comm);
  {
    ddp::bucketing::fixed bad;
    bad.explicit_layout.buckets = {{0}, {0}};
    ddp::Bucketer b(comm, bad);
    b.add(a);
    expect_usage_error([&] { b.build(); }, "more than one bucket", "invalid explicit layout");
  }
}

// Re-creation after a failure: destroy the communicator, build a new one and a new Bucketer over the same parameters,
// ten times; the eleventh step is correct and nothing earlier is still attached. `make_comm(cycle)`
// returns a fresh communicator object; `end_comm(comm)` aborts/destroys it.
template <class MakeComm>
void recreate_ten_times(int rank, MakeComm&& make_comm) {
  constexpr std::size_t params = 5;
  std::vector<std::vector<float>> grads(params, std::vector<float>(33));
  toy::autograd autograd(params);
  for (int cycle = 0; cycle <= 10; ++cycle) {
    auto comm = make_comm(cycle);
    ddp::communicator_ref ref(comm);
    {
      ddp::Bucketer b(ref, ddp::bucketing::size_capped{.cap_bytes = 200, .small_bucket_bytes = 100});
      for (auto& g : grads) b.add(g);
      b.attach(autograd);
      SUITE_EXPECT(autograd.live_hooks() == params, "cycle " << cycle << ": " << autograd.live_hooks() << " hooks");
      for (std::size_t p = 0; p < params; ++p) SUITE_EXPECT(autograd.hooks_on(p) == 1, "one hook per parameter");
      for (std::size_t p = 0; p < params; ++p) {
        std::fill(grads[p].begin(), grads[p].end(), static_cast<float>((rank + 1) * (cycle + 1) + p));
      }
      for (std::size_t p = params; p-- > 0;) autograd.gradient_ready(p);  // the "backward pass"
      b.finalize();
      const int n = ref.size();
      for (std::size_t p = 0; p < params; ++p) {
        const float want = static_cast<float>((cycle + 1) * (n + 1)) / 2.0f + static_cast<float>(p);
        SUITE_EXPECT(std::abs(grads[p][0] - want) < 1e-5f,
                     "cycle " << cycle << " param " << p << ": " << grads[p][0] << " != " << want);
      }
    }
    SUITE_EXPECT(autograd.live_hooks() == 0, "destroying the Bucketer removes its hooks (cycle " << cycle << ")");
    ref.abort();  // the "failure": tear the communicator down
  }
}

// The optional progress thread tests in-flight buckets between marks; results must not change.
inline void progress_thread_averages(ddp::communicator_ref comm) {
  for (bool zero_copy : {false, true}) {
    model m(mixed_shapes());
    ddp::Bucketer b(comm, ddp::bucketing::size_capped{.cap_bytes = 2048, .small_bucket_bytes = 512},
                    {.zero_copy = zero_copy, .progress_interval = std::chrono::microseconds(20)});
    for (auto& g : m.grads) b.add(g.view());
    b.build();
    for (unsigned it = 0; it < 3; ++it) {
      m.fill(comm.rank());
      for (std::size_t g = 0; g < m.grads.size(); ++g) {
        if (zero_copy && m.grads[g].count())
          std::memcpy(b.gradient_view(g).data, m.grads[g].bytes.data(), m.grads[g].bytes.size());
      }
      for (std::size_t i = b.size(); i-- > 0;) {
        b.mark_ready(i);
        std::this_thread::sleep_for(std::chrono::microseconds(50));  // "compute": the thread tests meanwhile
      }
      b.finalize();
      for (std::size_t g = 0; g < m.grads.size(); ++g) {
        if (zero_copy && m.grads[g].count())
          std::memcpy(m.grads[g].bytes.data(), b.gradient_view(g).data, m.grads[g].bytes.size());
      }
      m.check_average(comm, std::string("progress thread, ") + (zero_copy ? "zero-copy" : "copy"));
    }
  }
}

// Issue #13 (6): gradients that move. A framework that sets gradients to None each step
// (libtorch 2.x's zero_grad(set_to_none=true)) gives every gradient new memory in each backward
// pass. Registered as lvalues (their slots), the copy path follows them: the new gradient is
// averaged and written back, the old memory is left alone. Parameters are handles copied out of
// a temporary list (issue #13 (7)): the Bucketer holds them by value.
inline double moved_value(int rank, int step, std::size_t k, std::size_t i) {
  return static_cast<double>((static_cast<std::size_t>(rank) * 5 + static_cast<std::size_t>(step) * 3 + k + i) % 11) +
         0.25 * rank;
}

inline void moved_gradients(ddp::communicator_ref comm) {
  const int rank = comm.rank();
  const int n = comm.size();
  const std::vector<std::size_t> sizes{40, 7, 100};
  std::vector<fake::handle> params, grads;  // the model's parameters and their .grad slots
  for (std::size_t s : sizes) {
    params.emplace_back(s);
    grads.emplace_back(s);
  }
  std::vector<float> plain(30);  // a trainer-owned vector, reassigned each step
  ddp::Bucketer b(comm, ddp::bucketing::size_capped{.cap_bytes = 256, .small_bucket_bytes = 128});
  {
    const std::vector<fake::handle> listed = params;  // like model->parameters(): copies in a temporary
    for (std::size_t k = 0; k < listed.size(); ++k) b.add(listed[k], std::as_const(grads[k]));  // p.grad(): const&
  }
  b.add(plain);
  b.build();
  auto want = [&](int step, std::size_t k, std::size_t i) {
    double sum = 0;
    for (int r = 0; r < n; ++r) sum += moved_value(r, step, k, i);
    return sum / n;
  };
  std::vector<fake::handle> retired;  // earlier gradients, kept alive: new memory has new addresses
  std::vector<std::vector<float>> retired_plain;
  for (int step = 0; step < 3; ++step) {
    for (std::size_t k = 0; k < grads.size(); ++k) {
      retired.push_back(grads[k]);
      grads[k] = fake::handle(sizes[k]);  // set_to_none, then the backward pass allocates anew
      for (std::size_t i = 0; i < sizes[k]; ++i) grads[k][i] = static_cast<float>(moved_value(rank, step, k, i));
    }
    retired_plain.push_back(std::move(plain));
    plain = std::vector<float>(30);
    for (std::size_t i = 0; i < plain.size(); ++i) plain[i] = static_cast<float>(moved_value(rank, step, 3, i));
    std::vector<std::vector<float>> before;  // what the retired memory holds before this step
    for (auto& h : retired) before.push_back(*h.storage);
    for (std::size_t i = b.size(); i-- > 0;) b.mark_ready(i);
    b.finalize();
    const std::string where = "moved gradients, step " + std::to_string(step);
    for (std::size_t k = 0; k < grads.size(); ++k) {
      for (std::size_t i = 0; i < sizes[k]; ++i) {
        SUITE_EXPECT(std::abs(grads[k][i] - want(step, k, i)) < 1e-5,
                     where << ": new gradient " << k << "[" << i << "] = " << grads[k][i] << ", want "
                           << want(step, k, i) << " (the replaced gradient was not followed)");
      }
    }
    for (std::size_t i = 0; i < plain.size(); ++i) {
      SUITE_EXPECT(std::abs(plain[i] - want(step, 3, i)) < 1e-5,
                   where << ": reassigned vector [" << i << "] = " << plain[i] << ", want " << want(step, 3, i));
    }
    for (std::size_t r = 0; r < retired.size(); ++r) {
      SUITE_EXPECT(*retired[r].storage == before[r], where << ": replaced gradient memory was written");
    }
  }
  // The parameters were copied out of a list that is gone; their handles still reach the model's storage.
  for (std::size_t k = 0; k < params.size(); ++k) {
    for (std::size_t i = 0; i < sizes[k]; ++i) params[k][i] = static_cast<float>(rank * 100 + k);
  }
  b.broadcast_parameters(n - 1);
  for (std::size_t k = 0; k < params.size(); ++k) {
    SUITE_EXPECT(params[k][sizes[k] - 1] == static_cast<float>((n - 1) * 100 + static_cast<int>(k)),
                 "parameter " << k << " after broadcast: " << params[k][0]);
  }

  {  // A temporary handle is held by value (it cannot be followed, but it never dangles).
    fake::handle g(8, static_cast<float>(rank + 1));
    ddp::Bucketer t(comm);
    t.add(fake::handle(g));
    t.mark_ready(0);
    t.finalize();
    SUITE_EXPECT(std::abs(g[7] - static_cast<float>(n + 1) / 2.0f) < 1e-6f, "temporary handle: " << g[7]);
  }

  {  // Under find_unused_parameters, a gradient replaced but not used on rank 0 is re-read at
     // finalize; one set to None there (no memory) cannot receive the others' average.
    std::vector<fake::handle> g{fake::handle(10), fake::handle(10)};
    ddp::Bucketer u(comm, ddp::bucketing::size_capped{}, {.find_unused_parameters = true});
    u.add(g[0]);
    u.add(g[1]);
    std::vector<fake::handle> keep{g[0], g[1]};
    g[0] = fake::handle(10, static_cast<float>(rank));
    g[1] = rank == 0 ? fake::handle() : fake::handle(10, static_cast<float>(rank));
    u.mark_ready(0);
    if (rank != 0) u.mark_ready(1);
    bool threw = false;
    try {
      u.finalize();
    } catch (const ddp::usage_error& e) {
      threw = true;
      SUITE_EXPECT(rank == 0 && std::string(e.what()).find("gradients 1 ") != std::string::npos,
                   "unused gradient without memory: " << e.what());
    }
    SUITE_EXPECT(threw == (rank == 0 && n > 1), "rank " << rank << " threw " << threw);
    SUITE_EXPECT(std::abs(g[0][3] - static_cast<float>(n - 1) / 2.0f) < 1e-6f, "moved, used: " << g[0][3]);
    SUITE_EXPECT((*keep[0].storage)[3] == 0.0f, "old memory of a moved gradient written");
  }

  {  // A gradient whose element count changed is an error naming it, on every rank, before any launch.
    std::vector<float> a(16), c(16);
    ddp::Bucketer e(comm, ddp::bucketing::size_capped{.cap_bytes = 64, .small_bucket_bytes = 64});
    e.add(a);
    e.add(c);
    e.build();
    c.resize(12);
    expect_usage_error([&] { e.mark_ready(1); }, "gradient 1 was registered as f32 x 16 on host and is now f32 x 12",
                       "resized gradient");
  }

  {  // Zero-copy: gradient i is gradient_view(i); the registered vector only gave the shape.
    std::vector<float> shape(6);
    ddp::Bucketer z(comm, ddp::bucketing::size_capped{}, {.zero_copy = true});
    z.add(shape);
    z.build();
    shape = std::vector<float>(2);  // not read again: no error
    for (float& x : z.gradient<float>(0)) x = static_cast<float>(rank);
    z.mark_ready(0);
    z.finalize();
    SUITE_EXPECT(z.gradient<float>(0)[5] == static_cast<float>(n - 1) / 2.0f, "zero-copy average");
  }
}

// Contiguous gradients (issue #14): a trainer that keeps every gradient in one allocation, in
// registration order (llm.c does), gets buckets that are views of it: no copy in, none back, and
// the same bits as a trainer with one allocation per gradient. Ranks laid out differently agree,
// and a gradient moved after build() turns its bucket back into a copying one.
inline void contiguous_gradients(ddp::communicator_ref comm) {
  const int rank = comm.rank();
  const int n = comm.size();
  const std::vector<std::size_t> sizes{300, 7, 0, 1000, 45, 260, 1, 900, 64};
  std::size_t total = 0;
  for (std::size_t s : sizes) total += s;
  auto value = [](int r, std::size_t g, std::size_t k) {
    return static_cast<float>((static_cast<std::size_t>(r) * 7 + g * 3 + k) % 13) * 0.37f +
           0.1f * static_cast<float>(r);
  };
  auto want = [&](std::size_t g, std::size_t k) {  // the rule: each value times 1/n in float, then the sum
    double sum = 0;
    for (int r = 0; r < n; ++r) sum += static_cast<double>(value(r, g, k) * (1.0f / static_cast<float>(n)));
    return sum;
  };
  const ddp::bucketing::size_capped policy{.cap_bytes = 2048, .small_bucket_bytes = 512};

  // Reference: one vector per gradient (never contiguous: separate allocations).
  std::vector<std::vector<float>> separate;
  for (std::size_t s : sizes) separate.emplace_back(s);
  ddp::Bucketer ref(comm, policy);
  for (auto& g : separate) ref.add(g);
  ref.build();

  // Contiguous on every rank, then only on even ranks (odd ranks give separate vectors).
  for (const bool every_rank : {true, false}) {
    const bool mine_flat = every_rank || rank % 2 == 0;
    std::vector<float> flat(total);
    std::vector<std::vector<float>> own;
    std::vector<std::span<float>> grads;  // lvalues: re-read at every mark_ready
    for (std::size_t g = 0, at = 0; g < sizes.size(); at += sizes[g], ++g) {
      if (mine_flat) {
        grads.emplace_back(flat.data() + at, sizes[g]);
      } else {
        own.emplace_back(sizes[g]);
        grads.emplace_back(own.back());
      }
    }
    ddp::Bucketer b(comm, policy);
    for (auto& g : grads) b.add(g);
    b.build();
    SUITE_EXPECT(b.layout().size() >= 3, "expected several buckets, got " << b.layout().size());
    const std::string where = every_rank ? "contiguous everywhere" : "contiguous on even ranks";
    for (int step = 0; step < 3; ++step) {
      // Step 2 on rank 0: gradient 3 moves out of the block, so its bucket copies again.
      std::vector<float> moved(sizes[3]);
      if (step == 2 && rank == 0) grads[3] = std::span<float>(moved);  // (307 = where it lived)
      for (std::size_t g = 0; g < sizes.size(); ++g) {
        for (std::size_t k = 0; k < sizes[g]; ++k) grads[g][k] = separate[g][k] = value(rank, g, k);
      }
      mark_all_shuffled(b, rank, static_cast<unsigned>(step), 2);
      b.finalize();
      for (std::size_t i = ref.size(); i-- > 0;) ref.mark_ready(i);
      ref.finalize();
      for (std::size_t g = 0; g < sizes.size(); ++g) {
        for (std::size_t k = 0; k < sizes[g]; ++k) {
          SUITE_EXPECT(std::abs(grads[g][k] - want(g, k)) < 1e-5, where << ", step " << step << ": gradient " << g
                                                                        << "[" << k << "] = " << grads[g][k]
                                                                        << ", want " << want(g, k));
        }
        SUITE_EXPECT(sizes[g] == 0 || std::memcmp(grads[g].data(), separate[g].data(), sizes[g] * sizeof(float)) == 0,
                     where << ", step " << step << ": gradient " << g
                           << " differs in its bits from one allocation per gradient");
      }
      std::size_t moved_bucket = 0;
      for (std::size_t k = 0; k < b.layout().size(); ++k) {
        const auto& members = b.layout().buckets[k];
        if (std::find(members.begin(), members.end(), std::size_t{3}) != members.end()) moved_bucket = k;
      }
      for (std::size_t k = 0; k < b.layout().size(); ++k) {
        const bool expect = mine_flat && !b.direct() && !(step == 2 && rank == 0 && k == moved_bucket);
        SUITE_EXPECT(b.last_step().buckets[k].in_place == (expect || b.direct()),
                     where << ", step " << step << ": bucket " << k << " in_place = "
                           << b.last_step().buckets[k].in_place << ", want " << (expect || b.direct()));
      }
      if (step == 2 && rank == 0 && mine_flat) grads[3] = std::span<float>(flat.data() + 307, sizes[3]);  // back home
    }
  }
  {  // Overlapping gradients would be averaged twice over: an error naming both. Empty ones may share an address.
    std::vector<float> block(32);
    ddp::Bucketer o(comm);
    o.add(ddp::tensor_view{block.data(), 20, ddp::dtype::f32, ddp::device::host()});
    o.add(ddp::tensor_view{block.data() + 20, 0, ddp::dtype::f32, ddp::device::host()});
    o.add(ddp::tensor_view{block.data() + 20, 12, ddp::dtype::f32, ddp::device::host()});
    expect_usage_error(
        [&] {
          o.add(ddp::tensor_view{block.data() + 10, 4, ddp::dtype::f32, ddp::device::host()});
        },
        "gradient 3 overlaps the memory of gradient 0", "overlapping gradients");
  }
}

// Issue #31 (1): a gradient produced only inside no_sync is averaged at the next synchronised
// iteration, on every path, with and without find_unused_parameters. Three gradients: `base`
// is produced in both micro-batches on every rank, `extra` only in the no_sync one (on every rank
// without find_unused; on the ranks r % 3 != 2 with it), `idle` never (left untouched; without
// find_unused it is marked, unchanged, and averages to itself).
// Reference: each rank's accumulated gradient, averaged over ranks (unproduced = zero).
inline void no_sync_only_gradients(ddp::communicator_ref comm) {
  const int n = comm.size();
  const auto produces_extra = [](int r, bool find_unused) { return !find_unused || r % 3 != 2; };
  // What rank r adds to gradient g, element k, in micro-batch m: exact small binary fractions.
  const auto contribution = [](int r, std::size_t g, std::size_t k, int m) {
    return static_cast<float>((r + 1) * (m + 2)) + 0.25f * static_cast<float>((k + g) % 4);
  };
  enum class path { copy_divided, copy_with_hook, zero_copy };
  for (path p : {path::copy_divided, path::copy_with_hook, path::zero_copy}) {
    for (bool find_unused : {false, true}) {
      if (!find_unused && p == path::zero_copy) continue;  // zero-copy with find_unused only
      const std::string where = std::string(p == path::copy_divided     ? "copy path"
                                            : p == path::copy_with_hook ? "copy path with a hook"
                                                                        : "zero-copy") +
                                (find_unused ? ", find_unused" : "");
      std::vector<std::vector<float>> g(3, std::vector<float>(40, 0.0f));
      ddp::Bucketer b(comm, ddp::bucketing::size_capped{.cap_bytes = 200, .small_bucket_bytes = 200},
                      {.zero_copy = p == path::zero_copy, .find_unused_parameters = find_unused});
      if (p == path::copy_with_hook) b.register_comm_hook(ddp::hooks::allreduce_average{});
      b.add(g[0], "base");
      b.add(g[1], "extra");
      b.add(g[2], "idle");
      b.build();
      const auto grad = [&](std::size_t i) {  // where the trainer accumulates gradient i
        return p == path::zero_copy ? b.gradient<float>(i) : std::span<float>(g[i]);
      };
      for (std::size_t i = 0; i < 3; ++i) std::fill(grad(i).begin(), grad(i).end(), i == 2 ? 42.0f : 0.0f);
      for (int step = 0; step < 2; ++step) {
        for (std::size_t i = 0; i < 2; ++i) std::fill(grad(i).begin(), grad(i).end(), 0.0f);  // zero_grad
        for (int micro = 0; micro < 2; ++micro) {
          auto scope = b.no_sync(micro == 0);
          if (!find_unused && micro == 1)
            b.mark_ready(2);  // `idle` must be marked without find_unused: 42 averages to 42
          for (std::size_t i = 0; i < 2; ++i) {
            if (i == 1 && (micro == 1 || !produces_extra(comm.rank(), find_unused))) continue;
            auto x = grad(i);
            for (std::size_t k = 0; k < x.size(); ++k) x[k] += contribution(comm.rank(), i, k, micro);
            b.mark_ready(i);
          }
          b.finalize();
        }
        for (std::size_t i = 0; i < 2; ++i) {
          for (std::size_t k = 0; k < 40; ++k) {
            double want = 0;
            for (int r = 0; r < n; ++r) {
              if (i == 0) want += contribution(r, i, k, 0) + contribution(r, i, k, 1);
              if (i == 1 && produces_extra(r, find_unused)) want += contribution(r, i, k, 0);
            }
            want /= n;
            const float got = grad(i)[k];
            SUITE_EXPECT(std::abs(got - want) <= 1e-5 * std::abs(want),
                         where << ", step " << step << ": gradient " << i << "[" << k << "] = " << got
                               << ", the average of the accumulated gradients is " << want);
          }
          suite::buffer same(ddp::dtype::f32, 40);
          std::memcpy(same.bytes.data(), grad(i).data(), 40 * sizeof(float));
          suite::expect_same_bits_everywhere(comm, same, where + ": gradient " + std::to_string(i));
        }
        const float idle = p == path::zero_copy ? 0.0f : 42.0f;  // unused everywhere: zero-copy zeroes it
        SUITE_EXPECT(grad(2)[3] == idle, where << ": a gradient produced nowhere is " << grad(2)[3]);
      }
    }
  }
  {  // without find_unused, a gradient produced nowhere is still an error, and it is named
    std::vector<std::vector<float>> g(2, std::vector<float>(8, 1.0f));
    ddp::Bucketer b(comm, ddp::bucketer_options{.check_layout = true});  // options without a policy (#31 (5))
    static_assert(std::is_same_v<decltype(b), ddp::Bucketer<>>);
    b.add(g[0], "fc.weight");
    b.add(g[1], "fc.bias");
    b.mark_ready(0);
    expect_usage_error([&] { b.finalize(); }, "(indices 1 ('fc.bias'))", "unmarked gradient, named");
    expect_usage_error([&] { b.finalize(); }, "rank " + std::to_string(comm.rank()), "unmarked gradient, rank");
  }
}

// Gradient accumulation: two iterations inside no_sync scopes communicate nothing, the next one
// averages all three. Issue #31 (2, 3): the scopes nest, move, and can be disabled; communication
// resumes only when the last one ends, whatever the order.
inline void no_sync_scopes(ddp::communicator_ref comm) {
  std::vector<double> g(16, 0.0);
  ddp::Bucketer b(comm);
  std::size_t launches = 0;
  b.register_comm_hook([&](ddp::grad_bucket& bucket) {
    ++launches;
    return ddp::hooks::allreduce_average{}(bucket);
  });
  b.add(g);
  const auto iteration = [&] {
    for (double& x : g) x += comm.rank() + 1;
    b.mark_ready(0);
    b.finalize();
  };
  {
    auto outer = b.no_sync();
    {
      auto inner = b.no_sync();
      SUITE_EXPECT(!b.syncing(), "inside two scopes");
    }
    SUITE_EXPECT(!b.syncing(), "the outer scope is still open after the inner one ended");
    iteration();
    SUITE_EXPECT(launches == 0, "no communication while the outer scope is open");
  }
  SUITE_EXPECT(b.syncing(), "both scopes ended");
  {
    std::optional<ddp::Bucketer<>::no_sync_scope> kept;
    kept.emplace(b.no_sync());  // moved into an optional
    auto moved = std::move(*kept);
    SUITE_EXPECT(!kept->active() && moved.active(), "the move hands the scope over");
    kept.reset();
    SUITE_EXPECT(!b.syncing(), "a moved-from scope ends nothing");
    auto off = b.no_sync(false);
    SUITE_EXPECT(!off.active(), "no_sync(false) is inactive");
    iteration();
    moved.end();
    SUITE_EXPECT(b.syncing(), "end() ends it");
  }
  {  // scopes ended out of order (possible once they move)
    auto a = b.no_sync();
    auto c = b.no_sync();
    a.end();
    SUITE_EXPECT(!b.syncing(), "one scope still open");
    c.end();
    SUITE_EXPECT(b.syncing(), "none open");
  }
  SUITE_EXPECT(b.no_sync(false).active() == false && b.syncing(), "a disabled scope leaves syncing on");
  iteration();
  SUITE_EXPECT(launches == 1, "one launch, in the synchronised iteration, got " << launches);
  const double want = 3.0 * (comm.size() + 1) / 2.0;  // three accumulations of r + 1, averaged
  SUITE_EXPECT(std::abs(g[3] - want) < 1e-12, "accumulated average " << g[3] << " != " << want);
}

// Every bucket's path is chosen once, when the layout is installed, and reported in
// bucket_stats::path: the default hook divides in the copy unless a bucket's gradients are one
// block (contiguous, or a single gradient), a registered hook copies plainly, zero-copy copies
// nothing, and find_unused_parameters keeps every bucket on the copy path. Averages hold on each.
inline void bucket_paths(ddp::communicator_ref comm) {
  using ddp::bucket_path;
  const int n = comm.size();
  ddp::bucketing::fixed two_buckets;
  two_buckets.explicit_layout.buckets = {{0, 1}, {2}};  // bucket 0: gradients 0 and 1; bucket 1: gradient 2
  const auto step = [&](auto& b, std::vector<std::vector<float>>& grads, const char* what) {
    for (std::size_t g = 0; g < grads.size(); ++g) {
      std::fill(grads[g].begin(), grads[g].end(), static_cast<float>(comm.rank() + 1 + static_cast<int>(g)));
    }
    for (std::size_t g = 0; g < b.size(); ++g) b.mark_ready(g);
    b.finalize();
    const float want = static_cast<float>(n + 1) / 2.0f;
    for (std::size_t g = 0; g < grads.size(); ++g) {
      for (float v : grads[g]) {
        SUITE_EXPECT(std::fabs(v - (want + static_cast<float>(g))) < 1e-5f,
                     what << ": gradient " << g << " holds " << v << ", want " << want + static_cast<float>(g));
      }
    }
  };
  const auto paths = [](const auto& b) {
    std::vector<bucket_path> out;
    for (const auto& s : b.last_step().buckets) out.push_back(s.path);
    return out;
  };
  const auto names = [](const std::vector<bucket_path>& ps) {
    std::string out;
    for (bucket_path p : ps) out += std::string(out.empty() ? "" : ", ") + std::string(ddp::name_of(p));
    return out;
  };
  const auto expect = [&](const auto& b, std::vector<bucket_path> want, const char* what) {
    SUITE_EXPECT(paths(b) == want, what << ": paths " << names(paths(b)) << ", want " << names(want));
  };
  const auto separate = [] {
    return std::vector<std::vector<float>>{std::vector<float>(33), std::vector<float>(17), std::vector<float>(5)};
  };
  // A backend that stages its input (ddp::world) takes the direct path for every bucket of the
  // default hook, unless the options turn it off; then the paths are those of any backend.
  const bool staged = comm.stages_input();
  for (const bool direct : {true, false}) {
    if (!direct && !staged) break;  // direct_when_staged = false changes nothing without staging
    const ddp::bucketer_options opts{.direct_when_staged = direct};
    const bool direct_path = direct && staged;
    const std::string what = direct_path ? " (direct)" : "";
    {  // default hook, separate gradients: bucket 0 is copied in divided, bucket 1 is one block
      auto grads = separate();
      ddp::Bucketer b(comm, two_buckets, opts);
      for (auto& g : grads) b.add(g);
      step(b, grads, "default");
      expect(b,
             direct_path ? std::vector{bucket_path::direct, bucket_path::direct}
                         : std::vector{bucket_path::copy_divided, bucket_path::in_place},
             ("default hook" + what).c_str());
      SUITE_EXPECT(direct_path || b.last_step().buckets[1].in_place,
                   "a one-gradient bucket runs on the trainer's memory");
    }
    {  // contiguous gradients: both buckets in place
      std::vector<float> flat(33 + 17 + 5);
      std::vector<std::span<float>> grads{{flat.data(), 33}, {flat.data() + 33, 17}, {flat.data() + 50, 5}};
      ddp::Bucketer b(comm, two_buckets, opts);
      for (auto& g : grads) b.add(g);
      for (std::size_t g = 0; g < 3; ++g) b.mark_ready(g);
      b.finalize();
      expect(b,
             direct_path ? std::vector{bucket_path::direct, bucket_path::direct}
                         : std::vector{bucket_path::in_place, bucket_path::in_place},
             ("contiguous" + what).c_str());
    }
  }
  {  // a registered hook: plain copies
    auto grads = separate();
    ddp::Bucketer b(comm, two_buckets);
    b.register_comm_hook(ddp::hooks::allreduce_average{});
    for (auto& g : grads) b.add(g);
    step(b, grads, "hook");
    expect(b, {bucket_path::copy_with_hook, bucket_path::copy_with_hook}, "registered hook");
  }
  {  // find_unused_parameters: the copy path, also for a one-gradient bucket
    auto grads = separate();
    ddp::Bucketer b(comm, two_buckets, {.find_unused_parameters = true});
    for (auto& g : grads) b.add(g);
    step(b, grads, "find_unused_parameters");
    expect(b, {bucket_path::copy_divided, bucket_path::copy_divided}, "find_unused_parameters");
  }
  {  // zero-copy: the gradients live in the buckets
    auto grads = separate();
    ddp::Bucketer b(comm, two_buckets, {.zero_copy = true});
    for (auto& g : grads) b.add(g);
    b.build();
    for (std::size_t g = 0; g < 3; ++g) {
      auto v = b.gradient<float>(g);
      std::fill(v.begin(), v.end(), static_cast<float>(comm.rank() + 1 + static_cast<int>(g)));
      b.mark_ready(g);
    }
    b.finalize();
    expect(b, {bucket_path::zero_copy, bucket_path::zero_copy}, "zero_copy");
    const float want = static_cast<float>(n + 1) / 2.0f;
    for (std::size_t g = 0; g < 3; ++g) {
      for (float v : b.gradient<float>(g)) {
        SUITE_EXPECT(std::fabs(v - (want + static_cast<float>(g))) < 1e-5f,
                     "zero_copy: gradient " << g << " holds " << v);
      }
    }
  }
  SUITE_EXPECT(ddp::name_of(bucket_path::copy_divided) == "copy_divided" &&
                   ddp::name_of(bucket_path::direct) == "direct" &&
                   ddp::name_of(bucket_path::device_zero_copy) == "device_zero_copy",
               "name_of(bucket_path)");
}

inline void run_all(ddp::communicator_ref comm) {
  bucket_paths(comm);
  average_mixed_dtypes(comm);
  progress_thread_averages(comm);
  launch_order_and_custom_hook(comm);
  compression_hooks(comm);
  unused_parameters(comm);
  no_sync_only_gradients(comm);
  no_sync_scopes(comm);
  rebuild_from_ready_order(comm);
  misuse_errors(comm);
  moved_gradients(comm);
  contiguous_gradients(comm);
}

}  // namespace bucketer_cases
