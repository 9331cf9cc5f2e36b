// How much of a non-blocking allreduce overlaps with computation, depending on who drives MPI's
// progress. Decides how the Bucketer drives in-flight buckets.
//
// Open MPI moves a non-blocking collective only inside MPI calls. A training step launches a
// bucket's allreduce and goes on computing (the rest of the backward pass); this program times
//   alone:    the allreduce by itself (issue + wait), and the compute loop by itself
//   step:     issue, compute with T calls of work::test() spread evenly through it, then wait
//   thread:   issue, a progress thread calls work::test() (spinning, every 100 us or 1 ms) while
//             the main thread computes, then join
// and reports overlap % = (allreduce alone + compute alone - step) / min(both alone): 100 % is
// perfect hiding of the shorter one, 0 % is none (step = sum of both).
//
//   mpiexec -n 2 mpi_progress_bench [--bytes 25MiB] [--compute-ms 20] [--reps 5] [--csv out.csv]
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include <ddp/mpi.hpp>

#include "common/cli.hpp"
#include "common/stats.hpp"
#include "common/table.hpp"

namespace {

// A fixed amount of arithmetic on a cache-resident array: stands in for backward compute
// without competing with the allreduce for memory bandwidth more than real kernels would.
class compute_loop {
 public:
  compute_loop() : data_(16 * 1024, 1.0f) {}

  /// Runs `chunks` chunks of work (a chunk is a few microseconds).
  void run(std::int64_t chunks) {
    for (std::int64_t c = 0; c < chunks; ++c) {
      for (float& x : data_) x = x * 0.999f + 0.001f;
    }
    sink_ += data_[static_cast<std::size_t>(sink_) % data_.size()];
  }
  [[nodiscard]] float sink() const noexcept { return sink_; }

 private:
  std::vector<float> data_;
  float sink_ = 0;
};

struct variant {
  std::string name;
  int tests = 0;             // work::test() calls spread through the compute (main-thread variants)
  int thread_sleep_us = -1;  // >= 0: a progress thread tests, sleeping this long between tests
};

struct result {
  double seconds;
  std::int64_t tests;
};

// Slowest rank's value.
double slowest(double mine, MPI_Comm comm) {
  double out = 0;
  MPI_Allreduce(&mine, &out, 1, MPI_DOUBLE, MPI_MAX, comm);
  return out;
}

result time_step(const variant& v, ddp::mpi::communicator& comm, std::vector<float>& buf, compute_loop& cpu,
                 std::int64_t chunks, MPI_Comm sync) {
  MPI_Barrier(sync);
  bench::stopwatch clock;
  std::int64_t tests = 0;
  ddp::work w = comm.allreduce(buf, ddp::reduce_op::sum);
  if (v.thread_sleep_us >= 0) {
    std::atomic<bool> done{false};
    std::thread progress([&] {
      while (!w.test()) {
        ++tests;
        if (v.thread_sleep_us > 0) {
          std::this_thread::sleep_for(std::chrono::microseconds(v.thread_sleep_us));
        } else {
          std::this_thread::yield();
        }
      }
      done = true;
    });
    cpu.run(chunks);
    progress.join();
  } else {
    // T tests split the compute into T + 1 equal slices.
    const std::int64_t slices = v.tests + 1;
    for (std::int64_t s = 0; s < slices; ++s) {
      cpu.run(chunks * (s + 1) / slices - chunks * s / slices);
      if (s + 1 < slices) {
        (void)w.test();
        ++tests;
      }
    }
    w.wait();
  }
  return {slowest(clock.seconds(), sync), tests};
}

int run(const bench::cli& args) {
  const auto bytes = args.bytes_or("--bytes", std::uint64_t{25} << 20);
  const double compute_ms = args.double_or("--compute-ms", 20.0);
  const int reps = static_cast<int>(args.int_or("--reps", 5));
  const std::string path = args.string_or("--path", "both");

  MPI_Comm sync = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &sync);
  int rank = 0;
  int ranks = 1;
  MPI_Comm_rank(sync, &rank);
  MPI_Comm_size(sync, &ranks);

  // Calibrate the compute loop on rank 0 and use its chunk count everywhere.
  compute_loop cpu;
  std::int64_t chunks = 0;
  if (rank == 0) {
    cpu.run(50);
    bench::stopwatch clock;
    cpu.run(200);
    const double per_chunk = clock.seconds() / 200;
    chunks = std::max<std::int64_t>(1, static_cast<std::int64_t>(compute_ms / 1e3 / per_chunk));
  }
  MPI_Bcast(&chunks, 1, MPI_INT64_T, 0, sync);

