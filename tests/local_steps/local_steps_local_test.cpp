// LocalSGD, DiLoCo and Streaming DiLoCo over thread ranks (1-4): each equals a serial reference
// that simulates the replicas bit for bit, the equivalences hold bit for bit under the
// conditions docs/local-steps.md states, and compressed exchanges leave every replica the same bits.
#include <cmath>
#include <cstring>
#include <string_view>
#include <limits>
#include <mutex>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/local.hpp>
#include <ddp/local_steps.hpp>
#include <ddp/timeline.hpp>

#include "../common/ranks.hpp"
#include "local_steps_cases.hpp"

using namespace local_steps_cases;

namespace {

// Runs `fn(c)` on n thread ranks and returns each rank's result, by rank.
template <class F>
auto per_rank(int n, F fn) {
  using R = decltype(fn(std::declval<ddp::communicator_ref>()));
  std::vector<R> out(static_cast<std::size_t>(n));
  test_ranks::on_ranks(n, [&](ddp::communicator_ref c) { out[static_cast<std::size_t>(c.rank())] = fn(c); });
  return out;
}

const ddp::diloco_options<> paper{.sync_every = 4, .outer = {.lr = 0.7, .momentum = 0.9, .nesterov = true}};

ddp::streaming_diloco_options<> as_streaming(const ddp::diloco_options<>& o) {
  return {.sync_every = o.sync_every, .fragments = 1, .delay = 0, .alpha = 1.0, .outer = o.outer, .wire = o.wire};
}

}  // namespace

TEST_CASE("LocalSGD equals a serial reference of the replicas, bit for bit, at 1-4 ranks", "[local_steps]") {
  for (int n = 1; n <= 4; ++n) {
    for (int h : {1, 3}) {
      INFO("ranks " << n << ", sync_every " << h);
      const run_setup s{.steps = 12};
      const auto got = per_rank(n, [&](ddp::communicator_ref c) { return run_local_sgd<float>(c, h, s); });
      const auto want = reference_local_sgd<float>(n, h, s);
      for (int r = 0; r < n; ++r) CHECK(same_bits(got[r], want[r]));
      CHECK(same_bits(got[0], got[n - 1]));  // 12 steps end on an average: the replicas agree
    }
  }
}

TEST_CASE("DiLoCo equals a serial reference of the replicas, bit for bit, at 1-4 ranks", "[local_steps]") {
  const ddp::outer_sgd nesterov{.lr = 0.7, .momentum = 0.9, .nesterov = true};
  const ddp::outer_sgd heavy_ball{.lr = 0.5, .momentum = 0.8, .nesterov = false};
  const ddp::outer_sgd plain{.lr = 0.9, .momentum = 0, .nesterov = false};
  for (int n = 1; n <= 4; ++n) {
    for (const auto& outer : {nesterov, heavy_ball, plain}) {
      for (auto wire : {ddp::outer_wire::native, ddp::outer_wire::bf16, ddp::outer_wire::int8}) {
        INFO("ranks " << n << ", lr " << outer.lr << ", momentum " << outer.momentum << ", wire " << name_of(wire));
        const ddp::diloco_options<> o{.sync_every = 4, .outer = outer, .wire = wire};
        const run_setup s{.steps = 12};
        const auto got = per_rank(n, [&](ddp::communicator_ref c) { return run_diloco<float>(c, o, s); });
        const auto want = reference_streaming<float>(n, as_streaming(o), s);
        for (int r = 0; r < n; ++r) CHECK(same_bits(got[r], want[r]));
        for (int r = 1; r < n; ++r) CHECK(same_bits(got[0], got[r]));  // the same bits on every replica
      }
    }
  }
}

