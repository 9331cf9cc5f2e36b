// Zero-copy: tensors in a rank's arena are reduced where they are (peers read them directly),
// which is safe only if a rank returns after every peer finished reading its buffer: these tests
// rewrite the buffer right after each allreduce. Also: ranks mixing arena and private memory,
// bucket storage from allocator() laid out by the Bucketer's default policy, the hierarchical
// path with arena tensors, arena exhaustion and close().
#include <catch2/catch.hpp>
#include <ddp/bucketing/size_capped.hpp>
#include <ddp/mpi.hpp>
#include <ddp/shm.hpp>
#include <ddp/shm/mpi.hpp>

#include <cmath>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "shm_cases.hpp"

namespace {

constexpr std::size_t small_chunk = 8192;
constexpr std::size_t arena = std::size_t{16} << 20;

std::span<float> floats(ddp::shm::arena_block& b, std::size_t n) { return {reinterpret_cast<float*>(b.data()), n}; }

// Fills, reduces and checks one f32 tensor `iterations` times in a row.
void reduce_repeatedly(ddp::shm::mpi_communicator& comm, std::span<float> x, int iterations, ddp::reduce_op op) {
  const int size = comm.size();
  for (int it = 0; it < iterations; ++it) {
    for (std::size_t i = 0; i < x.size(); ++i)
      x[i] = static_cast<float>(suite::value(comm.rank(), i + static_cast<std::size_t>(it)));
    comm.allreduce(x, op).wait();
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      double want = 0;
      for (int r = 0; r < size; ++r) want += suite::value(r, i + static_cast<std::size_t>(it));
      if (op == ddp::reduce_op::avg) want /= size;
      if (std::abs(x[i] - want) > 1e-6 * std::abs(want)) ++wrong;
    }
    INFO("iteration " << it << ", " << x.size() << " elements");
    REQUIRE(wrong == 0);
    // Overwrite immediately: a peer still reading this buffer would now see garbage.
    std::memset(x.data(), 0xff, x.size_bytes());
  }
}

}  // namespace

TEST_CASE("shm zero-copy: arena tensors, every size class, rewritten right after each call", "[shm][zero_copy]") {
  auto comm = ddp::shm::mpi::world({.chunk_bytes = small_chunk, .arena_bytes = arena});
  const auto sizes = shm_cases::size_classes(comm.size(), small_chunk / 4);
  for (std::size_t n : sizes) {
    auto block = comm.allocate(n * sizeof(float));
    auto x = floats(block, n);
    REQUIRE(comm.in_arena(ddp::view(x)) == (n > 0));
    reduce_repeatedly(comm, x, 3, n % 2 ? ddp::reduce_op::avg : ddp::reduce_op::sum);
  }
}

TEST_CASE("shm zero-copy: every dtype and operator on arena tensors, bit-equal across ranks", "[shm][zero_copy]") {
  auto comm = ddp::shm::mpi::world({.chunk_bytes = small_chunk, .arena_bytes = arena});
  for (ddp::dtype t : suite::all_dtypes()) {
    for (ddp::reduce_op op : suite::all_ops()) {
      const std::size_t n = 3 * small_chunk / ddp::size_of(t) + 11;
      auto block = comm.allocate(n * ddp::size_of(t));
      ddp::tensor_view v{block.data(), n, t, ddp::device::host()};
      for (std::size_t i = 0; i < n; ++i) {
        const double x = shm_cases::value(t, comm.rank(), i);
        ddp::detail::convert(ddp::dtype::f64, &x, t, block.data() + i * ddp::size_of(t), 1);
      }
      comm.allreduce(std::span<const ddp::tensor_view>(&v, 1), op).wait();
      suite::buffer copy(t, n);
      std::memcpy(copy.bytes.data(), block.data(), n * ddp::size_of(t));
      suite::expect_same_bits_everywhere(comm, copy, "zero-copy " + std::string(ddp::name_of(t)));
      // Same bits as the staged path gives for the same inputs.
      suite::buffer staged(t, n);
      for (std::size_t i = 0; i < n; ++i) staged.set(i, shm_cases::value(t, comm.rank(), i));
      const auto sv = staged.view();
      comm.allreduce(std::span<const ddp::tensor_view>(&sv, 1), op).wait();
      REQUIRE(std::memcmp(staged.bytes.data(), copy.bytes.data(), copy.bytes.size()) == 0);
    }
  }
}

