// Single-process checks of the strategy types: the concept, names, equality (which decides
// grouping), type erasure, and the vocabulary structs.

#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/buffer_reducer.hpp>
#include <ddp/strategies/allreduce.hpp>
#include <ddp/strategies/any.hpp>
#include <ddp/strategies/broadcast.hpp>
#include <ddp/strategies/custom.hpp>
#include <ddp/strategies/none.hpp>

namespace st = ddp::strategies;

// Named (not anonymous) namespace: clang flags unused internal declarations used only in
// unevaluated operands.
namespace strategies_test {
struct not_a_strategy {};
struct no_name {
  ddp::work sync(const ddp::buffer_group&) const { return ddp::work::ready(); }
  friend bool operator==(const no_name&, const no_name&) = default;
};
struct my_strategy {
  int knob = 0;
  ddp::work sync(const ddp::buffer_group&) const { return ddp::work::ready(); }
  std::string name() const { return "mine(" + std::to_string(knob) + ")"; }
  friend bool operator==(const my_strategy&, const my_strategy&) = default;
};
struct returns_work {
  ddp::work operator()(std::span<const ddp::tensor_view>, ddp::communicator_ref) const { return ddp::work::ready(); }
};
struct returns_optional {
  std::optional<ddp::work> operator()(const ddp::buffer_group&) const { return std::nullopt; }
};
struct returns_void {
  void operator()(std::span<const ddp::tensor_view>, ddp::communicator_ref) const {}
};
}  // namespace strategies_test

using namespace strategies_test;

TEST_CASE("strategies model buffer_strategy; other types do not", "[buffer_reducer][unit]") {
  STATIC_REQUIRE(ddp::buffer_strategy<st::broadcast>);
  STATIC_REQUIRE(ddp::buffer_strategy<st::allreduce_sum>);
  STATIC_REQUIRE(ddp::buffer_strategy<st::allreduce_mean>);
  STATIC_REQUIRE(ddp::buffer_strategy<st::allreduce_min>);
  STATIC_REQUIRE(ddp::buffer_strategy<st::allreduce_max>);
  STATIC_REQUIRE(ddp::buffer_strategy<st::none>);
  STATIC_REQUIRE(ddp::buffer_strategy<st::any>);
  STATIC_REQUIRE(ddp::buffer_strategy<st::custom<returns_work>>);
  STATIC_REQUIRE(ddp::buffer_strategy<my_strategy>);
  STATIC_REQUIRE(!ddp::buffer_strategy<not_a_strategy>);
  STATIC_REQUIRE(!ddp::buffer_strategy<no_name>);
  STATIC_REQUIRE(!ddp::buffer_strategy<int>);

  STATIC_REQUIRE(st::custom_callable<returns_work>);
  STATIC_REQUIRE(st::custom_callable<returns_optional>);
  STATIC_REQUIRE(!st::custom_callable<returns_void>);
  STATIC_REQUIRE(ddp::joinable<ddp::BufferReducer<>>);
  STATIC_REQUIRE(ddp::joinable<ddp::BufferReducer<st::any>>);
}

TEST_CASE("strategy knobs are aggregates with names and equality", "[buffer_reducer][unit]") {
  CHECK(st::broadcast{}.root == 0);
  CHECK(st::broadcast{.root = 1}.name() == "broadcast(root=1)");
  CHECK(st::broadcast{.root = 1} == st::broadcast{.root = 1});
  CHECK(st::broadcast{.root = 1} != st::broadcast{.root = 2});
  CHECK(st::allreduce_sum{}.name() == "allreduce(sum)");
  CHECK(st::allreduce_mean{}.name() == "allreduce(avg)");
  CHECK(st::allreduce_min{}.name() == "allreduce(min)");
  CHECK(st::allreduce_max{}.name() == "allreduce(max)");
  CHECK(st::none{}.name() == "none");
  CHECK_FALSE(st::none{}.communicates());
  // issue #13 (8): a mean's divisor under join is a knob; the default keeps the old name
  CHECK(st::allreduce_mean{}.divide_by == st::mean_divisor::training_ranks);
  CHECK(st::allreduce_mean{.divide_by = st::mean_divisor::world_size}.name() ==
        "allreduce(avg, divided by world size)");
  CHECK(st::allreduce_mean{.divide_by = st::mean_divisor::join_options}.name() ==
        "allreduce(avg, divided by join options)");
  CHECK(st::allreduce_mean{} != st::allreduce_mean{.divide_by = st::mean_divisor::world_size});
  CHECK(st::allreduce_sum{} == st::allreduce_sum{.divide_by = st::mean_divisor::world_size});  // ignored by sums
  CHECK(st::allreduce_sum{.divide_by = st::mean_divisor::world_size}.name() == "allreduce(sum)");
  std::ostringstream os;
  os << st::broadcast{.root = 3} << " " << st::allreduce_sum{};
  CHECK(os.str() == "broadcast(root=3) allreduce(sum)");
}