TEST_CASE("DiLoCo with H = 1, outer lr 1, no momentum is synchronous data-parallel SGD, bit for bit", "[local_steps]") {
  // The condition (docs/local-steps.md): a power-of-two inner learning rate and inner updates
  // that round nothing (p - (p - eta g) == eta g). Exact data in f64 over four steps meets it;
  // the test checks that it did, so that the equality is not vacuous.
  const ddp::diloco_options<> o{.sync_every = 1, .outer = {.lr = 1, .momentum = 0, .nesterov = false}};
  const run_setup s{.steps = 4, .eta = 1.0 / 256, .kind = data_kind::exact};
  for (int n = 1; n <= 4; ++n) {
    INFO("ranks " << n);
    std::vector<int> exact(static_cast<std::size_t>(n), 1);
    const auto dp = per_rank(n, [&](ddp::communicator_ref c) { return run_sync_dp<double>(c, s); });
    const auto dl = per_rank(n, [&](ddp::communicator_ref c) {
      bool all_exact = true;
      auto p = run_diloco<double>(c, o, s, &all_exact);
      exact[static_cast<std::size_t>(c.rank())] = all_exact ? 1 : 0;
      return p;
    });
    for (int r = 0; r < n; ++r) {
      REQUIRE(exact[r] == 1);
      CHECK(same_bits(dp[r], dl[r]));
    }
    // Not vacuous: the parameters moved, by different amounts at different rank counts.
    CHECK_FALSE(same_bits(dl[0], initial<double>(0, s.kind).flat()));
  }
}

TEST_CASE("DiLoCo with H = 1, outer lr 1, no momentum, on general data: close to data-parallel SGD", "[local_steps]") {
  // Outside the condition the outer gradient p - (p - eta g) rounds: equal up to rounding only.
  const ddp::diloco_options<> o{.sync_every = 1, .outer = {.lr = 1, .momentum = 0, .nesterov = false}};
  const run_setup s{.steps = 20, .eta = 0.05};
  const auto dp = per_rank(3, [&](ddp::communicator_ref c) { return run_sync_dp<float>(c, s); });
  const auto dl = per_rank(3, [&](ddp::communicator_ref c) { return run_diloco<float>(c, o, s); });
  for (std::size_t i = 0; i < dp[0].size(); ++i) CHECK(dl[0][i] == Approx(dp[0][i]).epsilon(1e-5).margin(1e-6));
}

TEST_CASE("Streaming DiLoCo with one fragment, no delay and alpha 1 is DiLoCo, bit for bit", "[local_steps]") {
  for (int n = 1; n <= 4; ++n) {
    for (auto wire : {ddp::outer_wire::native, ddp::outer_wire::bf16, ddp::outer_wire::int8}) {
      INFO("ranks " << n << ", wire " << name_of(wire));
      ddp::diloco_options<> o = paper;
      o.wire = wire;
      const run_setup s{.steps = 14};  // ends between two outer steps too
      const auto dl = per_rank(n, [&](ddp::communicator_ref c) { return run_diloco<float>(c, o, s); });
      const auto st = per_rank(n, [&](ddp::communicator_ref c) { return run_streaming<float>(c, as_streaming(o), s); });
      for (int r = 0; r < n; ++r) CHECK(same_bits(dl[r], st[r]));
    }
  }
}

