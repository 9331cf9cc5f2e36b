// Does the Bucketer hide communication behind the backward pass?
//
//   mpiexec -n 2 overlap_bench [--shapes resnet50.txt] [--iters 10] [--world] [--slow-link-cap-mb 4] [--csv FILE]
//
// Table 1, no compute: one allreduce of all gradient bytes (the practical limit), one allreduce
// per tensor, the Bucketer (default policy, copy path) and the Bucketer zero-copy.
// Table 2, a simulated backward pass: gradients become ready one by one, last layer first, each
// after busy compute proportional to its size, the whole pass taking `scale` times the flat
// allreduce's time. The step time is compared with max(compute, flat allreduce): 1.0 means the
// communication is completely hidden (or the compute is), the target is under 1.2. Rows: the
// copy path, zero-copy, zero-copy with the Bucketer's optional progress thread
// (bucketer_options::progress_interval), then the layouts for slow links: buckets of at most
// --slow-link-cap-mb (default 4), plain and tapered (bucketing::small_bucket::tapered).
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <ddp/bucketer.hpp>
#include <ddp/mpi.hpp>
#include <ddp/world.hpp>

#include "common/cli.hpp"
#include "common/shapes.hpp"
#include "common/stats.hpp"
#include "common/table.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

// Busy "compute": keeps the core busy like a real backward kernel would.
void spin_for(std::chrono::nanoseconds d) {
  const auto end = clock_type::now() + d;
  volatile double x = 1.0;
  while (clock_type::now() < end) {
    for (int i = 0; i < 64; ++i) x = x * 1.0000001 + 1e-9;
  }
}

double ms_since(clock_type::time_point t0) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

