// The reproducible reduction over local ranks (threads): the tree and its covers, the local
// accumulator against a direct evaluation of the tree, and training at DP = 1..8 giving
// bit-identical parameters, while the default Bucketer path does not.
#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <thread>

#include <catch2/catch.hpp>
#include <ddp/local.hpp>
#include <ddp/reproducible.hpp>

#include "../common/collective_suite.hpp"
#include "../common/ranks.hpp"
#include "training.hpp"

#define SUITE_EXPECT_THROW(expr, type)             \
  do {                                             \
    bool thrown_ = false;                          \
    try {                                          \
      expr;                                        \
    } catch (const type&) {                        \
      thrown_ = true;                              \
    }                                              \
    SUITE_EXPECT(thrown_, #expr " throws " #type); \
  } while (0)

namespace {

using ddp::item_range;
using ddp::reproducible::node;
using ddp::reproducible::tree;

using test_ranks::on_ranks;

// Direct recursive evaluation of node n over leaf values (one float per leaf).
float direct(const tree& t, node n, const std::vector<float>& leaf) {
  if (n.level == 0) return leaf[n.index];
  const node r = tree::right(n);
  const float a = direct(t, tree::left(n), leaf);
  if (!t.exists(r)) return a;
  return a + direct(t, r, leaf);
}

std::uint32_t bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

}  // namespace

TEST_CASE("contiguous_share: balanced contiguous ranges that partition the items", "[reproducible][unit]") {
  CHECK(ddp::contiguous_share(10, 3, 0) == item_range{0, 4});
  CHECK(ddp::contiguous_share(10, 3, 1) == item_range{4, 7});
  CHECK(ddp::contiguous_share(10, 3, 2) == item_range{7, 10});
  CHECK(ddp::contiguous_share(2, 4, 3).empty());
  for (std::size_t items = 0; items < 40; ++items) {
    for (int parts = 1; parts <= 9; ++parts) {
      std::size_t next = 0;
      for (int k = 0; k < parts; ++k) {
        const auto r = ddp::contiguous_share(items, parts, k);
        CHECK(r.first == next);
        CHECK(r.size() >= items / static_cast<std::size_t>(parts));
        CHECK(r.size() <= items / static_cast<std::size_t>(parts) + 1);
        next = r.last;
      }
      CHECK(next == items);
    }
  }
  CHECK_THROWS_AS(ddp::contiguous_share(4, 0, 0), ddp::usage_error);
  CHECK_THROWS_AS(ddp::contiguous_share(4, 2, 2), ddp::usage_error);
}

TEST_CASE("tree: spans, pass-through nodes, covers partition every range into maximal nodes", "[reproducible][unit]") {
  const tree t5(5);
  CHECK(t5.height() == 3);
  CHECK(t5.leaves_of(t5.root()) == item_range{0, 5});
  CHECK(t5.leaves_of({2, 1}) == item_range{4, 5});
  CHECK_FALSE(t5.exists({1, 3}));
  CHECK(t5.cover({0, 5}) == std::vector<node>{t5.root()});
  CHECK(t5.cover({4, 5}) == std::vector<node>{{2, 1}});  // the highest node over leaf 4 alone
  CHECK(t5.cover({1, 4}) == std::vector<node>{{0, 1}, {1, 1}});
  CHECK(tree(1).height() == 0);
  CHECK(tree(1).cover({0, 1}) == std::vector<node>{{0, 0}});
  CHECK(tree(8).max_cover(4) == 1);  // aligned: one node per rank
  CHECK(tree(8).max_cover(3) == 2);
  CHECK_THROWS_AS(tree(0), ddp::usage_error);
  CHECK_THROWS_AS(t5.cover({2, 6}), ddp::usage_error);

  for (std::size_t m = 1; m <= 70; ++m) {
    const tree t(m);
    for (std::size_t a = 0; a <= m; ++a) {
      for (std::size_t b = a; b <= m; ++b) {
        const auto c = t.cover({a, b});
        std::size_t pos = a;
        for (const node n : c) {
          REQUIRE(t.exists(n));
          REQUIRE(t.first(n) == pos);
          pos = t.last(n);
          // maximal: the parent is the root's parent or reaches outside [a, b)
          if (n.level < t.height()) {
            const node up = tree::parent(n);
            CHECK((t.first(up) < a || t.last(up) > b));
          }
        }
        REQUIRE(pos == b);
        CHECK(c.size() <= 2 * static_cast<std::size_t>(std::bit_width(b - a + 1)));
      }
    }
  }
}

TEST_CASE("accumulator: any order of adds gives the tree's bits, in O(log M) buffers in order",
          "[reproducible][unit]") {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1e3f, 1e3f);
  for (std::size_t m : {1u, 2u, 3u, 5u, 7u, 8u, 13u, 16u, 33u}) {
    const tree t(m);
    std::vector<float> leaf(m);
    for (auto& x : leaf) x = u(rng) * std::pow(10.0f, static_cast<float>(rng() % 7) - 3.0f);
    for (int trial = 0; trial < 20; ++trial) {
      std::size_t a = rng() % (m + 1), b = rng() % (m + 1);
      if (a > b) std::swap(a, b);
      if (trial == 0) a = 0, b = m;
      ddp::reproducible::accumulator acc(t, ddp::reproducible::layout({{ddp::dtype::f32, 1}}));
      acc.begin({a, b});
      std::vector<std::size_t> order(b - a);
      std::iota(order.begin(), order.end(), a);
      const bool in_order = trial % 2 == 0;
      if (!in_order) std::shuffle(order.begin(), order.end(), rng);
      for (std::size_t i : order) {
        std::array<float, 1> g{leaf[i]};
        acc.add(i, ddp::view(g));
        g[0] = 12345.0f;  // the accumulator copied or added it already
      }
      REQUIRE(acc.complete());
      REQUIRE(acc.nodes() == t.cover({a, b}));
      for (const node n : acc.nodes()) {
        const float got = acc.value(n, 0).as<float>()[0];
        CHECK(bits(got) == bits(direct(t, n, leaf)));
      }
      if (in_order) CHECK(acc.buffers_allocated() <= t.height() + 1);
    }
  }
}

