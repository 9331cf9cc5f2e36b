// The allreduce cost model (include/ddp/allreduce_model.hpp): what it predicts from 2 to 4096
// ranks, and how it compares with what this machine measures at the ranks it has.
//
//   allreduce_model_bench table   [--ranks-per-node 8] [--network-us 5] [--network-gbps 12.5]
//                                 [--node-us 0.5] [--node-gbps 10] [--reduce-gbps 8] [--csv FILE]
//       Runs on one process (no MPI). For each rank count (2, 4, ... 4096) and message size, the
//       predicted time of every algorithm and the one the model picks.
//   mpiexec -n 2..4 allreduce_model_bench measure [--max-bytes 64MiB] [--reps 5] [--csv FILE]
//       Fits the model's constants here (ping-pong latency and bandwidth between ranks 0 and 1,
//       the speed of summing floats and of memcpy), then measures, per size: ddp's recursive
//       doubling and ddp's ring (ddp::mpi forced to each), MPI_Iallreduce (Open MPI 4.1's libnbc:
//       a binomial tree for an in-place call), MPI_Allreduce (Open MPI's tuned choice) and ddp's
//       shared-memory allreduce (ddp::world, the hierarchical form on one node), next to the
//       model's prediction for each, and which of the three MPI paths ddp::mpi can take was
//       fastest against the one the model picks.
//       Times are the median over repetitions of the slowest rank's time per call.
#include <mpi.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <ddp/allreduce_model.hpp>
#include <ddp/detail/host_reduce.hpp>
#include <ddp/mpi.hpp>

#include "common/cli.hpp"
#include "common/stats.hpp"
#include "common/table.hpp"

namespace {

using ddp::allreduce_algorithm;

std::string fixed(double v, int digits) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(digits) << v;
  return os.str();
}

ddp::machine_model model_from(const bench::cli& args) {
  ddp::machine_model m;
  m.ranks_per_node = static_cast<int>(args.int_or("--ranks-per-node", m.ranks_per_node));
  m.network = ddp::link_cost::of(args.double_or("--network-us", 5.0), args.double_or("--network-gbps", 12.5));
  m.node = ddp::link_cost::of(args.double_or("--node-us", 0.5), args.double_or("--node-gbps", 10.0));
  m.reduce_us_per_byte = 1.0 / (args.double_or("--reduce-gbps", 8.0) * 1e3);
  return m;
}

std::string describe(const ddp::machine_model& m) {
  auto gbps = [](double us_per_byte) { return fixed(1.0 / us_per_byte / 1e3, 2); };
  return "network " + fixed(m.network.alpha_us, 2) + " us + " + gbps(m.network.us_per_byte) + " GB/s; node " +
         fixed(m.node.alpha_us, 2) + " us + " + gbps(m.node.us_per_byte) + " GB/s; reduce " +
         gbps(m.reduce_us_per_byte) + " GB/s; " + std::to_string(m.ranks_per_node) + " ranks per node; ring segments " +
         bench::cli::format_bytes(m.segment_bytes);
}