  const std::vector<variant> variants{{"main thread, 0 tests", 0, -1},     {"main thread, 10 tests", 10, -1},
                                      {"main thread, 100 tests", 100, -1}, {"main thread, 1000 tests", 1000, -1},
                                      {"progress thread, spin", 0, 0},     {"progress thread, 100 us", 0, 100},
                                      {"progress thread, 1 ms", 0, 1000}};
  std::vector<std::pair<std::string, ddp::mpi::options>> paths;
  if (path == "both" || path == "ring") paths.push_back({"ring", {.ring_min_bytes = 0}});
  if (path == "both" || path == "iallreduce") {
    paths.push_back({"iallreduce", {.ring_min_bytes = ddp::mpi::options::never}});
  }
  if (paths.empty()) throw std::invalid_argument("--path must be ring, iallreduce or both");

  bench::table table({{"path"},
                      {"progress"},
                      {"tests"},
                      {"step ms", 2},
                      {"allreduce alone ms", 2},
                      {"compute alone ms", 2},
                      {"overlap %", 1}});
  std::vector<float> buf(bytes / 4, 0.0f);
  for (const auto& [name, opts] : paths) {
    auto comm = ddp::mpi::communicator::world(opts);
    comm.allreduce(buf, ddp::reduce_op::sum).wait();  // warm-up: page faults, connections
    std::vector<double> alone_ar;
    std::vector<double> alone_cpu;
    std::vector<std::vector<double>> steps(variants.size());
    std::vector<std::int64_t> tests(variants.size());
    // Interleave everything within each repetition so drift hits all variants alike.
    for (int rep = 0; rep < reps; ++rep) {
      MPI_Barrier(sync);
      bench::stopwatch clock;
      comm.allreduce(buf, ddp::reduce_op::sum).wait();
      alone_ar.push_back(slowest(clock.seconds(), sync));
      MPI_Barrier(sync);
      clock.restart();
      cpu.run(chunks);
      alone_cpu.push_back(slowest(clock.seconds(), sync));
      for (std::size_t k = 0; k < variants.size(); ++k) {
        const std::size_t i = (k + static_cast<std::size_t>(rep)) % variants.size();
        const result r = time_step(variants[i], comm, buf, cpu, chunks, sync);
        steps[i].push_back(r.seconds);
        tests[i] = std::max(tests[i], r.tests);
      }
    }
    const double ar = bench::median(alone_ar);
    const double cp = bench::median(alone_cpu);
    for (std::size_t i = 0; i < variants.size(); ++i) {
      const double step = bench::median(steps[i]);
      table.add({name, variants[i].name, tests[i], step * 1e3, ar * 1e3, cp * 1e3,
                 (ar + cp - step) / std::min(ar, cp) * 100});
    }
  }
  MPI_Comm_free(&sync);
  if (rank == 0) {
    std::cout << "# overlap of a " << bench::cli::format_bytes(bytes) << " f32 allreduce with " << compute_ms
              << " ms of compute, " << ranks << " ranks, median of " << reps << " repetitions (slowest rank)"
              << " [sink " << cpu.sink() << "]\n";
    table.print(std::cout);
    if (const auto csv = args.csv()) table.write_csv(*csv);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const bench::cli args(argc, argv, "Overlap of a non-blocking allreduce with compute, by progress strategy.",
                          {{"--bytes", "BYTES", "allreduce size (default 25MiB, a bucket)"},
                           {"--compute-ms", "MS", "compute per step (default 20)"},
                           {"--reps", "N", "repetitions; the median is shown (default 5)"},
                           {"--path", "ring|iallreduce|both", "ddp allreduce path(s) to measure (default both)"}});
    if (args.help_requested()) {
      args.print_help(std::cout);
      return 0;
    }
    ddp::mpi::environment env(&argc, &argv);
    if (env.provided() < ddp::mpi::thread_level::serialized) {
      std::fprintf(stderr, "mpi_progress_bench: the progress-thread variants need MPI_THREAD_SERIALIZED\n");
      return 1;
    }
    return run(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mpi_progress_bench: %s\n", e.what());
    return 1;
  }
}