TEST_CASE("accumulator: errors name the problem", "[reproducible][unit]") {
  const tree t(8);
  ddp::reproducible::accumulator acc(t, ddp::reproducible::layout({{ddp::dtype::f32, 2}}));
  acc.begin({2, 6});
  std::vector<float> g(2, 1.0f), wrong(3, 1.0f);
  CHECK_THROWS_WITH(acc.add(1, ddp::view(g)), Catch::Contains("not in this rank's range [2, 6)"));
  acc.add(2, ddp::view(g));
  acc.add(3, ddp::view(g));  // combined into node (1, 1)
  CHECK_THROWS_WITH(acc.add(3, ddp::view(g)), Catch::Contains("already added"));
  CHECK_THROWS_WITH(acc.add(4, ddp::view(wrong)), Catch::Contains("the layout wants 2 f32"));
  CHECK(acc.pending() == std::vector<std::size_t>{4, 5});
  CHECK_THROWS_AS(ddp::reproducible::layout({{ddp::dtype::i32, 2}}), ddp::usage_error);
}

TEST_CASE("ReproducibleReducer: training at DP = 1..8 gives bit-identical parameters; the default path does not",
          "[reproducible][local]") {
  constexpr int steps = 12;
  for (std::size_t m : {1u, 4u, 6u, 8u, 12u, 13u}) {
    std::map<int, std::string> repro, plain;
    for (int dp = 1; dp <= 8; ++dp) {
      std::vector<std::string> fr(static_cast<std::size_t>(dp)), fd(fr.size());
      on_ranks(dp, [&](ddp::communicator_ref c) {
        ddp::reproducible_options o;
        o.chunk_bytes = 64 * (1 + c.size() % 3);  // several chunks and windows: must not matter
        o.max_chunks_in_flight = 1 + static_cast<std::size_t>(c.size()) % 3;
        fr[static_cast<std::size_t>(c.rank())] = repro_training::train_reproducible(c, m, steps, o);
        fd[static_cast<std::size_t>(c.rank())] = repro_training::train_default(c, m, steps);
      });
      for (int r = 1; r < dp; ++r) {  // every rank of one run holds the same bits, either way
        CHECK(fr[static_cast<std::size_t>(r)] == fr[0]);
        CHECK(fd[static_cast<std::size_t>(r)] == fd[0]);
      }
      repro[dp] = fr[0];
      plain[dp] = fd[0];
    }
    std::string line_r = "M=" + std::to_string(m) + " reproducible:",
                line_d = "M=" + std::to_string(m) + " default:     ";
    for (int dp = 1; dp <= 8; ++dp) {
      line_r += " DP" + std::to_string(dp) + "=" + repro[dp];
      line_d += " DP" + std::to_string(dp) + "=" + plain[dp];
    }
    WARN(line_r << "\n" << line_d);
    for (int dp = 2; dp <= 8; ++dp) CHECK(repro[dp] == repro[1]);
    if (m >= 4) {
      std::set<std::string> distinct;
      for (int dp = 1; dp <= 4; ++dp) distinct.insert(plain[dp]);
      CHECK(distinct.size() > 1);  // the default path's bits depend on the world size
    }
  }
}