int run_table(const bench::cli& args) {
  const ddp::machine_model m = model_from(args);
  std::vector<bench::table::column> columns{{"ranks"}, {"bytes"}, {"size"}};
  for (const auto a : ddp::all_allreduce_algorithms) columns.push_back({std::string(ddp::name_of(a)) + " us", 1});
  columns.push_back({"chosen"});
  columns.push_back({"ring/chosen", 2});
  bench::table t(columns);
  const std::vector<std::uint64_t> sizes{4, 1 << 10, 64 << 10, 1 << 20, 16 << 20, std::uint64_t{256} << 20};
  for (int p = 2; p <= 4096; p *= 2) {
    for (const std::uint64_t n : sizes) {
      std::vector<bench::cell> row{std::int64_t{p}, static_cast<std::int64_t>(n), bench::cli::format_bytes(n)};
      for (const auto a : ddp::all_allreduce_algorithms) {
        row.emplace_back(ddp::predicted_allreduce_us(a, static_cast<double>(n), p, m));
      }
      const auto choice = ddp::choose_allreduce(static_cast<double>(n), p, m);
      row.emplace_back(std::string(ddp::name_of(choice.algorithm)));
      row.emplace_back(ddp::predicted_allreduce_us(allreduce_algorithm::ring, static_cast<double>(n), p, m) /
                       choice.predicted_us);
      t.add(std::move(row));
    }
  }
  std::cout << "# allreduce cost model, predicted microseconds: " << describe(m) << "\n";
  t.print(std::cout);
  // Where the choice changes, per rank count: the thresholds a backend choosing by size would use.
  bench::table x({{"ranks"}, {"rd->ring"}, {"tree->ring"}, {"rd->halving_doubling"}, {"flat->hierarchical"}});
  for (int p = 2; p <= 4096; p *= 2) {
    auto at = [&](allreduce_algorithm a, allreduce_algorithm b) {
      const double n = ddp::crossover_bytes(a, b, p, m);
      return n == 0 ? std::string("never") : bench::cli::format_bytes(static_cast<std::uint64_t>(n));
    };
    std::string flat_to_hier = "never";
    for (double n = 4; n <= double(std::uint64_t{1} << 34); n *= 2) {
      const auto flat = ddp::choose_allreduce(n, p, m, ddp::flat_allreduce_algorithms);
      if (ddp::predicted_allreduce_us(allreduce_algorithm::hierarchical, n, p, m) < flat.predicted_us) {
        flat_to_hier = bench::cli::format_bytes(static_cast<std::uint64_t>(n));
        break;
      }
    }
    x.add({std::int64_t{p}, at(allreduce_algorithm::recursive_doubling, allreduce_algorithm::ring),
           at(allreduce_algorithm::binomial_tree, allreduce_algorithm::ring),
           at(allreduce_algorithm::recursive_doubling, allreduce_algorithm::halving_doubling), flat_to_hier});
  }
  std::cout << "\n# crossovers: the smallest power-of-two size at which the second is predicted faster\n";
  x.print(std::cout);
  if (const auto csv = args.csv()) t.write_csv(*csv);
  return 0;
}

// ---- measure ------------------------------------------------------------------------------------

// Seconds per call of f, the slowest rank's, median over reps.
template <class F>
double timed(MPI_Comm c, int iters, int reps, F&& f) {
  std::vector<double> samples;
  f();  // untimed: page faults, connection set-up
  for (int r = 0; r < reps; ++r) {
    MPI_Barrier(c);
    bench::stopwatch clock;
    for (int i = 0; i < iters; ++i) f();
    const double mine = clock.seconds() / iters;
    double slowest = 0;
    MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, c);
    samples.push_back(slowest);
  }
  return bench::median(samples);
}

// One-way time (s) of a message of `bytes` between ranks 0 and 1 (half a ping-pong round trip).
double one_way(MPI_Comm c, std::size_t bytes, int iters, int reps) {
  int rank = 0;
  MPI_Comm_rank(c, &rank);
  std::vector<char> buf(std::max<std::size_t>(bytes, 1));
  const int n = static_cast<int>(bytes);
  return timed(c, iters, reps,
               [&] {
                 if (rank == 0) {
                   MPI_Send(buf.data(), n, MPI_CHAR, 1, 7, c);
                   MPI_Recv(buf.data(), n, MPI_CHAR, 1, 7, c, MPI_STATUS_IGNORE);
                 } else if (rank == 1) {
                   MPI_Recv(buf.data(), n, MPI_CHAR, 0, 7, c, MPI_STATUS_IGNORE);
                   MPI_Send(buf.data(), n, MPI_CHAR, 0, 7, c);
                 }
               }) /
         2;
}

