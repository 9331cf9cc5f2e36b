// Layout policies on their own: no communication involved.
#include <catch2/catch.hpp>
#include <ddp/bucketing/fixed.hpp>
#include <ddp/bucketing/rebuild_once.hpp>
#include <ddp/bucketing/size_capped.hpp>

#include <algorithm>
#include <sstream>

namespace {
std::vector<ddp::gradient_info> grads_of(std::vector<std::pair<ddp::dtype, std::size_t>> shapes) {
  std::vector<ddp::gradient_info> g;
  for (std::size_t i = 0; i < shapes.size(); ++i)
    g.push_back({i, shapes[i].second, shapes[i].first, ddp::device::host()});
  return g;
}
using B = std::vector<std::vector<std::size_t>>;
}  // namespace

TEST_CASE("size_capped: reverse registration order, small bucket first", "[bucketing]") {
  // 4-byte floats: sizes in bytes 400, 400, 400, 2000, 400
  const auto g = grads_of({{ddp::dtype::f32, 100},
                           {ddp::dtype::f32, 100},
                           {ddp::dtype::f32, 100},
                           {ddp::dtype::f32, 500},
                           {ddp::dtype::f32, 100}});
  const ddp::bucketing::size_capped p{.cap_bytes = 1000, .small_bucket_bytes = 500};
  // walk 4,3,2,1,0: {4,3} closes the small bucket (2400 >= 500), {2,1,0} never reaches 1000 -> tail
  CHECK(p.layout(g).buckets == B{{4, 3}, {2, 1, 0}});
  const ddp::bucketing::size_capped q{.cap_bytes = 800, .small_bucket_bytes = 300};
  CHECK(q.layout(g).buckets == B{{4}, {3}, {2, 1}, {0}});
}

TEST_CASE("size_capped: small bucket last is an explicit choice", "[bucketing]") {
  const auto g = grads_of({{ddp::dtype::f32, 100},
                           {ddp::dtype::f32, 100},
                           {ddp::dtype::f32, 100},
                           {ddp::dtype::f32, 100},
                           {ddp::dtype::f32, 100}});
  const ddp::bucketing::size_capped p{.cap_bytes = 800, .small_bucket_bytes = 400, .small_at = ddp::small_bucket::last};
  const auto l = p.layout(g);
  REQUIRE(l.size() == 3);
  CHECK(l.buckets.back() == std::vector<std::size_t>{0});  // the last to launch holds the last-ready gradient only
  CHECK(l.buckets.front() == std::vector<std::size_t>{4, 3});
}