namespace {

// One step over mixed dtypes (f32, f64, bf16, f16 and an empty tensor) with random leaves;
// returns the reduced bytes of every tensor.
std::vector<std::vector<unsigned char>> mixed_step(ddp::communicator_ref c, std::size_t m,
                                                   ddp::reproducible_options o) {
  std::vector<float> a(37);
  std::vector<double> b(5);
  std::vector<ddp::bfloat16> h(9);
  std::vector<ddp::half> f(11);
  std::vector<float> empty;
  ddp::ReproducibleReducer red(c, m, o);
  red.add(a);
  red.add(b);
  red.add(h);
  red.add(empty);
  red.add(f);
  red.begin();
  for (std::size_t i : red.pending()) {
    std::mt19937_64 rng(i * 7919 + 1);
    std::normal_distribution<double> n(0.0, 100.0);
    for (auto& x : a) x = static_cast<float>(n(rng));
    for (auto& x : b) x = n(rng) * 1e-7;
    for (auto& x : h) x = ddp::bfloat16(static_cast<float>(n(rng)));
    for (auto& x : f) x = ddp::half(static_cast<float>(n(rng)) * 0.01f);
    red.accumulate(i);
  }
  red.finalize();
  auto bytes = [](auto& v) {
    std::vector<unsigned char> out(v.size() * sizeof(v[0]));
    if (!out.empty()) std::memcpy(out.data(), v.data(), out.size());
    return out;
  };
  return {bytes(a), bytes(b), bytes(h), bytes(f)};
}

}  // namespace

TEST_CASE("ReproducibleReducer: mixed dtypes, empty tensors and more ranks than micro-batches",
          "[reproducible][local]") {
  for (std::size_t m : {1u, 3u, 10u}) {
    std::vector<std::vector<unsigned char>> reference;
    for (int dp = 1; dp <= 6; ++dp) {
      std::vector<std::vector<std::vector<unsigned char>>> got(static_cast<std::size_t>(dp));
      on_ranks(dp, [&](ddp::communicator_ref c) {
        ddp::reproducible_options o;
        o.chunk_bytes = c.size() % 2 ? 0 : 24;  // whole groups, or chunks of a few elements
        got[static_cast<std::size_t>(c.rank())] = mixed_step(c, m, o);
      });
      if (dp == 1) reference = got[0];
      INFO("M=" << m << " DP=" << dp);
      for (const auto& g : got) CHECK(g == reference);
    }
  }
}

