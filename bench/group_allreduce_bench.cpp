// Replica groups' data path (issue #30): an allreduce over G groups of k ranks through
// ddp::group_communicator (reduce-scatter inside the group, each rank's 1/k allreduced across the
// groups, allgather inside) against the same allreduce over all ranks at once, in one run:
//   flat      ddp::mpi::communicator over the world (ddp's ring over every rank)
//   world     ddp::shm::mpi::world(): shared memory inside a host, one leader per host across
//   grouped      group_communicator<mpi inside the host, mpi across per rank index>; inside, an
//                allreduce of the whole buffer, then each rank's slice across (the default)
//   grouped-rs   the same with a reduce-scatter inside (group_inner_reduction::reduce_scatter)
//   grouped-shm  the default with ddp::shm inside the host (shared memory)
// A group is a host (DDP_HOST under `ddp-run --hosts`; otherwise --group-size ranks in rank
// order). Per size: the median over interleaved repetitions of the slowest rank's time, and what
// each host sent across its link per allreduce (its interface's tx bytes, on test hosts).
//
//   ddp-run --hosts 2 --ranks-per-host 2 --link-rate 1gbit group_allreduce_bench [--mib 4,16,64] [--reps 5]
//   ddp-run -n 4 group_allreduce_bench --group-size 2
#include <mpi.h>

#include <cstdint>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <ddp/groups.hpp>
#include <ddp/mpi.hpp>
#include <ddp/shm.hpp>
#include <ddp/shm/mpi.hpp>

#include "common/cli.hpp"
#include "common/stats.hpp"
#include "common/table.hpp"

namespace {

// This host's interface's transmitted bytes (test hosts), or 0.
std::uint64_t tx_bytes() {
  const char* ifname = std::getenv("DDP_HOSTS_IFNAME");
  if (ifname == nullptr) return 0;
  std::ifstream in(std::string("/sys/class/net/") + ifname + "/statistics/tx_bytes");
  std::uint64_t v = 0;
  in >> v;
  return v;
}

// The group of this rank: its test host's number, or rank / group_size.
int group_of(int rank, int group_size) {
  if (const char* host = std::getenv("DDP_HOST"); host != nullptr && host[0] == 'h') return std::atoi(host + 1) - 1;
  return rank / group_size;
}

}  // namespace

int main(int argc, char** argv) {
  ddp::mpi::environment env(&argc, &argv);
  try {
    bench::cli args(argc, argv, "Allreduce over replica groups (group_communicator) against a flat allreduce",
                    {{"--mib", "LIST", "sizes, MiB of f32 (default 4,16,64)"},
                     {"--reps", "N", "interleaved repetitions per size (default 5)"},
                     {"--group-size", "K", "ranks a group, off test hosts (default 2)"}});
    if (args.has("--help")) {
      args.print_help(std::cout);
      return 0;
    }
    int rank = 0, size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    const int group = group_of(rank, static_cast<int>(args.int_or("--group-size", 2)));
    MPI_Comm inner_comm = MPI_COMM_NULL, cross_comm = MPI_COMM_NULL;
    MPI_Comm_split(MPI_COMM_WORLD, group, rank, &inner_comm);
    int index = 0;
    MPI_Comm_rank(inner_comm, &index);
    MPI_Comm_split(MPI_COMM_WORLD, index, group, &cross_comm);
    const ddp::mpi::options mo{.timeout = std::chrono::seconds(300)};
    ddp::group_communicator grouped(ddp::mpi::communicator(inner_comm, mo), ddp::mpi::communicator(cross_comm, mo));
    ddp::group_communicator grouped_rs(ddp::mpi::communicator(inner_comm, mo), ddp::mpi::communicator(cross_comm, mo),
                                       {.inner = ddp::group_inner_reduction::reduce_scatter});
    ddp::group_communicator grouped_shm(ddp::shm::mpi::make_communicator(inner_comm),
                                        ddp::mpi::communicator(cross_comm, mo));
    MPI_Comm_free(&inner_comm);
    MPI_Comm_free(&cross_comm);
    auto flat = ddp::mpi::communicator::world(mo);
    auto world = ddp::shm::mpi::world();
    const int k = grouped.group_size(), groups = size / k;
    if (groups * k != size) throw std::runtime_error("every group must have the same number of ranks");

    std::vector<std::int64_t> sizes;
    {
      std::stringstream ss(args.string_or("--mib", "4,16,64"));
      for (std::string s; std::getline(ss, s, ',');) sizes.push_back(std::stoll(s));
    }
    const int reps = static_cast<int>(args.int_or("--reps", 5));
    constexpr std::size_t variants = 5;
    const char* names[variants] = {"flat", "world", "grouped", "grouped-rs", "grouped-shm"};
    const std::function<void(std::vector<float>&)> runs[variants] = {
        [&](std::vector<float>& v) { ddp::communicator_ref(flat).allreduce(v, ddp::reduce_op::sum).wait(); },
        [&](std::vector<float>& v) { ddp::communicator_ref(world).allreduce(v, ddp::reduce_op::sum).wait(); },
        [&](std::vector<float>& v) { ddp::communicator_ref(grouped).allreduce(v, ddp::reduce_op::sum).wait(); },
        [&](std::vector<float>& v) { ddp::communicator_ref(grouped_rs).allreduce(v, ddp::reduce_op::sum).wait(); },
        [&](std::vector<float>& v) { ddp::communicator_ref(grouped_shm).allreduce(v, ddp::reduce_op::sum).wait(); },
    };
    bench::table t({{"MiB"}, {"variant"}, {"ms", 1}, {"MB a host sent across", 1}, {"vs flat", 2}});
    for (const std::int64_t mib : sizes) {
      std::vector<float> data(static_cast<std::size_t>(mib) << 18, 1.0f);
      std::vector<std::vector<double>> ms(variants), sent(variants);
      for (int r = 0; r <= reps; ++r) {  // repetition 0 warms up
        for (std::size_t v = 0; v < variants; ++v) {
          MPI_Barrier(MPI_COMM_WORLD);
          const std::uint64_t tx0 = tx_bytes();
          bench::stopwatch clock;
          runs[v](data);
          double mine = clock.seconds() * 1e3, slowest = 0;
          MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
          MPI_Barrier(MPI_COMM_WORLD);
          // Every rank of a host reads the same counter: the host's bytes are its ranks' mean.
          double host = static_cast<double>(tx_bytes() - tx0) / 1e6, total = 0;
          MPI_Allreduce(&host, &total, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
          if (r > 0) {
            ms[v].push_back(slowest);
            sent[v].push_back(total / size);
          }
        }
      }
      const double flat_ms = bench::median(ms[0]);
      for (std::size_t v = 0; v < variants; ++v) {
        const double m = bench::median(ms[v]);
        t.add({mib, std::string(names[v]), m, bench::median(sent[v]), m / flat_ms});
      }
    }
    if (rank == 0) {
      std::cout << "# allreduce (f32 sum) over " << groups << " groups of " << k << " ranks"
                << (std::getenv("DDP_HOST") ? " (a group per test host)" : "") << "; median of " << reps
                << " interleaved repetitions, slowest rank\n";
      t.print(std::cout);
      if (auto csv = args.csv()) {
        std::ofstream out(*csv);
        t.write_csv(out);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "group_allreduce_bench: " << e.what() << "\n";
    return 1;
  }
}
