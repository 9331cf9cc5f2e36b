// Allreduce latency and bandwidth of ddp::mpi::communicator against raw MPI in the same run.
//
// For each message size (f32, sum, in place) it times three variants, interleaved in rotating
// order so machine noise hits all of them alike, and reports the median over repetitions of
// the slowest rank's time per call:
//   raw     MPI_Allreduce(MPI_IN_PLACE, ...)                    (blocking, the reference)
//   raw-nb  MPI_Iallreduce(MPI_IN_PLACE, ...) + MPI_Test loop   (what a non-blocking API costs in MPI itself)
//   ddp     comm.allreduce(buffer, sum).wait()
// Bus bandwidth follows the NCCL convention: bytes / time * 2 (n - 1) / n.
//
//   mpiexec -n 2 allreduce_bench [--max-bytes 256MiB] [--reps 7] [--csv out.csv]
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include <ddp/mpi.hpp>

#include "common/cli.hpp"
#include "common/stats.hpp"
#include "common/table.hpp"

namespace {

enum class variant { raw, raw_nb, ddp };

struct setup {
  std::uint64_t min_bytes;
  std::uint64_t max_bytes;
  std::uint64_t factor;
  int reps;
  std::uint64_t budget;  // bytes moved per repetition and variant: sets the iteration count
};

// Seconds per call of `v`, the slowest rank's.
double time_variant(variant v, int iters, std::vector<float>& buf, MPI_Comm raw, ddp::mpi::communicator& comm) {
  const int n = static_cast<int>(buf.size());
  MPI_Barrier(raw);
  bench::stopwatch clock;
  for (int i = 0; i < iters; ++i) {
    switch (v) {
      case variant::raw: MPI_Allreduce(MPI_IN_PLACE, buf.data(), n, MPI_FLOAT, MPI_SUM, raw); break;
      case variant::raw_nb: {
        MPI_Request req = MPI_REQUEST_NULL;
        MPI_Iallreduce(MPI_IN_PLACE, buf.data(), n, MPI_FLOAT, MPI_SUM, raw, &req);
        for (int done = 0; !done;) MPI_Test(&req, &done, MPI_STATUS_IGNORE);
        break;
      }
      case variant::ddp: comm.allreduce(buf, ddp::reduce_op::sum).wait(); break;
    }
  }
  const double mine = clock.seconds() / iters;
  double slowest = 0;
  MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, raw);
  return slowest;
}

int run(const bench::cli& args) {
  const setup s{args.bytes_or("--min-bytes", 4), args.bytes_or("--max-bytes", std::uint64_t{256} << 20),
                std::max<std::uint64_t>(2, args.bytes_or("--factor", 4)), static_cast<int>(args.int_or("--reps", 7)),
                args.bytes_or("--budget", std::uint64_t{64} << 20)};
  ddp::mpi::options opts;
  if (args.has("--ring-min-bytes")) {
    const std::string v = *args.get("--ring-min-bytes");
    opts.ring_min_bytes = v == "never" ? ddp::mpi::options::never : bench::cli::parse_bytes("--ring-min-bytes", v);
  }
  opts.ring_segment_bytes = args.bytes_or("--ring-segment-bytes", opts.ring_segment_bytes);
  opts.recursive_doubling_max_bytes =
      args.bytes_or("--recursive-doubling-max-bytes", opts.recursive_doubling_max_bytes);
  opts.halving_doubling_max_bytes = args.bytes_or("--halving-doubling-max-bytes", opts.halving_doubling_max_bytes);

  auto comm = ddp::mpi::communicator::world(opts);
  MPI_Comm raw = MPI_COMM_NULL;  // the raw variants get their own duplicate, like ddp
  MPI_Comm_dup(MPI_COMM_WORLD, &raw);
  const int ranks = comm.size();
  const bool root = comm.rank() == 0;

  bench::table table({{"bytes"},
                      {"size"},
                      {"ddp path"},
                      {"iters"},
                      {"raw us", 2},
                      {"raw-nb us", 2},
                      {"ddp us", 2},
                      {"ddp/raw", 3},
                      {"ddp-raw us", 2},
                      {"raw GB/s", 3},
                      {"ddp GB/s", 3}});
  const double bus_factor = ranks > 1 ? 2.0 * (ranks - 1) / ranks : 0.0;
  const variant order[] = {variant::raw, variant::raw_nb, variant::ddp};
  for (std::uint64_t bytes = std::max<std::uint64_t>(4, s.min_bytes); bytes <= s.max_bytes; bytes *= s.factor) {
    std::vector<float> buf(bytes / 4, 0.0f);  // zeros stay zeros: no overflow, no denormals
    const int iters = static_cast<int>(std::clamp<std::uint64_t>(s.budget / bytes, 1, 2000));
    std::vector<double> t[3];
    // One untimed round first: page faults, MPI's connection set-up, schedule caches.
    for (variant v : order) (void)time_variant(v, 1, buf, raw, comm);
    for (int rep = 0; rep < s.reps; ++rep) {
      for (int k = 0; k < 3; ++k) {
        const variant v = order[(k + rep) % 3];
        t[static_cast<int>(v)].push_back(time_variant(v, iters, buf, raw, comm));
      }
    }
    const double raw_s = bench::median(t[0]);
    const double nb_s = bench::median(t[1]);
    const double ddp_s = bench::median(t[2]);
    const ddp::mpi::algorithm path = opts.selector()(bytes, ranks);  // what ddp runs it with
    const auto gbs = [&](double sec) { return static_cast<double>(bytes) / sec * bus_factor / 1e9; };
    table.add({static_cast<std::int64_t>(bytes), bench::cli::format_bytes(bytes), std::string(ddp::mpi::name_of(path)),
               std::int64_t{iters}, raw_s * 1e6, nb_s * 1e6, ddp_s * 1e6, ddp_s / raw_s, (ddp_s - raw_s) * 1e6,
               gbs(raw_s), gbs(ddp_s)});
    if (bytes > s.max_bytes / s.factor) break;  // no overflow past the largest size
  }
  MPI_Comm_free(&raw);
  if (root) {
    std::cout << "# allreduce f32 sum in place, " << ranks << " ranks, median of " << s.reps
              << " repetitions of the slowest rank's time per call; ddp options " << opts << "\n";
    table.print(std::cout);
    if (const auto csv = args.csv()) table.write_csv(*csv);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const bench::cli args(
        argc, argv, "Allreduce latency and bandwidth: ddp::mpi::communicator vs raw MPI.",
        {{"--min-bytes", "BYTES", "smallest message (default 4)"},
         {"--max-bytes", "BYTES", "largest message (default 256MiB)"},
         {"--factor", "N", "size step (default 4)"},
         {"--reps", "N", "timed repetitions per size and variant; the median is shown (default 7)"},
         {"--budget", "BYTES", "bytes per repetition, sets iterations per size (default 64MiB)"},
         {"--ring-min-bytes", "BYTES|never", "ddp option ring_min_bytes"},
         {"--ring-segment-bytes", "BYTES", "ddp option ring_segment_bytes"},
         {"--recursive-doubling-max-bytes", "BYTES", "ddp option recursive_doubling_max_bytes (0: never)"},
         {"--halving-doubling-max-bytes", "BYTES", "ddp option halving_doubling_max_bytes (0: never)"}});
    if (args.help_requested()) {
      args.print_help(std::cout);
      return 0;
    }
    ddp::mpi::environment env(&argc, &argv);
    return run(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "allreduce_bench: %s\n", e.what());
    return 1;
  }
}