TEST_CASE("ReproducibleReducer: a retry reuses the nodes of a failed attempt and gives the same bits",
          "[reproducible][local]") {
  // The first attempt runs at DP=3 and "fails" (its result is thrown away); the retry of the same
  // step (same key) runs at DP=2 over the survivors' ranks, reusing every node that lies in their
  // new range. The result must equal a fresh DP=2 and a DP=1 computation.
  constexpr std::size_t m = 12;
  auto leaf = [](std::size_t i, std::vector<float>& g) {
    for (std::size_t k = 0; k < g.size(); ++k) g[k] = std::sin(static_cast<float>(i * 31 + k)) * 1e3f + 1e-3f;
  };
  ddp::local::fabric fab(ddp::local::options{.timeout = std::chrono::seconds(20), .faults = {}});
  // The reuse itself, on one reducer whose communicator shrinks: a replica that held [4, 8) of
  // 3 ranks and is rank 1 of 2 afterwards ([6, 12)) keeps nothing; rank 0 ([0, 4) -> [0, 6))
  // keeps node (2, 0) and computes 4 and 5 only.
  struct switchable {
    ddp::local::communicator* cur;
    int rank() const { return cur->rank(); }
    int size() const { return cur->size(); }
    ddp::work allreduce(std::span<const ddp::tensor_view> t, ddp::reduce_op op) { return cur->allreduce(t, op); }
    ddp::work broadcast(std::span<const ddp::tensor_view> t, int root) { return cur->broadcast(t, root); }
    ddp::work allgather(ddp::tensor_view a, ddp::tensor_view b) { return cur->allgather(a, b); }
    ddp::work reduce_scatter(ddp::tensor_view a, ddp::tensor_view b, ddp::reduce_op op) {
      return cur->reduce_scatter(a, b, op);
    }
    ddp::work barrier() { return cur->barrier(); }
    void abort() noexcept { cur->abort(); }
  };
  std::vector<float> out0(100), out1(100);
  std::array<ddp::reproducible_stats, 2> st{};
  {
    std::vector<ddp::local::communicator> big, small;
    for (int r = 0; r < 3; ++r) big.push_back(fab.connect("big", r, 3));
    for (int r = 0; r < 2; ++r) small.push_back(fab.connect("small", r, 2));
    std::vector<std::thread> ts;
    std::vector<switchable> sw{{&big[0]}, {&big[1]}, {&big[2]}};
    std::vector<std::vector<float>> g(3, std::vector<float>(100));
    for (int r = 0; r < 3; ++r) {
      ts.emplace_back([&, r] {
        const auto ur = static_cast<std::size_t>(r);
        ddp::ReproducibleReducer red(sw[ur], m, {.reuse_after_failure = true});
        red.add(g[ur]);
        red.begin(7);
        for (std::size_t i : red.pending()) {
          leaf(i, g[ur]);
          red.accumulate(i);
        }
        red.finalize();      // "fails": not applied
        if (r == 2) return;  // replica 2 dies; replicas 0 and 1 retry as ranks 0 and 1 of 2
        sw[ur].cur = &small[ur];
        red.begin(7);
        const auto todo = red.pending();
        for (std::size_t i : todo) {
          leaf(i, g[ur]);
          red.accumulate(i);
        }
        red.finalize();
        st[ur] = red.last_step();
        (r == 0 ? out0 : out1) = g[ur];
      });
    }
    for (auto& t : ts) t.join();
  }
  CHECK(st[0].reused == 4);  // node (2, 0): micro-batches 0..3
  CHECK(st[0].computed == 2);
  CHECK(st[1].reused == 0);  // [4, 8) does not fit in [6, 12) as whole nodes: (2, 1) is [4, 8)
  CHECK(st[1].computed == 6);
  // Reference: DP=1.
  std::vector<float> ref(100);
  on_ranks(1, [&](ddp::communicator_ref c) {
    ddp::ReproducibleReducer red(c, m);
    red.add(ref);
    for (std::size_t i = 0; i < m; ++i) {
      leaf(i, ref);
      red.accumulate(i);
    }
    red.finalize();
  });
  CHECK(out0 == ref);
  CHECK(out1 == ref);
}

TEST_CASE("ReproducibleReducer: usage errors", "[reproducible][local]") {
  on_ranks(2, [](ddp::communicator_ref c) {
    std::vector<float> g(4);
    std::vector<int> ints(4);
    {
      ddp::ReproducibleReducer red(c, 4);
      SUITE_EXPECT_THROW(red.add(ints), ddp::usage_error);
      red.add(g);
      SUITE_EXPECT_THROW(red.add(g), ddp::usage_error);  // the same memory twice
      red.build();
      std::vector<float> late(2);
      SUITE_EXPECT_THROW(red.add(late), ddp::usage_error);
      red.begin();
      const auto r = red.range();
      red.accumulate(r.first);
      SUITE_EXPECT_THROW(red.accumulate(r.first), ddp::usage_error);
      SUITE_EXPECT_THROW(red.accumulate(r.first == 0 ? 3 : 0), ddp::usage_error);  // another rank's
      // The last micro-batch of the range is missing: an error before any collective.
      bool named = false;
      try {
        red.finalize();
      } catch (const ddp::usage_error& e) {
        named = std::string(e.what()).find("were never accumulated (" + std::to_string(r.first + 1) + ")") !=
                std::string::npos;
      }
      SUITE_EXPECT(named, "finalize names the missing micro-batch");
    }
    // Ranks that disagree on the micro-batches fail together in build().
    ddp::ReproducibleReducer red(c, c.rank() == 0 ? 4 : 5);
    red.add(g);
    SUITE_EXPECT_THROW(red.build(), ddp::usage_error);
  });
}
