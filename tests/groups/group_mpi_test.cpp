// group_communicator over MPI processes (issue #30): the world split into groups of 2 ranks
// (1 at an odd size), an MPI communicator inside each group and one across the groups per rank
// index. Its collectives match the world's own, and an allreduce sends 1/k across.
#include <mpi.h>

#include <cstdint>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/bucketer.hpp>
#include <ddp/bucketing/fixed.hpp>
#include <ddp/groups/group_communicator.hpp>
#include <ddp/mpi.hpp>

#include "../common/mpi_world.hpp"

namespace {

using group_comm = ddp::group_communicator<ddp::mpi::communicator, ddp::mpi::communicator>;

// Rank r of the world is index r % k of group r / k.
group_comm split_world(int k) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm inner = MPI_COMM_NULL, cross = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, rank / k, rank % k, &inner);
  MPI_Comm_split(MPI_COMM_WORLD, rank % k, rank / k, &cross);
  const ddp::mpi::options o{.timeout = std::chrono::seconds(60)};
  group_comm c(ddp::mpi::communicator(inner, o), ddp::mpi::communicator(cross, o));
  MPI_Comm_free(&inner);
  MPI_Comm_free(&cross);
  return c;
}

}  // namespace

TEST_CASE("group_communicator over MPI: the world's collectives, in groups", "[mpi][groups]") {
  auto world = test_ranks::make_world();
  const int n = world.size(), k = n % 2 == 0 ? 2 : 1;
  group_comm c = split_world(k);
  REQUIRE(c.rank() == world.rank());
  REQUIRE(c.size() == n);
  REQUIRE(c.group_size() == k);
  // Integer-valued: exact in any order, so the grouped sum must equal the world's bit for bit.
  std::vector<double> a(1001), flat(1001);
  std::vector<float> b(5), flat_b(5);
  for (std::size_t j = 0; j < a.size(); ++j) flat[j] = a[j] = (c.rank() + 1) * 1000.0 + static_cast<double>(j % 89);
  for (std::size_t j = 0; j < b.size(); ++j) flat_b[j] = b[j] = static_cast<float>(c.rank() * 7 + static_cast<int>(j));
  c.allreduce(std::vector<ddp::tensor_view>{ddp::view(a), ddp::view(b)}, ddp::reduce_op::sum).wait();
  world.allreduce(std::vector<ddp::tensor_view>{ddp::view(flat), ddp::view(flat_b)}, ddp::reduce_op::sum).wait();
  CHECK(a == flat);
  CHECK(b == flat_b);
  for (int root = 0; root < n; ++root) {
    std::vector<std::int64_t> x(3, c.rank() == root ? 40 + root : -1);
    c.broadcast(std::vector<ddp::tensor_view>{ddp::view(x)}, root).wait();
    for (const auto v : x) CHECK(v == 40 + root);
  }
  std::vector<float> in(2, static_cast<float>(c.rank())), out(static_cast<std::size_t>(2 * n));
  c.allgather(ddp::view(in), ddp::view(out)).wait();
  for (int r = 0; r < n; ++r) CHECK(out[static_cast<std::size_t>(2 * r + 1)] == static_cast<float>(r));
  std::vector<double> rin(static_cast<std::size_t>(3 * n)), rout(3);
  for (std::size_t j = 0; j < rin.size(); ++j) rin[j] = c.rank() * 100 + static_cast<int>(j / 3);
  c.reduce_scatter(ddp::view(rin), ddp::view(rout), ddp::reduce_op::sum).wait();
  for (const double v : rout) CHECK(v == 100.0 * n * (n - 1) / 2 + static_cast<double>(n) * c.rank());
  c.barrier().wait();
}

TEST_CASE("group_communicator over MPI: a Bucketer averages over the groups", "[mpi][groups]") {
  auto world = test_ranks::make_world();
  const int n = world.size();
  group_comm c = split_world(n % 2 == 0 ? 2 : 1);
  std::vector<double> w(333, 0.0), g(333);
  ddp::Bucketer<ddp::bucketing::fixed> grads(c, {}, {});
  grads.add(w, g);
  grads.build();
  for (int step = 0; step < 3; ++step) {
    for (double& x : g) x = c.rank() * 2.0 + step;
    grads.mark_ready(0);
    grads.finalize();
    for (const double x : g) REQUIRE(x == (n - 1) + static_cast<double>(step));  // mean of 2 r + step
  }
}
