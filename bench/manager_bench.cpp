// What fault tolerance costs: the Manager's per-step protocol against plain Bucketer training,
// and healing time against state size.
//
//   mpiexec -n 2 manager_bench [--shapes resnet50.txt] [--iters 30] [--heal-mib 1,16,64,256]
//                              [--heal-small 4096] [--csv FILE]
//
// Steady state: the same gradients (ResNet-50 shapes by default) are synchronised per iteration by
// (a) a Bucketer with a fixed layout over ddp::mpi::communicator and (b) the same Bucketer over a
// Manager whose quorums are built on MPI, with start_quorum(), the commit vote and heartbeats to
// a file store; the two alternate iteration by iteration, so machine noise hits both alike.
// Healing: a fresh job whose rank 1 receives the whole state from rank 0 (the same transfer a
// restarted replica gets), for several state sizes, and for many small tensors against one
// tensor of the same bytes.
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <ddp/bucketer.hpp>
#include <ddp/bucketing/fixed.hpp>
#include <ddp/manager.hpp>
#include <ddp/mpi.hpp>
#include <ddp/stores/file_store.hpp>

#include "common/cli.hpp"
#include "common/shapes.hpp"
#include "common/stats.hpp"
#include "common/table.hpp"

namespace {

// Quorums over MPI: the ranks of the quorum are ordered by the Manager's membership.
ddp::communicator_factory mpi_factory() {
  return [](const ddp::quorum_info& q) {
    MPI_Comm ordered = MPI_COMM_NULL;
    MPI_Comm_split(MPI_COMM_WORLD, 0, q.rank, &ordered);
    ddp::any_communicator c{ddp::mpi::communicator(ordered)};
    MPI_Comm_free(&ordered);
    return c;
  };
}

// A fresh 0700 directory made by rank 0 with mkdtemp (no name another user can guess and create
// first), its name broadcast to the other ranks of this node.
std::string job_dir(ddp::mpi::communicator& comm, const std::string& tag) {
  std::string pattern = (std::filesystem::temp_directory_path() / ("ddp-manager-bench-" + tag + "-XXXXXX")).string();
  std::vector<std::int64_t> chars(pattern.size(), 0);
  if (comm.rank() == 0) {
    if (::mkdtemp(pattern.data()) == nullptr) {
      std::perror("manager_bench: mkdtemp");
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    std::copy(pattern.begin(), pattern.end(), chars.begin());
  }
  ddp::communicator_ref(comm).broadcast(chars, 0).wait();
  return std::string(chars.begin(), chars.end());
}

ddp::manager_options options_for(int rank) {
  ddp::manager_options o;
  o.replica_id = "r" + std::to_string(rank);
  o.min_replicas = 2;
  o.settle = std::chrono::milliseconds(50);
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  ddp::mpi::environment env(&argc, &argv);
  auto comm = ddp::mpi::communicator::world();
  const int rank = comm.rank();
  try {
    bench::cli args(argc, argv, "Manager overhead and healing time (run with mpiexec -n 2)",
                    {{"--shapes", "FILE", "parameter shapes (default: 20 x 64Ki floats)"},
                     {"--iters", "N", "measured iterations per variant (default 30)"},
                     {"--heal-mib", "LIST", "state sizes to heal, MiB (default 1,16,64,256)"},
                     {"--heal-small", "N", "N tensors of 1 KiB healed against one of N KiB (default 4096)"}});
    if (args.has("--help")) {
      if (rank == 0) args.print_help(std::cout);
      return 0;
    }
    const int iters = static_cast<int>(args.int_or("--iters", 30));
    const auto counts =
        bench::read_counts(args.string_or("--shapes", ""), std::vector<std::size_t>(20, std::size_t{1} << 16));
    std::vector<std::vector<float>> w, g;
    for (auto n : counts) {
      w.emplace_back(n, 0.5f);
      g.emplace_back(n, 0.0f);
    }
    std::size_t bytes = 0;
    for (auto n : counts) bytes += 4 * n;

    // (a) plain Bucketer
    ddp::Bucketer<ddp::bucketing::fixed> plain(comm);
    // (b) Bucketer over a Manager
    const std::string dir = job_dir(comm, "steady");
    ddp::stores::file_store store(dir);
    ddp::training_state state;
    for (auto& x : w) state.add(x);
    ddp::Manager manager(store, mpi_factory(), state, options_for(rank));
    ddp::Bucketer<ddp::bucketing::fixed> managed(manager, {}, {.check_layout = false});
    for (std::size_t i = 0; i < counts.size(); ++i) {
      plain.add(w[i], g[i]);
      managed.add(w[i], g[i]);
    }
    plain.build();
    managed.build();

    auto step_plain = [&] {
      for (std::size_t i = counts.size(); i-- > 0;) plain.mark_ready(i);
      plain.finalize();
    };
    auto step_managed = [&] {
      manager.start_quorum();
      for (std::size_t i = counts.size(); i-- > 0;) managed.mark_ready(i);
      managed.finalize();
      if (!manager.should_commit()) throw std::runtime_error("a fault-free step failed to commit");
    };
    std::vector<double> t_plain, t_managed;
    auto timed = [&](auto&& f, std::vector<double>& out, bool keep) {
      comm.barrier().wait();
      const auto t0 = std::chrono::steady_clock::now();
      f();
      std::vector<double> ms{std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count()};
      ddp::communicator_ref(comm).allreduce(ms, ddp::reduce_op::max).wait();  // slowest rank
      if (keep) out.push_back(ms[0]);
    };
    for (int i = 0; i < iters + 3; ++i) {  // 3 warm-up iterations; alternate the order each time
      if (i % 2) {
        timed(step_plain, t_plain, i >= 3);
        timed(step_managed, t_managed, i >= 3);
      } else {
        timed(step_managed, t_managed, i >= 3);
        timed(step_plain, t_plain, i >= 3);
      }
    }
    bench::table steady({{"variant"}, {"MiB", 1}, {"median ms", 3}, {"min ms", 3}, {"ratio", 3}});
    const double mp = bench::median(t_plain), mm = bench::median(t_managed);
    steady.add({std::string("Bucketer (fixed layout)"), static_cast<double>(bytes) / (1 << 20), mp,
                *std::min_element(t_plain.begin(), t_plain.end()), 1.0});
    steady.add({std::string("Bucketer over Manager"), static_cast<double>(bytes) / (1 << 20), mm,
                *std::min_element(t_managed.begin(), t_managed.end()), mm / mp});

    // Healing: a fresh job per size; rank 1 receives the state from rank 0.
    bench::table heal({{"state MiB"}, {"heal ms", 3}, {"GB/s", 3}, {"start_quorum ms", 3}});
    std::vector<std::int64_t> sizes;
    {
      std::stringstream ss(args.string_or("--heal-mib", "1,16,64,256"));
      for (std::string s; std::getline(ss, s, ',');) sizes.push_back(std::stoll(s));
    }
    // A fresh job in which rank 1 receives `tensors` from rank 0; returns {start_quorum ms, heal ms},
    // the slower rank's.
    auto heal_once = [&](const std::string& tag, std::vector<std::vector<float>>& tensors) {
      const std::string hdir = job_dir(comm, tag);
      ddp::stores::file_store hstore(hdir);
      ddp::training_state hs;
      for (auto& t : tensors) {
        std::fill(t.begin(), t.end(), rank == 0 ? 1.0f : 0.0f);
        hs.add(t);
      }
      ddp::Manager m(hstore, mpi_factory(), hs, options_for(rank));
      const auto t0 = std::chrono::steady_clock::now();
      m.start_quorum();
      std::vector<double> v{std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(),
                            m.stats().heal_ms};
      ddp::communicator_ref(comm).allreduce(v, ddp::reduce_op::max).wait();
      for (const auto& t : tensors) {
        if (t.back() != 1.0f) throw std::runtime_error("healed state differs from the source");
      }
      comm.barrier().wait();
      if (rank == 0) std::filesystem::remove_all(hdir);
      return v;
    };
    for (auto mib : sizes) {
      std::vector<std::vector<float>> state(1, std::vector<float>(static_cast<std::size_t>(mib) << 18));
      const auto v = heal_once("heal" + std::to_string(mib), state);
      heal.add({mib, v[1], static_cast<double>(mib << 20) / (v[1] * 1e6), v[0]});
    }
    // Many small tensors against one of the same bytes (the Manager coalesces small ones).
    bench::table small({{"state"}, {"heal ms", 3}, {"start_quorum ms", 3}});
    const auto small_count = static_cast<std::size_t>(args.int_or("--heal-small", 4096));
    for (const std::size_t n : {std::size_t{1}, small_count}) {
      std::vector<std::vector<float>> state(n, std::vector<float>(small_count * 256 / n));
      const auto v = heal_once("small" + std::to_string(n), state);
      small.add({std::to_string(n) + " x " + std::to_string(small_count / n) + " KiB", v[1], v[0]});
    }
    if (rank == 0) {
      std::cout << "Manager steady-state overhead, 2 ranks over MPI (median of " << iters
                << " alternating iterations)\n";
      steady.print(std::cout);
      std::cout << "\nHealing a fresh replica (state streamed by broadcast in 16 MiB chunks, all in flight at once)\n";
      heal.print(std::cout);
      std::cout << "\nHealing many small tensors against one tensor of the same bytes\n";
      small.print(std::cout);
      if (auto csv = args.csv()) {
        std::ofstream out(*csv);
        steady.write_csv(out);
        out << "\n";
        heal.write_csv(out);
      }
      std::filesystem::remove_all(dir);
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "manager_bench: rank " << rank << ": " << e.what() << "\n";
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}
