// What fault tolerance costs: the Manager's per-step protocol against plain Bucketer training,
// and healing time against state size and against an allreduce of the same bytes.
//
//   ddp-run -n 2 manager_bench [--shapes resnet50.txt] [--iters 30] [--heal-mib 64,256,1024]
//                              [--heal-reps 3] [--heal-chunk-mib 16] [--heal-small 4096] [--csv FILE]
//
// Steady state: the same gradients (ResNet-50 shapes by default) are synchronised per iteration by
// (a) a Bucketer with a fixed layout over ddp::mpi::communicator and (b) the same Bucketer over a
// Manager whose quorums are built on MPI, with start_quorum(), the commit vote and heartbeats to
// a file store; the two alternate iteration by iteration, so machine noise hits both alike.
// Healing: ranks 0..n-2 train (commit a step), then rank n-1 joins and receives the whole state
// from every one of them (n-1 sources; the transfer a restarted replica gets). Right after, the
// same Manager allreduces the same bytes (sum, over the quorum's communicator, so the heal and
// the allreduce use one communicator): its bus bandwidth, bytes * 2(n-1)/n / time as nccl-tests
// define it, is the yardstick. Sizes are interleaved within each repetition; medians reported.
// Also many small tensors against one tensor of the same bytes.
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
#include <thread>
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