TEST_CASE("size_capped: tapered cuts small buckets at both ends, doubling up to the cap", "[bucketing]") {
  std::vector<std::pair<ddp::dtype, std::size_t>> shapes(10, {ddp::dtype::f32, 100});  // 400 bytes each
  const auto g = grads_of(shapes);
  const ddp::bucketing::size_capped p{
      .cap_bytes = 1600, .small_bucket_bytes = 400, .small_at = ddp::small_bucket::tapered};
  using B = std::vector<std::vector<std::size_t>>;
  // ready order 9..0; limits from the front 400, 800, 1600 and from the back 400, 800: they meet
  CHECK(p.layout(g).buckets == B{{9}, {8, 7}, {6, 5, 4, 3}, {2, 1}, {0}});
  std::ostringstream os;
  os << p;
  CHECK(os.str() == "size_capped{cap_bytes=1600, small_bucket_bytes=400, small_at=tapered}");

  // Two dtypes interleaved: each tapers on its own; every gradient once; launch order = ready order.
  std::vector<std::pair<ddp::dtype, std::size_t>> mixed;
  for (int i = 0; i < 12; ++i) mixed.emplace_back(i % 3 == 0 ? ddp::dtype::f16 : ddp::dtype::f32, 100 + 50 * i);
  const auto m = grads_of(mixed);
  const auto l = p.layout(m);
  CHECK_FALSE(ddp::detail::validate_layout(l, m).has_value());
  std::vector<int> seen(m.size(), 0);
  std::size_t last_ready = 0;
  for (const auto& bucket : l.buckets) {
    for (std::size_t i : bucket) ++seen[i];
    const std::size_t ready = m.size() - 1 - *std::min_element(bucket.begin(), bucket.end());  // order is 11..0
    CHECK(ready >= last_ready);
    last_ready = ready;
  }
  CHECK(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
}

TEST_CASE("size_capped: dtypes never mix; a bucket overshoots the cap by at most one gradient", "[bucketing]") {
  const auto g = grads_of({{ddp::dtype::f32, 10},
                           {ddp::dtype::f16, 10},
                           {ddp::dtype::f32, 100000},
                           {ddp::dtype::f16, 10},
                           {ddp::dtype::f32, 10}});
  const ddp::bucketing::size_capped p{.cap_bytes = 1000, .small_bucket_bytes = 1000};
  const auto l = p.layout(g);
  CHECK_FALSE(ddp::detail::validate_layout(l, g).has_value());
  for (const auto& b : l.buckets) {
    for (std::size_t i : b) CHECK(g[i].type == g[b.front()].type);
  }
  // walk 4,3,2,1,0: the open f32 bucket {4} takes the huge gradient 2 and closes (PyTorch's rule)
  CHECK(l.buckets.front() == std::vector<std::size_t>{4, 2});
  CHECK(l.size() == 3);
}

TEST_CASE("rebuild_once: regroups by the given ready order", "[bucketing]") {
  const auto g = grads_of({{ddp::dtype::f32, 100}, {ddp::dtype::f32, 100}, {ddp::dtype::f32, 100}});
  const ddp::bucketing::rebuild_once p{.cap_bytes = 800, .small_bucket_bytes = 400};
  CHECK(p.layout(g).buckets == B{{2}, {1, 0}});
  const std::vector<std::size_t> order{0, 2, 1};
  CHECK(p.rebuild(g, order).buckets == B{{0}, {2, 1}});
  STATIC_REQUIRE(ddp::rebuilding_policy<ddp::bucketing::rebuild_once>);
  STATIC_REQUIRE_FALSE(ddp::rebuilding_policy<ddp::bucketing::size_capped>);
  STATIC_REQUIRE(ddp::fixed_layout_policy<ddp::bucketing::fixed>);
  STATIC_REQUIRE_FALSE(ddp::fixed_layout_policy<ddp::bucketing::rebuild_once>);
}

TEST_CASE("validate_layout names the problem", "[bucketing]") {
  const auto g = grads_of({{ddp::dtype::f32, 1}, {ddp::dtype::f64, 1}});
  CHECK(ddp::detail::validate_layout({B{{0, 1}}}, g).value().find("mixes f32") != std::string::npos);
  CHECK(ddp::detail::validate_layout({B{{0}}}, g).value().find("gradient 1 is in no bucket") != std::string::npos);
  CHECK(ddp::detail::validate_layout({B{{0}, {1}, {}}}, g).value().find("empty") != std::string::npos);
  CHECK(ddp::detail::validate_layout({B{{0}, {7}}}, g).value().find("only 2 are registered") != std::string::npos);
}

TEST_CASE("policies are printable and comparable", "[bucketing]") {
  std::ostringstream os;
  os << ddp::bucketing::size_capped{};
  CHECK(os.str() == "size_capped{cap_bytes=26214400, small_bucket_bytes=1048576, small_at=first}");
  CHECK(ddp::bucketing::rebuild_once{} == ddp::bucketing::rebuild_once{});
  CHECK_FALSE(ddp::bucketing::fixed{} == ddp::bucketing::fixed{.sizes = {.cap_bytes = 1}});
}

// A user-written policy: one bucket per gradient, in registration order.
struct one_per_gradient {
  ddp::bucket_layout layout(std::span<const ddp::gradient_info> g) const {
    ddp::bucket_layout l;
    for (const auto& x : g) l.buckets.push_back({x.index});
    return l;
  }
};
static_assert(ddp::bucketing_policy<one_per_gradient>);
struct not_a_policy {};
static_assert(!ddp::bucketing_policy<not_a_policy>);
