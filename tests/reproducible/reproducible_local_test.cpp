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

#include <catch2/catch.hpp>
#include <ddp/local.hpp>
#include <ddp/reproducible.hpp>

#include "training.hpp"

namespace {

using ddp::item_range;
using ddp::reproducible::node;
using ddp::reproducible::tree;

template <class F>
void on_ranks(int n, F&& f) {
  ddp::local::options opts;
  opts.timeout = std::chrono::seconds(20);
  ddp::local::run(n, [&](ddp::local::communicator& c) { f(ddp::communicator_ref(c)); }, opts);
}

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

TEST_CASE("accumulator: any order of adds gives the tree's bits, in O(log M) buffers in order", "[reproducible][unit]") {
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
    std::string line_r = "M=" + std::to_string(m) + " reproducible:", line_d = "M=" + std::to_string(m) + " default:     ";
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
