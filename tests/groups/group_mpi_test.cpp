// group_communicator over MPI processes (issue #30): the world split into groups of 2 ranks
// (1 at an odd size), an MPI communicator inside each group and one across the groups per rank
// index. Its collectives match the world's own, and an allreduce sends 1/k across. And
// GroupManager over MPI processes (a file store shared by the ranks, MPI communicators across the
// groups built for each quorum): the same training in groups and with one replica per rank gives
// the same bits on every rank.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/bucketer.hpp>
#include <ddp/bucketing/fixed.hpp>
#include <ddp/groups.hpp>
#include <ddp/mpi.hpp>
#include <ddp/reproducible.hpp>
#include <ddp/stores/file_store.hpp>

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

namespace {

// A directory every rank uses: rank 0's mkdtemp, sent to the others.
std::filesystem::path shared_directory(ddp::mpi::communicator& world) {
  std::vector<std::uint8_t> path(64, 0);
  if (world.rank() == 0) {
    std::string tmpl = (std::filesystem::temp_directory_path() / "ddp-group-mpi-XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    REQUIRE(tmpl.size() < path.size());
    std::copy(tmpl.begin(), tmpl.end(), path.begin());
  }
  world.broadcast(path, 0).wait();
  return std::filesystem::path(std::string(path.begin(), std::find(path.begin(), path.end(), 0)));
}

// Trains 6 steps with groups of k ranks (rank r is index r % k of group r / k), ddp's
// reproducible reducer over group_communicator(inner, GroupManager); returns the parameters.
std::vector<double> train_in_groups(int k, const std::filesystem::path& dir, const std::string& job) {
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  const ddp::mpi::options o{.timeout = std::chrono::seconds(60)};
  MPI_Comm inner_comm = MPI_COMM_NULL, index_comm = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, rank / k, rank % k, &inner_comm);
  MPI_Comm_split(MPI_COMM_WORLD, rank % k, rank / k, &index_comm);
  ddp::mpi::communicator inner(inner_comm, o);
  MPI_Comm_free(&inner_comm);
  ddp::stores::file_store files(dir);
  ddp::stores::prefix_store<ddp::stores::file_store> store(files, job + "/");
  constexpr std::size_t dim = 40, micro_batches = 8;
  std::vector<double> p(dim), g(dim), mom(dim, 0.0);
  for (std::size_t j = 0; j < dim; ++j) p[j] = std::cos(static_cast<double>(j));
  ddp::training_state state;
  state.add(p).add(mom);
  ddp::manager_options opts;
  opts.replica_id = "group" + std::to_string(rank / k);
  opts.min_replicas = n / k;  // every group in every quorum: the MPI splits below see every index's rank
  opts.heartbeat_interval = std::chrono::milliseconds(20);
  opts.settle = std::chrono::milliseconds(20);
  opts.quorum_timeout = std::chrono::seconds(30);
  opts.progress = {};
  // This index's communicator across the groups, in the quorum's group order.
  const auto factory = [&](const ddp::quorum_info& q) {
    MPI_Comm c = MPI_COMM_NULL;
    MPI_Comm_split(index_comm, 0, q.rank, &c);
    ddp::mpi::communicator comm(c, o);
    MPI_Comm_free(&c);
    return ddp::any_communicator(std::move(comm));
  };
  {
    ddp::GroupManager<ddp::mpi::communicator> gm(inner, store, factory, state, ddp::group_state::replicated, opts);
    ddp::group_communicator<ddp::communicator_ref, ddp::communicator_ref> comm(inner, gm);
    ddp::ReproducibleReducer red(comm, micro_batches, {.check_layout = false});
    red.add(g);
    red.build();
    while (gm.step() < 6) {
      gm.start_quorum();
      const std::int64_t s = gm.step();
      red.begin(static_cast<std::uint64_t>(s));
      for (const std::size_t i : red.pending()) {
        for (std::size_t j = 0; j < dim; ++j) g[j] = p[j] - std::sin(0.5 * static_cast<double>(s + i) + j);
        red.accumulate(i);
      }
      red.finalize();
      REQUIRE(gm.should_commit());
      for (std::size_t j = 0; j < dim; ++j) {
        mom[j] = 0.9 * mom[j] + g[j];
        p[j] -= 0.1 * mom[j];
      }
    }
    REQUIRE(static_cast<int>(gm.members().size()) == n / k);
  }
  MPI_Comm_free(&index_comm);
  return p;
}

}  // namespace

TEST_CASE("GroupManager over MPI: groups and one replica per rank give the same bits", "[mpi][groups][manager]") {
  auto world = test_ranks::make_world();
  const int n = world.size(), k = n % 2 == 0 ? 2 : 1;
  const auto dir = shared_directory(world);
  const auto grouped = train_in_groups(k, dir, "grouped");
  const auto flat = train_in_groups(1, dir, "flat");
  CHECK(grouped == flat);
  // Every rank holds the same bits.
  std::vector<double> all(grouped.size() * static_cast<std::size_t>(n));
  world.allgather(ddp::view(const_cast<std::vector<double>&>(grouped)), ddp::view(all)).wait();
  for (int r = 0; r < n; ++r) {
    CHECK(std::equal(grouped.begin(), grouped.end(), all.begin() + static_cast<std::ptrdiff_t>(r * grouped.size())));
  }
  world.barrier().wait();
  if (world.rank() == 0) std::filesystem::remove_all(dir);
}