// Quorums over MPI: a communicator over the quorum's members only (replica "r<k>" is world rank
// k), ordered by the Manager's membership. MPI_Comm_create_group is collective over the members
// alone, so a quorum can form while other ranks are elsewhere (a replica that joins later).
ddp::communicator_factory mpi_factory() {
  return [](const ddp::quorum_info& q) {
    std::vector<int> world_ranks;
    for (const auto& id : q.members) world_ranks.push_back(std::stoi(id.substr(1)));
    MPI_Group world = MPI_GROUP_NULL, members = MPI_GROUP_NULL;
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    MPI_Group_incl(world, static_cast<int>(world_ranks.size()), world_ranks.data(), &members);
    MPI_Comm ordered = MPI_COMM_NULL;
    // One tag per communicator of a generation: the quorum's, and each heal route's.
    const auto tag = static_cast<int>((q.generation * 16 + static_cast<std::uint64_t>(q.heal_source + 1)) % 32768);
    MPI_Comm_create_group(MPI_COMM_WORLD, members, tag, &ordered);
    MPI_Group_free(&members);
    MPI_Group_free(&world);
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

ddp::manager_options options_for(int rank, int min_replicas = 2) {
  ddp::manager_options o;
  o.replica_id = "r" + std::to_string(rank);
  o.min_replicas = min_replicas;
  o.settle = std::chrono::milliseconds(50);
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  ddp::mpi::environment env(&argc, &argv);
  auto comm = ddp::mpi::communicator::world();
  const int rank = comm.rank();
  try {
    bench::cli args(argc, argv, "Manager overhead and healing time (run with ddp-run -n 2 or more)",
                    {{"--shapes", "FILE", "parameter shapes (default: 20 x 64Ki floats)"},
                     {"--iters", "N", "measured iterations per variant (default 30)"},
                     {"--heal-mib", "LIST", "state sizes to heal, MiB (default 64,256,1024)"},
                     {"--heal-reps", "N", "heals (and allreduces) per size, interleaved (default 3)"},
                     {"--heal-chunk-mib", "N", "manager_options::heal_chunk_bytes, MiB (default: the option's)"},
                     {"--heal-small", "N", "N tensors of 1 KiB healed against one of N KiB (default 4096)"},
                     {"--heal-over", "LIST", "manager_options::heal_over: quorum, routes (default quorum,routes)"}});
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

    // Healing: a fresh job per heal. Ranks 0..n-2 form a quorum and commit a step; then rank n-1
    // joins and receives the state from all of them.
    const int n = comm.size();
    const int sources = std::max(1, n - 1);
    std::vector<std::int64_t> sizes;
    {
      std::stringstream ss(args.string_or("--heal-mib", "64,256,1024"));
      for (std::string s; std::getline(ss, s, ',');) sizes.push_back(std::stoll(s));
    }
    const int reps = static_cast<int>(args.int_or("--heal-reps", 3));
    const std::int64_t chunk_mib = args.int_or("--heal-chunk-mib", 0);
    std::vector<ddp::heal_transport> transports;
    {
      std::stringstream ss(args.string_or("--heal-over", "quorum,routes"));
      for (std::string s; std::getline(ss, s, ',');) {
        if (s != "quorum" && s != "routes") throw std::invalid_argument("--heal-over: quorum or routes, not " + s);
        transports.push_back(s == "routes" ? ddp::heal_transport::source_routes
                                           : ddp::heal_transport::quorum_broadcast);
      }
    }
    const auto transport_name = [](ddp::heal_transport t) {
      return t == ddp::heal_transport::source_routes ? "routes" : "quorum";
    };
    ddp::heal_transport over = ddp::heal_transport::quorum_broadcast;  // the heal_once in progress
    auto heal_options = [&] {
      ddp::manager_options o = options_for(rank, sources);
      if (chunk_mib > 0) o.heal_chunk_bytes = static_cast<std::size_t>(chunk_mib) << 20;
      o.heal_over = over;
      return o;
    };
    auto ms_since = [](std::chrono::steady_clock::time_point t0) {
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    };
    // One heal of `tensors` into rank n-1, then `allreduces` timed allreduces of them through the
    // same Manager (after one untimed). Returns {start_quorum ms, heal ms, allreduce ms...}, each
    // the slowest rank's.
    auto heal_once = [&](const std::string& tag, std::vector<std::vector<float>>& tensors, int allreduces) {
      const std::string hdir = job_dir(comm, tag);
      ddp::stores::file_store hstore(hdir);
      ddp::training_state hs;
      const bool joiner = rank == n - 1;
      for (auto& t : tensors) {
        std::fill(t.begin(), t.end(), joiner ? 0.0f : 1.0f);
        hs.add(t);
      }
      ddp::Manager m(hstore, mpi_factory(), hs, heal_options());
      if (!joiner) {
        m.start_quorum();
        if (!m.should_commit()) throw std::runtime_error("the sources' first step failed to commit");
      }
      comm.barrier().wait();  // the sources hold a committed step
      std::vector<double> v{0.0, 0.0};
      if (joiner) {
        const auto t0 = std::chrono::steady_clock::now();
        m.start_quorum();
        v = {ms_since(t0), m.stats().heal_ms};
      } else {
        for (;;) {  // step until the joiner is admitted (and healed)
          m.start_quorum();
          if (m.size() == n) break;
          if (!m.should_commit()) throw std::runtime_error("a fault-free step failed to commit");
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
      }
      for (const auto& t : tensors) {
        if (t.front() != 1.0f || t.back() != 1.0f) throw std::runtime_error("healed state differs from the source");
      }
      std::vector<ddp::tensor_view> views;
      for (auto& t : tensors) views.push_back(ddp::view(t));
      for (int i = 0; i <= allreduces; ++i) {
        comm.barrier().wait();
        const auto t0 = std::chrono::steady_clock::now();
        m.allreduce(views, ddp::reduce_op::sum).wait();
        if (i > 0) v.push_back(ms_since(t0));
      }
      if (m.failed()) std::rethrow_exception(m.error());
      ddp::communicator_ref(comm).allreduce(v, ddp::reduce_op::max).wait();
      comm.barrier().wait();
      if (rank == 0) std::filesystem::remove_all(hdir);
      return v;
    };
    // Cell (size i, transport j) at i * transports + j; sizes and transports interleaved.
    const std::size_t cells = sizes.size() * transports.size();
    std::vector<std::vector<double>> heal_ms(cells), allreduce_ms(cells), quorum_ms(cells);
    for (int r = 0; r < reps; ++r) {
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        for (std::size_t j = 0; j < transports.size(); ++j) {
          over = transports[j];
          const std::size_t cell = i * transports.size() + j;
          std::vector<std::vector<float>> state(1, std::vector<float>(static_cast<std::size_t>(sizes[i]) << 18));
          const auto v = heal_once("heal" + std::to_string(sizes[i]), state, 2);
          quorum_ms[cell].push_back(v[0]);
          heal_ms[cell].push_back(v[1]);
          allreduce_ms[cell].insert(allreduce_ms[cell].end(), v.begin() + 2, v.end());
        }
      }
    }
    over = ddp::heal_transport::quorum_broadcast;
    bench::table heal({{"state MiB"},
                       {"ranks"},
                       {"sources"},
                       {"heal over"},
                       {"heal ms", 1},
                       {"heal GB/s", 2},
                       {"allreduce ms", 1},
                       {"busbw GB/s", 2},
                       {"heal/busbw", 2},
                       {"start_quorum ms", 1}});
    for (std::size_t cell = 0; cell < cells; ++cell) {
      const std::int64_t mib = sizes[cell / transports.size()];
      const double bytes_i = static_cast<double>(mib << 20);
      const double h = bench::median(heal_ms[cell]), a = bench::median(allreduce_ms[cell]);
      const double heal_gbs = bytes_i / (h * 1e6), busbw = bytes_i * 2.0 * (n - 1) / n / (a * 1e6);
      heal.add({mib, std::int64_t{n}, std::int64_t{sources},
                std::string(transport_name(transports[cell % transports.size()])), h, heal_gbs, a, busbw,
                heal_gbs / busbw, bench::median(quorum_ms[cell])});
    }
    // Many small tensors against one of the same bytes (the Manager coalesces small ones).
    bench::table small({{"state"}, {"heal ms", 3}, {"start_quorum ms", 3}});
    const auto small_count = static_cast<std::size_t>(args.int_or("--heal-small", 4096));
    std::vector<std::vector<double>> small_heal(2), small_quorum(2);
    const std::size_t shapes[] = {1, small_count};
    for (int r = 0; r < reps; ++r) {
      for (std::size_t i = 0; i < 2; ++i) {
        std::vector<std::vector<float>> state(shapes[i], std::vector<float>(small_count * 256 / shapes[i]));
        const auto v = heal_once("small" + std::to_string(shapes[i]), state, 0);
        small_quorum[i].push_back(v[0]);
        small_heal[i].push_back(v[1]);
      }
    }
    for (std::size_t i = 0; i < 2; ++i) {
      small.add({std::to_string(shapes[i]) + " x " + std::to_string(small_count / shapes[i]) + " KiB",
                 bench::median(small_heal[i]), bench::median(small_quorum[i])});
    }
    if (rank == 0) {
      std::cout << "Manager steady-state overhead, " << n << " ranks over MPI (median of " << iters
                << " alternating iterations)\n";
      steady.print(std::cout);
      std::cout << "\nHealing a joining replica from " << sources
                << " up-to-date replica(s), against an allreduce of the same bytes on the same communicator"
                << " (median of " << reps << " heals, " << 2 * reps << " allreduces; chunks of "
                << (heal_options().heal_chunk_bytes >> 20) << " MiB)\n";
      heal.print(std::cout);
      std::cout << "\nHealing many small tensors against one tensor of the same bytes (median of " << reps << ")\n";
      small.print(std::cout);
      if (auto csv = args.csv()) {
        std::ofstream out(*csv);
        steady.write_csv(out);
        out << "\n";
        heal.write_csv(out);
        out << "\n";
        small.write_csv(out);
      }
      std::filesystem::remove_all(dir);
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "manager_bench: rank " << rank << ": " << e.what() << "\n";
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}