TEST_CASE("Streaming DiLoCo (fragments, delay, mixing) equals a serial reference, bit for bit, at 1-4 ranks",
          "[local_steps]") {
  struct shape {
    int delay;
    double alpha;
    ddp::outer_wire wire;
  };
  for (int n = 1; n <= 4; ++n) {
    for (shape sh : {shape{1, 0.5, ddp::outer_wire::native}, shape{0, 1.0, ddp::outer_wire::native},
                     shape{1, 1.0, ddp::outer_wire::bf16}, shape{1, 0.75, ddp::outer_wire::int8}}) {
      INFO("ranks " << n << ", delay " << sh.delay << ", alpha " << sh.alpha << ", wire " << name_of(sh.wire));
      const ddp::streaming_diloco_options<> o{.sync_every = 6,
                                              .fragments = 3,
                                              .delay = sh.delay,
                                              .alpha = sh.alpha,
                                              .outer = {.lr = 0.7, .momentum = 0.9, .nesterov = true},
                                              .wire = sh.wire};
      const run_setup s{.steps = 18};
      const auto got = per_rank(n, [&](ddp::communicator_ref c) { return run_streaming<float>(c, o, s); });
      const auto want = reference_streaming<float>(n, o, s);
      for (int r = 0; r < n; ++r) CHECK(same_bits(got[r], want[r]));
      // The schedule is not DiLoCo's: some fragment merged at a step DiLoCo would not.
      if (n > 1) {
        const auto dl = per_rank(n, [&](ddp::communicator_ref c) {
          return run_diloco<float>(c, {.sync_every = 6, .outer = o.outer, .wire = sh.wire}, s);
        });
        CHECK_FALSE(same_bits(got[0], dl[0]));
      }
    }
  }
}

TEST_CASE("Outer exchange: every wire leaves every replica the same bits, close to the mean", "[local_steps]") {
  for (int n = 1; n <= 4; ++n) {
    for (auto wire : {ddp::outer_wire::native, ddp::outer_wire::bf16, ddp::outer_wire::int8}) {
      INFO("ranks " << n << ", wire " << name_of(wire));
      const auto values = [](int r) {
        std::vector<float> a(257), b(3);
        for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(unit(3, r, i) * (r + 1));
        for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(unit(4, r, i) * 1e-3);
        return std::vector<std::vector<float>>{a, b};
      };
      const auto got = per_rank(n, [&](ddp::communicator_ref c) {
        auto v = values(c.rank());
        ddp::detail::outer_exchange x(c, {ddp::view(v[0]), ddp::view(v[1])}, wire, "test");
        x.start();
        x.finish();
        return v;
      });
      for (std::size_t t = 0; t < 2; ++t) {
        std::vector<std::vector<float>> xs;
        double bound = 0;  // worst error of the wire, summed over ranks, divided by n
        for (int r = 0; r < n; ++r) {
          xs.push_back(values(r)[t]);
          double amax = 0;
          for (float v : xs.back()) amax = std::max(amax, std::abs(static_cast<double>(v)));
          bound += wire == ddp::outer_wire::int8 ? amax / 127 / 2 : wire == ddp::outer_wire::bf16 ? amax / 128 : 0;
        }
        bound = bound / n + 1e-6;
        for (int r = 1; r < n; ++r) CHECK(same_bits(got[0][t], got[r][t]));
        CHECK(same_bits(got[0][t], reference_average(xs, wire)));
        const auto mean = reference_average(xs, ddp::outer_wire::native);
        for (std::size_t i = 0; i < mean.size(); ++i) CHECK(std::abs(got[0][t][i] - mean[i]) <= bound);
      }
    }
  }
}

TEST_CASE("Outer exchange, int8: a non-finite outer gradient on one rank is NaN on every rank", "[local_steps]") {
  const auto got = per_rank(3, [](ddp::communicator_ref c) {
    std::vector<float> g{1.0f, -2.0f, 0.5f};
    if (c.rank() == 1) g[2] = std::numeric_limits<float>::infinity();
    ddp::detail::outer_exchange x(c, {ddp::view(g)}, ddp::outer_wire::int8, "test");
    x.start();
    x.finish();
    return g;
  });
  for (const auto& g : got) {
    for (float v : g) CHECK(std::isnan(v));
    CHECK(same_bits(g, got[0]));
  }
}

