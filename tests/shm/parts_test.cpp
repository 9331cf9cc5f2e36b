// The pieces of ddp::shm that need no second rank: topology from labels, the segment layout,
// the arena allocator, tensor groups, options.
#include <catch2/catch.hpp>
#include <ddp/shm.hpp>

#include <memory>
#include <sstream>
#include <vector>

TEST_CASE("shm parts: topology from labels", "[shm][unit]") {
  // Interleaved, arbitrary labels: nodes are numbered by their lowest rank.
  const std::vector<int> labels{7, 3, 7, 3, 9};
  const auto t1 = ddp::shm::node_topology::from_labels(1, labels);
  REQUIRE(t1.nodes == 3);
  REQUIRE(t1.node == 1);
  REQUIRE(t1.node_rank == 0);
  REQUIRE(t1.node_size == 2);
  REQUIRE(t1.is_leader());
  REQUIRE(t1.leaders == std::vector<int>{0, 1, 4});
  const auto t2 = ddp::shm::node_topology::from_labels(2, labels);
  REQUIRE(t2.node == 0);
  REQUIRE(t2.node_rank == 1);
  REQUIRE(!t2.is_leader());
  REQUIRE(t2.leader() == 0);
  REQUIRE(t2.node_ranks() == std::vector<int>{0, 2});
  REQUIRE_THROWS_AS(ddp::shm::node_topology::from_labels(5, labels), ddp::usage_error);
}

TEST_CASE("shm parts: segment layout", "[shm][unit]") {
  const ddp::shm::segment_layout l(3, 5000, 10000);
  REQUIRE(l.chunk_bytes() == 8192);  // rounded up to pages
  REQUIRE(l.arena_bytes() == 12288);
  REQUIRE(l.control(1) - l.control(0) == sizeof(ddp::shm::rank_control));
  REQUIRE(l.control(0) % ddp::shm::line_bytes == 0);
  REQUIRE(l.slot(0, 0) % ddp::shm::page_bytes == 0);
  REQUIRE(l.slot(1, 0) == l.slot(0, 1) + l.chunk_bytes());
  REQUIRE(l.arena(0) == l.slot(2, 1) + l.chunk_bytes());
  REQUIRE(l.total_bytes() == l.arena(2) + l.arena_bytes());
  std::vector<std::byte> mem(l.total_bytes() + ddp::shm::page_bytes);
  auto* base = reinterpret_cast<std::byte*>(ddp::shm::round_up(reinterpret_cast<std::uintptr_t>(mem.data()), 4096));
  l.initialise(base);
  REQUIRE_NOTHROW(l.check(base, 0));
  REQUIRE_THROWS_AS(ddp::shm::segment_layout(3, 4096, 10000).check(base, 0), ddp::usage_error);
}

TEST_CASE("shm parts: arena first fit, coalescing, exhaustion", "[shm][unit]") {
  std::vector<std::byte> mem(64 * 1024);
  auto a = std::make_shared<ddp::shm::arena>(mem.data(), mem.size(), nullptr);
  REQUIRE(a->capacity() == 64 * 1024);
  auto b1 = ddp::shm::allocate(a, 1000, 0);  // one granule rounding: 1024
  auto b2 = ddp::shm::allocate(a, 30000, 0);
  auto b3 = ddp::shm::allocate(a, 1, 0);
  REQUIRE(b1.data() == mem.data());
  REQUIRE(a->contains(b2.data(), 30000));
  REQUIRE(!a->contains(mem.data() + mem.size() - 8, 16));
  REQUIRE(reinterpret_cast<std::uintptr_t>(b2.data()) % ddp::shm::arena::granule ==
          reinterpret_cast<std::uintptr_t>(mem.data()) % ddp::shm::arena::granule);
  REQUIRE_THROWS_AS(ddp::shm::allocate(a, 40000, 0), ddp::usage_error);
  b2 = {};
  b1 = {};
  auto big = ddp::shm::allocate(a, 31000, 0);  // fits only because b1's and b2's runs merged
  REQUIRE(big.data() == mem.data());
  b3 = {};
  big = {};
  REQUIRE(a->used() == 0);
  REQUIRE(ddp::shm::allocate(a, 64 * 1024, 0).size() == 64 * 1024);
}

TEST_CASE("shm parts: a tensor group is one sequence across its tensors", "[shm][unit]") {
  std::vector<float> x{1, 2, 3}, y{4, 5}, z{6, 7, 8, 9};
  ddp::shm::tensor_group g;
  g.type = ddp::dtype::f32;
  g.add(ddp::view(x));
  g.add(ddp::view(y));
  g.add(ddp::view(z));
  REQUIRE(g.total == 9);
  std::vector<float> out(5);
  g.copy_out(2, 5, reinterpret_cast<std::byte*>(out.data()));
  REQUIRE(out == std::vector<float>{3, 4, 5, 6, 7});
  std::vector<float> in{-1, -2, -3};
  g.copy_in(4, 3, reinterpret_cast<const std::byte*>(in.data()));
  REQUIRE(y == std::vector<float>{4, -1});
  REQUIRE(z == std::vector<float>{-2, -3, 8, 9});
  REQUIRE(g.contiguous(5, 4) == reinterpret_cast<std::byte*>(z.data()));
  REQUIRE(g.contiguous(2, 2) == nullptr);
}

TEST_CASE("shm parts: options compare and print", "[shm][unit]") {
  const ddp::shm::options a{.chunk_bytes = 1 << 20, .node_of_rank = {0, 0, 1}};
  ddp::shm::options b = a;
  REQUIRE(a == b);
  b.arena_bytes = 4096;
  REQUIRE(!(a == b));
  std::ostringstream os;
  os << a;
  REQUIRE(os.str().find("chunk_bytes: 1048576") != std::string::npos);
  REQUIRE(os.str().find("node_of_rank: [0, 0, 1]") != std::string::npos);
}