// The tables over `comm` (ddp::mpi, or ddp::world's node-aware communicator).
template <class Comm>
void run(Comm& comm, const bench::cli& args, const std::string& path) {
  ddp::communicator_ref ref(comm);
  const int rank = comm.rank();
  {
    const int iters = static_cast<int>(args.int_or("--iters", 10));
    std::vector<std::size_t> small;  // default: 24 tensors of 4 Ki .. 128 Ki elements
    for (int i = 0; i < 24; ++i) small.push_back(std::size_t{1} << (12 + i % 6));
    const auto counts = bench::read_counts(args.string_or("--shapes", ""), small);
    std::size_t total = 0;
    for (auto n : counts) total += n;
    std::vector<std::vector<float>> g;
    for (auto n : counts) g.emplace_back(n, 1.0f);
    std::vector<float> flat(total, 1.0f);

    // The layouts for slow links (docs/bucketer.md, "Across slow links"): small buckets, so that
    // communication trails the backward pass by little; tapered, so that it starts early and
    // little of it is left after the backward pass.
    const std::size_t slow_cap = static_cast<std::size_t>(args.int_or("--slow-link-cap-mb", 4)) << 20;
    const ddp::bucketing::size_capped small_buckets{.cap_bytes = slow_cap};
    const ddp::bucketing::size_capped tapered{.cap_bytes = slow_cap, .small_at = ddp::small_bucket::tapered};
    const auto thread = std::chrono::microseconds(200);
    ddp::Bucketer copy_path(comm);
    ddp::Bucketer zero_copy(comm, {}, {.zero_copy = true});
    ddp::Bucketer threaded(comm, {}, {.zero_copy = true, .progress_interval = thread});
    ddp::Bucketer small_zero_copy(comm, small_buckets, {.zero_copy = true});
    ddp::Bucketer tapered_zero_copy(comm, tapered, {.zero_copy = true});
    ddp::Bucketer tapered_threaded(comm, tapered, {.zero_copy = true, .progress_interval = thread});
    for (auto& x : g) {
      copy_path.add(x);
      zero_copy.add(x);  // zero-copy: the gradients live in zero_copy's buckets; x only gives the shape
      threaded.add(x);
      small_zero_copy.add(x);
      tapered_zero_copy.add(x);
      tapered_threaded.add(x);
    }
    copy_path.build();
    zero_copy.build();
    threaded.build();
    small_zero_copy.build();
    tapered_zero_copy.build();
    tapered_threaded.build();

    // Runs `f` `iters` times (after one warm-up), returns the median of the slowest rank's time.
    auto measure = [&](auto&& f) {
      std::vector<double> samples;
      for (int i = 0; i <= iters; ++i) {
        comm.barrier().wait();
        const auto t0 = clock_type::now();
        f();
        std::vector<double> ms{ms_since(t0)};
        ref.allreduce(ms, ddp::reduce_op::max).wait();
        if (i > 0) samples.push_back(ms[0]);
      }
      return bench::median(samples);
    };
    auto bucketer_step = [&](auto& b, std::chrono::nanoseconds compute) {
      for (std::size_t i = counts.size(); i-- > 0;) {  // last layer first
        if (compute.count() > 0) spin_for(compute * static_cast<long>(counts[i]) / static_cast<long>(total));
        b.mark_ready(i);
      }
      b.finalize();
    };

    const double t_flat = measure([&] { ref.allreduce(flat, ddp::reduce_op::avg).wait(); });
    const double t_per_tensor = measure([&] {
      for (auto& x : g) ref.allreduce(x, ddp::reduce_op::avg).wait();
    });
    const double t_copy = measure([&] { bucketer_step(copy_path, std::chrono::nanoseconds(0)); });
    const double t_zero = measure([&] { bucketer_step(zero_copy, std::chrono::nanoseconds(0)); });

    bench::table sync({{"what"}, {"buckets"}, {"median ms", 2}, {"/ flat", 2}});
    sync.add({std::string("(1) one flat allreduce"), std::int64_t{1}, t_flat, 1.0});
    sync.add({std::string("(2) one allreduce per tensor"), static_cast<std::int64_t>(counts.size()), t_per_tensor,
              t_per_tensor / t_flat});
    sync.add({std::string("(3) Bucketer, default"), static_cast<std::int64_t>(copy_path.layout().size()), t_copy,
              t_copy / t_flat});
    sync.add({std::string("(4) Bucketer, zero-copy"), static_cast<std::int64_t>(zero_copy.layout().size()), t_zero,
              t_zero / t_flat});

    bench::table overlap(
        {{"compute / flat", 1}, {"Bucketer"}, {"buckets"}, {"compute ms", 2}, {"step ms", 2}, {"ratio", 2}});
    for (double scale : {0.5, 1.0, 2.0}) {
      const auto compute = std::chrono::nanoseconds(static_cast<long>(scale * t_flat * 1e6));
      const double t_compute = measure([&] { spin_for(compute); });
      const double bound = std::max(t_compute, t_flat);
      auto row = [&](const std::string& what, auto& b) {
        const double step = measure([&] { bucketer_step(b, compute); });
        overlap.add({scale, what, static_cast<std::int64_t>(b.layout().size()), t_compute, step, step / bound});
      };
      row("copy (default)", copy_path);
      row("zero-copy", zero_copy);
      row("zero-copy + progress thread", threaded);
      const std::string cap = std::to_string(slow_cap >> 20) + " MiB";
      row("zero-copy, " + cap, small_zero_copy);
      row("zero-copy, " + cap + " tapered", tapered_zero_copy);
      row("zero-copy, " + cap + " tapered + progress thread", tapered_threaded);
    }
    if (rank == 0) {
      std::cout << "Gradient synchronisation over " << path << ", " << counts.size() << " tensors, "
                << static_cast<double>(total * 4) / (1 << 20) << " MiB, " << comm.size() << " ranks (median of "
                << iters << ", slowest rank)\n";
      sync.print(std::cout);
      std::cout << "\nSimulated backward pass (ratio = step / max(compute, flat allreduce); 1.0 = fully hidden)\n";
      overlap.print(std::cout);
      if (auto csv = args.csv()) {
        std::ofstream out(*csv);
        sync.write_csv(out);
        out << "\n";
        overlap.write_csv(out);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  ddp::mpi::environment env(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  try {
    bench::cli args(
        argc, argv, "Bucketer overlap with a simulated backward pass (mpiexec -n 2)",
        {{"--shapes", "FILE", "parameter shapes (default: 24 small tensors)"},
         {"--iters", "N", "measured iterations per row (default 10)"},
         {"--slow-link-cap-mb", "N", "bucket cap of the slow-link rows (default 4)"},
         {"--world", "", "over ddp::world (shared memory in a host, sockets between hosts), not ddp::mpi"}});
    if (args.has("--help")) {
      if (rank == 0) args.print_help(std::cout);
      return 0;
    }
    if (args.has("--world")) {
      auto comm = ddp::world(env);
      run(comm, args, "ddp::world");
    } else {
      auto comm = ddp::mpi::communicator::world();
      run(comm, args, "ddp::mpi");
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "overlap_bench: rank " << rank << ": " << e.what() << "\n";
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}