TEST_CASE("Local steps: the state a recovering replica needs", "[local_steps]") {
  test_ranks::on_ranks(2, [](ddp::communicator_ref c) {
    model<float> m = initial<float>(c.rank(), data_kind::general);
    ddp::diloco sync(c, m.views(), paper);
    auto state = sync.state();
    expect(state.size() == 6, "anchors and momentum buffers of three tensors");
    for (long t = 1; t <= 4; ++t) {
      sgd(m, gradient(m, data<float>(c.rank(), t, data_kind::general)), 0.05f);
      expect(sync.step() == (t == 4), "an outer step at the fourth inner step only");
    }
    // After an outer step the anchor is the parameters; the momentum buffers moved.
    expect(std::memcmp(state[0].data, m.wa.data(), 12) == 0 && std::memcmp(state[2].data, m.bias.data(), 4) == 0,
           "anchor == parameters after an outer step");
    expect(state[3].as<float>()[0] != 0.0f, "momentum buffer updated");
    ddp::diloco plain(c, m.views(), {.outer = {.lr = 1, .momentum = 0, .nesterov = false}});
    expect(plain.state().size() == 3, "no momentum: anchors only");
    ddp::streaming_diloco st(c, m.views(), {.sync_every = 6, .fragments = 3});
    expect(st.fragments() == 3 && st.state().size() == 6, "streaming: per fragment anchor and buffer");
  });
}

TEST_CASE("split_fragments: contiguous, about equal, none empty", "[local_steps]") {
  std::vector<float> a(10), b(1), c(1), d(10), e(1);
  const std::vector<ddp::tensor_view> ps{ddp::view(a), ddp::view(b), ddp::view(c), ddp::view(d), ddp::view(e)};
  const auto two = ddp::split_fragments(ps, 2);
  REQUIRE(two.size() == 2);
  CHECK(two[0].size() == 3);  // a, b, c: 12 of 23 elements, the first cut past half; then d, e
  CHECK(two[1].size() == 2);
  const auto three = ddp::split_fragments(ps, 3);  // a (10 >= 23/3), then b, c, d (12 >= 2 * 23/3), e
  REQUIRE(three.size() == 3);
  CHECK(three[0].size() == 1);
  CHECK(three[1].size() == 3);
  CHECK(three[2].size() == 1);
  const auto five = ddp::split_fragments(ps, 5);
  for (const auto& f : five) CHECK(f.size() == 1);
  CHECK_THROWS_AS(ddp::split_fragments(ps, 6), ddp::usage_error);
  CHECK_THROWS_AS(ddp::split_fragments(ps, 0), ddp::usage_error);
}

TEST_CASE("Local steps: bad inputs are usage errors that say what and where", "[local_steps]") {
  static_assert(!ddp::outer_optimizer<int>);
  test_ranks::on_ranks(1, [](ddp::communicator_ref c) {
    std::vector<float> w(4);
    std::vector<std::int32_t> k(4);
    const auto throws = [](auto&& f, const char* needle) {
      try {
        f();
      } catch (const ddp::usage_error& e) {
        expect(std::string(e.what()).find(needle) != std::string::npos, std::string("message: ") + e.what());
        return;
      }
      throw std::runtime_error(std::string("no usage_error for ") + needle);
    };
    throws([&] { ddp::local_sgd s(c, {ddp::view(w)}, {.sync_every = 0}); }, "sync_every is 0");
    throws([&] { ddp::diloco s(c, {ddp::view(w), ddp::view(k)}); }, "parameter 1 is i32");
    throws([&] { ddp::diloco s(c, {}); }, "no parameters");
    throws([&] { ddp::diloco s(c, {ddp::view(w)}, {.outer = {.momentum = 1.0}}); },
           "rank 0, diloco outer optimizer outer_sgd: momentum 1");
    throws([&] { ddp::diloco s(c, {ddp::view(w)}, {.outer = {.momentum = 0}}); }, "Nesterov");
    ddp::tensor_view on_gpu = ddp::view(w);
    on_gpu.where = ddp::device::cuda(0);
    throws([&] { ddp::local_sgd s(c, {on_gpu}); }, "parameter 0 is on cuda:0");
    throws([&] { ddp::streaming_diloco s(c, {ddp::view(w)}, {.sync_every = 4, .fragments = 2}); }, "2 fragments");
    std::vector<float> v(4);
    throws(
        [&] {
          ddp::streaming_diloco s(c, {ddp::view(w), ddp::view(v)}, {.sync_every = 4, .fragments = 2, .delay = 2});
        },
        "delay 2");
    throws([&] { ddp::streaming_diloco s(c, {ddp::view(w)}, {.alpha = 1.5}); }, "alpha");
  });
}