TEST_CASE("shm zero-copy: some ranks in the arena, some not", "[shm][zero_copy]") {
  auto comm = ddp::shm::mpi::world({.chunk_bytes = small_chunk, .arena_bytes = arena});
  const std::size_t n = 5 * small_chunk / 4 + 3;
  auto block = comm.allocate(n * sizeof(float));
  std::vector<float> heap(n);
  std::span<float> x = comm.rank() % 2 ? std::span<float>(heap) : floats(block, n);
  reduce_repeatedly(comm, x, 4, ddp::reduce_op::avg);
}

TEST_CASE("shm zero-copy: bucket storage from allocator(), laid out by size_capped", "[shm][zero_copy]") {
  auto comm = ddp::shm::mpi::world({.arena_bytes = std::size_t{64} << 20});
  // A small model: gradient sizes in elements.
  const std::vector<std::size_t> sizes{9408, 64, 64, 36864, 64, 64, 147456, 256, 256, 1000, 2048000, 1000};
  std::vector<ddp::gradient_info> infos;
  for (std::size_t i = 0; i < sizes.size(); ++i) infos.push_back({i, sizes[i], ddp::dtype::f32, ddp::device::host()});
  const ddp::bucket_layout layout =
      ddp::bucketing::size_capped{.cap_bytes = 4 << 20, .small_bucket_bytes = 256 << 10}.layout(infos);
  REQUIRE(layout.buckets.size() > 1);
  ddp::shm::bucket_allocator allocate = comm.allocator();
  std::vector<std::shared_ptr<std::byte>> storage;
  std::vector<ddp::tensor_view> buckets;
  for (const auto& members : layout.buckets) {
    std::size_t elems = 0;
    for (std::size_t g : members) elems += sizes[g];
    storage.push_back(allocate(elems * sizeof(float)));
    buckets.push_back({storage.back().get(), elems, ddp::dtype::f32, ddp::device::host()});
    REQUIRE(comm.in_arena(buckets.back()));
  }
  for (int iteration = 0; iteration < 3; ++iteration) {
    // "backward": gradients are written straight into bucket storage
    for (auto& b : buckets) {
      auto x = b.as<float>();
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(comm.rank() + iteration) + 0.25f;
    }
    for (auto& b : buckets) comm.allreduce(b, ddp::reduce_op::avg).wait();
    const float want = static_cast<float>(comm.size() - 1) / 2.0f + static_cast<float>(iteration) + 0.25f;
    std::size_t wrong = 0;
    for (auto& b : buckets) {
      for (float x : b.as<float>()) wrong += x == Approx(want) ? 0 : 1;
    }
    REQUIRE(wrong == 0);
  }
}

TEST_CASE("shm zero-copy: hierarchical path with arena tensors", "[shm][zero_copy][hierarchical]") {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  std::vector<int> labels(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) labels[static_cast<std::size_t>(r)] = r < (n + 1) / 2 ? 0 : 1;
  auto comm = ddp::shm::mpi::world({.chunk_bytes = small_chunk, .arena_bytes = arena, .node_of_rank = labels});
  for (std::size_t elems : {std::size_t{1}, std::size_t{1000}, 4 * small_chunk + 5}) {
    auto block = comm.allocate(elems * sizeof(float));
    reduce_repeatedly(comm, floats(block, elems), 3, ddp::reduce_op::avg);
  }
}

TEST_CASE("shm zero-copy: arena limits, close()", "[shm][zero_copy]") {
  auto comm = ddp::shm::mpi::world({.arena_bytes = 1 << 20});
  {
    auto a = comm.allocate(600 << 10);
    REQUIRE_THROWS_AS(comm.allocate(600 << 10), ddp::usage_error);  // does not fit next to a
    REQUIRE_THROWS_AS(comm.close(), ddp::usage_error);              // a block is alive
  }
  auto b = comm.allocate(1 << 20);  // the space came back (and coalesced)
  b = {};
  comm.close();
  std::vector<float> x(10, 1.0f);
  REQUIRE_THROWS_AS(comm.allreduce(x, ddp::reduce_op::sum), ddp::usage_error);
  REQUIRE_NOTHROW(comm.barrier().wait());  // forwarded collectives keep working

  auto none = ddp::shm::mpi::world();
  REQUIRE_THROWS_AS(none.allocate(64), ddp::usage_error);
}
