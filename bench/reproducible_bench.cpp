// What world-size-invariant reproducibility costs: the default path (sum the rank's micro-batches
// into the gradients, then the Bucketer's allreduce) against the ReproducibleReducer (the tree
// over global micro-batch indices, cover nodes allgathered, the upper tree on every rank).
//
//   mpiexec -n 2 reproducible_bench [--shapes resnet50.txt] [--micro-batches 8,6] [--iters 10]
//                                   [--chunk 4MiB] [--csv FILE]
//
// The micro-batch gradients are not computed (their values are fixed): the table measures only
// what the two modes do with them. "accumulate" is the local part (M/P passes over the gradients
// either way), "reduce" the cross-rank part (Bucketer: mark_ready + finalize; reproducible:
// finalize), "step" both. Times are the median of the slowest rank.
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
#include <ddp/reproducible.hpp>

#include "common/cli.hpp"
#include "common/shapes.hpp"
#include "common/stats.hpp"
#include "common/table.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

double ms_since(clock_type::time_point t0) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

std::vector<std::size_t> parse_list(const std::string& s) {
  std::vector<std::size_t> out;
  std::stringstream in(s);
  for (std::string x; std::getline(in, x, ',');) out.push_back(static_cast<std::size_t>(std::stoull(x)));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  ddp::mpi::environment env(&argc, &argv);
  auto comm = ddp::mpi::communicator::world();
  ddp::communicator_ref ref(comm);
  const int rank = comm.rank();
  try {
    bench::cli args(argc, argv, "Reproducible reduction vs the default Bucketer (mpiexec -n 2)",
                    {{"--shapes", "FILE", "parameter shapes (default: 24 tensors of 4-128 Ki floats)"},
                     {"--micro-batches", "LIST", "micro-batches per global batch (default 8,6)"},
                     {"--iters", "N", "measured iterations per row (default 10)"},
                     {"--chunk", "BYTES", "ReproducibleReducer chunk_bytes (default 4MiB)"}});
    if (args.has("--help")) {
      if (rank == 0) args.print_help(std::cout);
      return 0;
    }
    const int iters = static_cast<int>(args.int_or("--iters", 10));
    const auto chunk = static_cast<std::size_t>(args.bytes_or("--chunk", std::size_t{4} << 20));
    std::vector<std::size_t> small;
    for (int i = 0; i < 24; ++i) small.push_back(std::size_t{1} << (12 + i % 6));
    const auto counts = bench::read_counts(args.string_or("--shapes", ""), small);
    std::size_t total = 0;
    for (auto n : counts) total += n;
    // The trainer's gradient tensors (where a backward pass writes each micro-batch's gradients).
    std::vector<std::vector<float>> grads;
    for (std::size_t t = 0; t < counts.size(); ++t) {
      grads.emplace_back(counts[t]);
      for (std::size_t k = 0; k < counts[t]; ++k) grads[t][k] = static_cast<float>((k * 7 + t) % 101) * 0.01f - 0.5f;
    }
    std::vector<std::vector<float>> acc;  // the default path's accumulated gradients
    for (auto n : counts) acc.emplace_back(n);
    ddp::Bucketer<> bucketer(comm);
    for (auto& a : acc) bucketer.add(a);
    bucketer.build();

    // Runs `f` `iters` times after one warm-up; returns the median of the slowest rank per part.
    auto measure = [&](auto&& local, auto&& reduce) {
      std::vector<double> tl, tr, ts;
      for (int i = 0; i <= iters; ++i) {
        comm.barrier().wait();
        const auto t0 = clock_type::now();
        local();
        const double l = ms_since(t0);
        const auto t1 = clock_type::now();
        reduce();
        std::vector<double> ms{l, ms_since(t1), ms_since(t0)};
        ref.allreduce(ms, ddp::reduce_op::max).wait();
        if (i > 0) {
          tl.push_back(ms[0]);
          tr.push_back(ms[1]);
          ts.push_back(ms[2]);
        }
      }
      return std::vector<double>{bench::median(tl), bench::median(tr), bench::median(ts)};
    };

    bench::table t({{"mode"},
                    {"M"},
                    {"K"},
                    {"accumulate ms", 2},
                    {"reduce ms", 2},
                    {"step ms", 2},
                    {"/ default", 2},
                    {"received MiB / rank", 1},
                    {"of reduce: waiting ms", 2}});
    for (std::size_t m : parse_list(args.string_or("--micro-batches", "8,6"))) {
      const ddp::item_range mine = ddp::contiguous_share(m, comm.size(), rank);
      const auto plain = measure(
          [&] {
            for (std::size_t i = mine.first; i < mine.last; ++i) {  // acc (=|+=) grads, as .grad accumulation
              for (std::size_t k = 0; k < grads.size(); ++k) {
                float* a = acc[k].data();
                const float* g = grads[k].data();
                if (i == mine.first) {
                  std::copy(g, g + counts[k], a);
                } else {
                  ddp::reproducible::detail::add(a, a, g, counts[k]);  // the same vectorised kernel
                }
              }
            }
          },
          [&] {
            for (std::size_t k = counts.size(); k-- > 0;) bucketer.mark_ready(k);
            bucketer.finalize();
          });
      ddp::ReproducibleReducer red(comm, m, {.chunk_bytes = chunk});
      for (auto& g : grads) red.add(g);
      red.build();
      std::vector<double> waits;
      const auto repro = measure(
          [&] {
            red.begin();
            for (std::size_t i = mine.first; i < mine.last; ++i) red.accumulate(i);
          },
          [&] {
            red.finalize();
            waits.push_back(red.last_step().wait_ms);
          });
      const auto& st = red.last_step();
      t.add({std::string("default (sum + Bucketer)"), static_cast<std::int64_t>(m), std::string("-"), plain[0],
             plain[1], plain[2], 1.0,
             2.0 * static_cast<double>(total * 4) * (comm.size() - 1) / comm.size() / (1 << 20), std::string("-")});
      t.add({std::string("reproducible"), static_cast<std::int64_t>(m), static_cast<std::int64_t>(st.max_cover),
             repro[0], repro[1], repro[2], repro[2] / plain[2], static_cast<double>(st.bytes_received) / (1 << 20),
             bench::median(waits)});
    }
    if (rank == 0) {
      double load = 0;
      if (std::ifstream la("/proc/loadavg"); la) la >> load;
      std::cout << "Reproducible reduction vs default, " << counts.size() << " tensors, "
                << static_cast<double>(total * 4) / (1 << 20) << " MiB f32, " << comm.size() << " ranks (median of "
                << iters << ", slowest rank; 1-minute load " << load << " at the end)\n";
      t.print(std::cout);
      if (auto csv = args.csv()) {
        std::ofstream out(*csv);
        t.write_csv(out);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "reproducible_bench: rank " << rank << ": " << e.what() << "\n";
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}
