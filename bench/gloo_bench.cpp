// Allreduce bandwidth over the gloo backend, 4 B .. 256 MiB of f32, in place, sum.
//
//   gloo_bench [--np N] [--min-bytes B] [--max-bytes B] [--iters N] [--repeat N] [--csv FILE] [--hostname H]
//       Forks N processes (default 2) that meet in a file store in a temporary directory.
//   mpiexec -n N gloo_bench --mpi [same options]            (when built with ddp::mpi)
//       Ranks come from MPI; gloo still meets through a file store (its directory is broadcast
//       over MPI). Every size is timed over gloo, ddp::mpi and raw MPI_Allreduce in the same
//       processes, interleaved, so the numbers are comparable.
//
// Each sample: untimed barrier, then `iters` allreduces back to back, each waited; the time is
// the slowest rank's (max-reduced afterwards), divided by `iters`. The best of `--repeat` samples
// (default 3, backends taking turns) is reported: the machines are shared. algbw = bytes / time;
// busbw = algbw * 2 (n - 1) / n (the bytes each rank's link carries in a ring). Rank 0 prints a
// table; `--csv FILE` writes the same rows.

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <ddp/gloo.hpp>

#ifdef DDP_GLOO_BENCH_WITH_MPI
#include <mpi.h>

#include <ddp/mpi.hpp>
#endif

namespace {

struct arguments {
  int np = 2;
  bool mpi = false;
  std::size_t min_bytes = 4;
  std::size_t max_bytes = std::size_t{256} << 20;
  std::string csv;
  std::string hostname = "127.0.0.1";
  int iters = 0;   // 0: chosen per size
  int repeat = 3;  // samples per size and backend; the best is reported
};

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "gloo_bench: " << why
            << "\nusage: gloo_bench [--np N] [--mpi] [--min-bytes B] [--max-bytes B] [--csv FILE] [--hostname H] "
               "[--iters N] [--repeat N]\n";
  std::exit(2);
}

arguments parse(int argc, char** argv) {
  arguments a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--mpi") {
      a.mpi = true;
      continue;
    }
    if (i + 1 >= argc) usage("missing value after " + k);
    const std::string v = argv[++i];
    if (k == "--np") {
      a.np = std::stoi(v);
    } else if (k == "--min-bytes") {
      a.min_bytes = std::stoull(v);
    } else if (k == "--max-bytes") {
      a.max_bytes = std::stoull(v);
    } else if (k == "--csv") {
      a.csv = v;
    } else if (k == "--hostname") {
      a.hostname = v;
    } else if (k == "--iters") {
      a.iters = std::stoi(v);
    } else if (k == "--repeat") {
      a.repeat = std::max(1, std::stoi(v));
    } else {
      usage("unknown option " + k);
    }
  }
  if (a.np < 1) usage("--np must be at least 1");
  if (a.min_bytes < 4) a.min_bytes = 4;
  return a;
}

struct row {
  std::string backend;
  std::size_t bytes;
  int iters;
  double seconds;  // per allreduce, slowest rank
};

/// How to time one backend: an allreduce of the first n floats, a barrier, a max over ranks.
struct backend {
  std::string name;
  std::function<void(float*, std::size_t)> allreduce;
  std::function<void()> barrier;
  std::function<double(double)> max_over_ranks;
};

int iterations_for(const arguments& a, std::size_t bytes) {
  if (a.iters > 0) return a.iters;
  const std::size_t budget = std::size_t{256} << 20;  // about that many bytes per sample
  return static_cast<int>(std::clamp<std::size_t>(budget / bytes, 5, 200));
}

std::vector<std::size_t> sizes(const arguments& a) {
  std::vector<std::size_t> out;
  for (std::size_t b = a.min_bytes; b <= a.max_bytes; b *= 4) out.push_back(b);
  return out;
}

std::string human(std::size_t bytes) {
  std::ostringstream os;
  if (bytes >= (std::size_t{1} << 20)) {
    os << (bytes >> 20) << " MiB";
  } else if (bytes >= 1024) {
    os << (bytes >> 10) << " KiB";
  } else {
    os << bytes << " B";
  }
  return os.str();
}

std::vector<row> run(const arguments& a, std::vector<backend>& backends) {
  std::vector<float> data(a.max_bytes / sizeof(float), 0.0f);  // zeros: sums never overflow
  std::vector<row> rows;
  for (std::size_t bytes : sizes(a)) {
    const std::size_t n = bytes / sizeof(float);
    const int iters = iterations_for(a, bytes);
    std::vector<double> best(backends.size(), 1e300);
    for (auto& b : backends) b.allreduce(data.data(), n);  // warm-up: buffers, page faults
    // Samples of the backends take turns, so a burst of load from elsewhere hits them alike.
    for (int sample = 0; sample < a.repeat; ++sample) {
      for (std::size_t k = 0; k < backends.size(); ++k) {
        auto& b = backends[k];
        b.barrier();
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i) b.allreduce(data.data(), n);
        const double mine = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best[k] = std::min(best[k], b.max_over_ranks(mine) / iters);
      }
    }
    for (std::size_t k = 0; k < backends.size(); ++k) rows.push_back({backends[k].name, bytes, iters, best[k]});
  }
  return rows;
}