TEST_CASE("any: equal when it holds equal strategies of one type", "[buffer_reducer][unit]") {
  const st::any a = st::broadcast{.root = 1};
  const st::any b = st::broadcast{.root = 1};
  const st::any c = st::broadcast{.root = 2};
  const st::any d = st::allreduce_sum{};
  const st::any e = my_strategy{.knob = 1};
  CHECK(a == b);
  CHECK(a != c);
  CHECK(a != d);
  CHECK(d == st::any(st::allreduce_sum{}));
  CHECK(d != st::any(st::allreduce_max{}));
  CHECK(e == st::any(my_strategy{.knob = 1}));
  CHECK(a.name() == "broadcast(root=1)");
  CHECK(e.name() == "mine(1)");
  REQUIRE(a.target<st::broadcast>() != nullptr);
  CHECK(a.target<st::broadcast>()->root == 1);
  CHECK(a.target<st::allreduce_sum>() == nullptr);
  CHECK(st::any(st::none{}).communicates() == false);
  CHECK(st::any(my_strategy{}).communicates() == true);
  const st::any copy = a;
  CHECK(copy == a);
}

TEST_CASE("custom: copies of one object are equal, separately made ones are not", "[buffer_reducer][unit]") {
  const st::custom one(returns_work{});
  const st::custom copy = one;
  const st::custom other(returns_work{}, "other");
  CHECK(one == copy);
  CHECK_FALSE(one == other);
  CHECK(one.name() == "custom");
  CHECK(other.name() == "other");
  CHECK(st::any(one) == st::any(copy));
  CHECK(st::any(one) != st::any(other));
}

TEST_CASE("options and stats are comparable and printable", "[buffer_reducer][unit]") {
  CHECK(ddp::buffer_reducer_options{} == ddp::buffer_reducer_options{.period = 1});
  CHECK(ddp::buffer_reducer_options{.period = 4} != ddp::buffer_reducer_options{});
  std::ostringstream os;
  os << ddp::buffer_reducer_options{.period = 4};
  CHECK(os.str() == "{period=4}");
  ddp::buffer_reducer_stats s;
  s.groups = 2;
  s.collectives_per_sync = 2;
  CHECK(s == s);
  CHECK(s != ddp::buffer_reducer_stats{});
  std::ostringstream so;
  so << s;
  CHECK(so.str().find("collectives_per_sync=2") != std::string::npos);
}

TEST_CASE("flat_layout groups by strategy, dtype and device, in first-registration order", "[buffer_reducer][unit]") {
  using ddp::detail::flat_member;
  const std::vector<flat_member> members{
      {0, ddp::dtype::f32, ddp::device::host(), 4, false},   // group 0
      {1, ddp::dtype::f32, ddp::device::host(), 2, false},   // group 1 (other strategy)
      {0, ddp::dtype::f32, ddp::device::host(), 3, true},    // group 0
      {0, ddp::dtype::i64, ddp::device::host(), 5, false},   // group 2 (other dtype), alone: no storage
      {0, ddp::dtype::f32, ddp::device::cuda(0), 7, false},  // group 3 (device): no storage
      {0, ddp::dtype::f32, ddp::device::cuda(0), 1, false},  // group 3
  };
  const ddp::detail::flat_layout layout(members);
  REQUIRE(layout.groups().size() == 4);
  const auto& g0 = layout.groups()[0];
  CHECK(g0.members == std::vector<std::size_t>{0, 2});
  CHECK(g0.offsets == std::vector<std::size_t>{0, 4});
  CHECK(g0.count == 7);
  CHECK(static_cast<bool>(g0.storage));
  CHECK(reinterpret_cast<std::uintptr_t>(g0.storage.data()) % 64 == 0);
  CHECK(layout.slice_of(2).data == g0.storage.data() + 4 * sizeof(float));
  CHECK(layout.slice_of(2).count == 3);
  CHECK(static_cast<bool>(layout.groups()[1].storage) == false);  // one trainer buffer: runs in place
  CHECK(static_cast<bool>(layout.groups()[2].storage) == false);
  CHECK(static_cast<bool>(layout.groups()[3].storage) == false);  // device memory is never packed by the host
  CHECK(layout.group_of(5) == 3);
  CHECK(layout.position_of(5) == 1);
  // emplaced storage starts zeroed
  const float* p = reinterpret_cast<const float*>(g0.storage.data());
  for (std::size_t i = 0; i < g0.count; ++i) CHECK(p[i] == 0.0f);
}