TEST_CASE("streaming_diloco::flush merges the exchanges in flight, the same bits on every rank", "[local][diloco]") {
  // H = 6, 3 fragments (one tensor each), delay 1: after 17 inner steps the last fragment (bias)
  // was sent at step 17 and would merge at step 18.
  for (int n = 2; n <= 3; ++n) {
    INFO("ranks " << n);
    struct seen {
      std::vector<float> before, after;
      std::size_t first = 0, second = 0;
    };
    const auto got = per_rank(n, [&](ddp::communicator_ref c) {
      model<float> m = initial<float>(c.rank(), data_kind::general);
      ddp::streaming_diloco<> st(c, m.views(), {.sync_every = 6, .fragments = 3, .delay = 1});
      for (long t = 1; t <= 17; ++t) {
        sgd(m, gradient(m, data<float>(c.rank(), t, data_kind::general)), 0.05f);
        st.step();
      }
      seen s;
      s.before = m.flat();
      s.first = st.flush();
      s.second = st.flush();
      s.after = m.flat();
      return s;
    });
    for (int r = 0; r < n; ++r) {
      CHECK(got[r].first == 1);
      CHECK(got[r].second == 0);
      for (std::size_t i = 0; i < 5; ++i) CHECK(got[r].after[i] == got[r].before[i]);  // wa, wb: untouched
      CHECK(got[r].after[5] == got[0].after[5]);                                       // bias: global
    }
    CHECK(got[1].before[5] != got[0].before[5]);  // it was local before
  }
}

TEST_CASE("local steps on the timeline: each exchange is a span on track local_steps", "[local][diloco][timeline]") {
  const auto count = [](const ddp::timeline::recorder& rec, const char* name, int track) {
    int n = 0;
    for (const auto& e : rec.events()) {
      n +=
          std::string_view(e.name) == name && std::string_view(e.track.name) == "local_steps" && e.track.index == track;
    }
    return n;
  };
  const auto spans = per_rank(2, [&](ddp::communicator_ref c) {
    std::vector<int> out;
    model<float> m = initial<float>(c.rank(), data_kind::general);
    ddp::timeline::recorder rec(c.rank());
    const auto train = [&](auto& sync, long steps) {
      for (long t = 1; t <= steps; ++t) {
        sgd(m, gradient(m, data<float>(c.rank(), t, data_kind::general)), 0.05f);
        sync.step();
      }
    };
    ddp::local_sgd l(c, m.views(), {.sync_every = 4});
    l.set_recorder(&rec);
    train(l, 12);  // 3 averages
    out.push_back(count(rec, "parameter average", 0));
    ddp::diloco d(c, m.views(), {.sync_every = 4});
    d.set_recorder(&rec);
    train(d, 8);  // 2 outer steps
    out.push_back(count(rec, "outer exchange", 0));
    ddp::streaming_diloco s(c, m.views(), {.sync_every = 6, .fragments = 3, .delay = 1});
    s.set_recorder(&rec);
    train(s, 12);  // fragments 0 and 1 merge at steps 2, 8 and 4, 10; fragment 2 at 6, 12
    for (int f = 0; f < 3; ++f) out.push_back(count(rec, "outer exchange", f));
    return out;
  });
  for (const auto& r : spans) {
    CHECK(r[0] == 3);
    CHECK(r[1] == 2);
    CHECK(r[2] == 2 + 2);  // diloco's two, on the same track, and fragment 0's two
    CHECK(r[3] == 2);
    CHECK(r[4] == 2);
  }
}