void report(const arguments& a, int ranks, const std::string& setting, const std::vector<row>& rows) {
  const double bus = ranks > 1 ? 2.0 * (ranks - 1) / ranks : 1.0;
  std::cout << "allreduce f32 sum in place, " << ranks << " processes, " << setting << "\n"
            << std::setw(10) << "bytes" << std::setw(12) << "backend" << std::setw(8) << "iters" << std::setw(13)
            << "time (us)" << std::setw(14) << "algbw (GB/s)" << std::setw(14) << "busbw (GB/s)"
            << "\n";
  for (const auto& r : rows) {
    const double alg = static_cast<double>(r.bytes) / r.seconds / 1e9;
    std::cout << std::setw(10) << human(r.bytes) << std::setw(12) << r.backend << std::setw(8) << r.iters
              << std::setw(13) << std::fixed << std::setprecision(1) << r.seconds * 1e6 << std::setw(14)
              << std::setprecision(3) << alg << std::setw(14) << alg * bus << "\n";
  }
  if (!a.csv.empty()) {
    std::ofstream out(a.csv);
    out << "backend,ranks,bytes,iterations,best_time_us,algbw_gbps,busbw_gbps\n";
    for (const auto& r : rows) {
      const double alg = static_cast<double>(r.bytes) / r.seconds / 1e9;
      out << r.backend << "," << ranks << "," << r.bytes << "," << r.iters << "," << r.seconds * 1e6 << "," << alg
          << "," << alg * bus << "\n";
    }
    std::cout << "wrote " << a.csv << "\n";
  }
}

backend gloo_backend(ddp::gloo::communicator& comm) {
  return {"gloo",
          [&comm](float* p, std::size_t n) {
            const ddp::tensor_view v{p, n, ddp::dtype::f32, ddp::device::host()};
            comm.allreduce(std::span<const ddp::tensor_view>(&v, 1), ddp::reduce_op::sum).wait();
          },
          [&comm] { comm.barrier().wait(); },
          [&comm](double x) {
            const ddp::tensor_view v{&x, 1, ddp::dtype::f64, ddp::device::host()};
            comm.allreduce(std::span<const ddp::tensor_view>(&v, 1), ddp::reduce_op::max).wait();
            return x;
          }};
}

ddp::gloo::communicator connect_gloo(const std::filesystem::path& dir, int rank, int size, const arguments& a) {
  ddp::stores::file_store store(dir);
  auto ns = ddp::stores::generation_store(store, "gloo-bench", 0);
  return ddp::gloo::communicator(
      ns, rank, size,
      {.timeout = std::chrono::seconds(60), .connect_timeout = std::chrono::seconds(30), .hostname = a.hostname});
}

// One rank of the standalone run (a forked process).
int standalone_rank(const arguments& a, const std::filesystem::path& dir, int rank) {
  try {
    auto comm = connect_gloo(dir, rank, a.np, a);
    std::vector<backend> backends{gloo_backend(comm)};
    const auto rows = run(a, backends);
    if (rank == 0) report(a, a.np, "gloo over TCP on " + a.hostname + " (forked processes)", rows);
    comm.barrier().wait();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "gloo_bench rank " << rank << ": " << e.what() << "\n";
    return 1;
  }
}

int standalone(const arguments& a) {
  std::string pattern = (std::filesystem::temp_directory_path() / "ddp-gloo-bench-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) {
    std::cerr << "gloo_bench: cannot create a temporary directory\n";
    return 1;
  }
  const std::filesystem::path dir = pattern;
  std::cout.flush();
  std::vector<pid_t> children;
  for (int r = 0; r < a.np; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      const int code = standalone_rank(a, dir, r);
      std::cout.flush();
      std::_Exit(code);
    }
    children.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : children) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  std::filesystem::remove_all(dir);
  return failed == 0 ? 0 : 1;
}

#ifdef DDP_GLOO_BENCH_WITH_MPI
int under_mpi(int argc, char** argv, const arguments& a) {
  ddp::mpi::environment env(&argc, &argv);
  int rank = 0;
  int size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  // Rank 0 makes the store's directory and tells the others (same node, or a shared FS).
  char path[4096] = {};
  if (rank == 0) {
    std::string pattern = (std::filesystem::temp_directory_path() / "ddp-gloo-bench-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) MPI_Abort(MPI_COMM_WORLD, 1);
    std::snprintf(path, sizeof(path), "%s", pattern.c_str());
  }
  MPI_Bcast(path, sizeof(path), MPI_CHAR, 0, MPI_COMM_WORLD);
  int code = 0;
  try {
    auto gloo = connect_gloo(path, rank, size, a);
    auto mpi = ddp::mpi::communicator::world({.timeout = std::chrono::seconds(60)});
    std::vector<backend> backends{gloo_backend(gloo)};
    backends.push_back({"ddp::mpi",
                        [&mpi](float* p, std::size_t n) {
                          const ddp::tensor_view v{p, n, ddp::dtype::f32, ddp::device::host()};
                          mpi.allreduce(std::span<const ddp::tensor_view>(&v, 1), ddp::reduce_op::sum).wait();
                        },
                        [] { MPI_Barrier(MPI_COMM_WORLD); },
                        [](double x) {
                          MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
                          return x;
                        }});
    backends.push_back({"MPI",
                        [](float* p, std::size_t n) {
                          MPI_Allreduce(MPI_IN_PLACE, p, static_cast<int>(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
                        },
                        [] { MPI_Barrier(MPI_COMM_WORLD); },
                        [](double x) {
                          MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
                          return x;
                        }});
    const auto rows = run(a, backends);
    if (rank == 0) report(a, size, "gloo (TCP on " + a.hostname + ") next to ddp::mpi and MPI_Allreduce", rows);
    gloo.barrier().wait();
  } catch (const std::exception& e) {
    std::cerr << "gloo_bench rank " << rank << ": " << e.what() << "\n";
    code = 1;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) std::filesystem::remove_all(path);
  return code;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const arguments a = parse(argc, argv);
  if (a.mpi) {
#ifdef DDP_GLOO_BENCH_WITH_MPI
    return under_mpi(argc, argv, a);
#else
    usage("--mpi: this gloo_bench was built without MPI");
#endif
  }
  return standalone(a);
}