int run_measure(const bench::cli& args) {
  ddp::mpi::environment env;
  MPI_Comm c = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &c);
  int ranks = 0;
  int rank = 0;
  MPI_Comm_size(c, &ranks);
  MPI_Comm_rank(c, &rank);
  if (ranks < 2) {
    if (rank == 0) std::cerr << "allreduce_model_bench measure: run it on 2 or more ranks (mpiexec -n 2..4)\n";
    return 2;
  }
  const int reps = static_cast<int>(args.int_or("--reps", 5));
  const std::uint64_t max_bytes = args.bytes_or("--max-bytes", std::uint64_t{64} << 20);

  // The model's constants, fitted here: every rank is on this node, so they are the node's link.
  const double alpha_us = one_way(c, 8, 200, reps) * 1e6;
  const std::size_t big = std::size_t{16} << 20;
  const double big_us = one_way(c, big, 4, reps) * 1e6;
  const double us_per_byte = std::max(1e-9, (big_us - alpha_us) / static_cast<double>(big));
  std::vector<float> acc(big / 4, 0.0f), in(big / 4, 0.0f);
  const double reduce_us =
      timed(
          c, 4, reps,
          [&] { ddp::detail::reduce_into(ddp::dtype::f32, ddp::reduce_op::sum, acc.data(), in.data(), acc.size()); }) *
      1e6;
  std::vector<char> from(big, 1), to(big);
  const double copy_us = timed(c, 4, reps, [&] { std::memcpy(to.data(), from.data(), big); }) * 1e6;
  ddp::machine_model m;
  m.ranks_per_node = ranks;  // one node: every flat algorithm runs over Open MPI's shared memory (vader)
  m.node = {alpha_us, us_per_byte};
  m.network = m.node;
  m.reduce_us_per_byte = reduce_us / static_cast<double>(big);
  m.segment_bytes = ddp::mpi::options{}.ring_segment_bytes;
  // ddp's shared-memory level copies at memcpy speed, with the one-way latency as its barrier.
  ddp::machine_model m_shm = m;
  m_shm.node = {alpha_us, copy_us / static_cast<double>(big)};
  const std::array<allreduce_algorithm, 4> mpi_paths{allreduce_algorithm::recursive_doubling,
                                                     allreduce_algorithm::halving_doubling,
                                                     allreduce_algorithm::binomial_tree, allreduce_algorithm::ring};

  ddp::mpi::options ring_always;
  ring_always.ring_min_bytes = 0;
  auto ring = ddp::mpi::communicator::world(ring_always);
  auto doubling = ddp::mpi::communicator::world(
      {.ring_min_bytes = ddp::mpi::options::never, .recursive_doubling_max_bytes = std::size_t{1} << 30});
  auto halving = ddp::mpi::communicator::world({.ring_min_bytes = ddp::mpi::options::never,
                                                .recursive_doubling_max_bytes = 0,
                                                .halving_doubling_max_bytes = std::size_t{1} << 30});
  auto shm = ddp::world(env);

  bench::table t({{"bytes"},
                  {"size"},
                  {"ddp rd us", 2},
                  {"model rd", 2},
                  {"ddp hd us", 2},
                  {"model hd", 2},
                  {"MPI_Iallreduce us", 2},
                  {"model tree", 2},
                  {"ddp ring us", 2},
                  {"model ring", 2},
                  {"MPI_Allreduce us", 2},
                  {"ddp shm us", 2},
                  {"model hier", 2},
                  {"fastest of rd, hd, tree, ring"},
                  {"model's pick"}});
  for (std::uint64_t bytes = 4; bytes <= max_bytes; bytes *= 4) {
    std::vector<float> buf(bytes / 4, 0.0f);
    const int n = static_cast<int>(buf.size());
    const int iters = static_cast<int>(std::clamp<std::uint64_t>((std::uint64_t{32} << 20) / bytes, 1, 500));
    const double t_rd = timed(c, iters, reps, [&] { doubling.allreduce(buf, ddp::reduce_op::sum).wait(); }) * 1e6;
    const double t_hd = timed(c, iters, reps, [&] { halving.allreduce(buf, ddp::reduce_op::sum).wait(); }) * 1e6;
    const double t_nb = timed(c, iters, reps,
                              [&] {
                                MPI_Request req = MPI_REQUEST_NULL;
                                MPI_Iallreduce(MPI_IN_PLACE, buf.data(), n, MPI_FLOAT, MPI_SUM, c, &req);
                                MPI_Wait(&req, MPI_STATUS_IGNORE);
                              }) *
                        1e6;
    const double t_ring = timed(c, iters, reps, [&] { ring.allreduce(buf, ddp::reduce_op::sum).wait(); }) * 1e6;
    const double t_blocking =
        timed(c, iters, reps, [&] { MPI_Allreduce(MPI_IN_PLACE, buf.data(), n, MPI_FLOAT, MPI_SUM, c); }) * 1e6;
    const double t_shm = timed(c, iters, reps, [&] { shm.allreduce(buf, ddp::reduce_op::sum).wait(); }) * 1e6;
    const double nb = static_cast<double>(bytes);
    const double best = std::min({t_rd, t_hd, t_nb, t_ring});
    const std::string measured_best = best == t_rd   ? "recursive doubling"
                                      : best == t_hd ? "halving-doubling"
                                      : best == t_nb ? "tree"
                                                     : "ring";
    t.add({static_cast<std::int64_t>(bytes), bench::cli::format_bytes(bytes), t_rd,
           ddp::predicted_allreduce_us(allreduce_algorithm::recursive_doubling, nb, ranks, m), t_hd,
           ddp::predicted_allreduce_us(allreduce_algorithm::halving_doubling, nb, ranks, m), t_nb,
           ddp::predicted_allreduce_us(allreduce_algorithm::binomial_tree, nb, ranks, m), t_ring,
           ddp::predicted_allreduce_us(allreduce_algorithm::ring, nb, ranks, m), t_blocking, t_shm,
           ddp::predicted_allreduce_us(allreduce_algorithm::hierarchical, nb, ranks, m_shm), measured_best,
           std::string(ddp::name_of(ddp::choose_allreduce(nb, ranks, m, mpi_paths).algorithm))});
  }
  if (rank == 0) {
    std::cout << "# measured vs model, " << ranks << " ranks on one node; fitted: " << describe(m)
              << "; the shared-memory level copies at " << fixed(1.0 / m_shm.node.us_per_byte / 1e3, 2)
              << " GB/s (memcpy)\n";
    t.print(std::cout);
    if (const auto csv = args.csv()) t.write_csv(*csv);
  }
  MPI_Comm_free(&c);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 && argv[1][0] != '-' ? argv[1] : "table";
    const bench::cli args(argc - (argc > 1 && argv[1][0] != '-' ? 1 : 0),
                          argv + (argc > 1 && argv[1][0] != '-' ? 1 : 0),
                          "The allreduce cost model: predictions for 2-4096 ranks (table), measured vs model "
                          "here (measure, under mpiexec).",
                          {{"--ranks-per-node", "N", "table: ranks per node (default 8)"},
                           {"--network-us", "US", "table: network latency (default 5)"},
                           {"--network-gbps", "GB/s", "table: network bandwidth (default 12.5)"},
                           {"--node-us", "US", "table: shared-memory latency (default 0.5)"},
                           {"--node-gbps", "GB/s", "table: shared-memory copy bandwidth (default 10)"},
                           {"--reduce-gbps", "GB/s", "table: summing speed (default 8)"},
                           {"--max-bytes", "BYTES", "measure: largest message (default 64MiB)"},
                           {"--reps", "N", "measure: repetitions per size (default 5)"}});
    if (args.help_requested()) {
      args.print_help(std::cout);
      return 0;
    }
    if (mode == "table") return run_table(args);
    if (mode == "measure") return run_measure(args);
    std::cerr << "allreduce_model_bench: unknown mode '" << mode << "' (table or measure)\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "allreduce_model_bench: " << e.what() << "\n";
    return 1;
  }
}
