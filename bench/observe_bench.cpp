// What do straggler attribution and the timeline cost per step?
//
//   mpiexec -n 2 observe_bench [--shapes resnet50.txt] [--iters 20] [--compute 1.0] [--csv FILE]
//
// A simulated backward pass (busy compute proportional to each gradient's size, last layer
// first, `compute` times one flat allreduce of all gradients in total) drives three
// configurations, interleaved step by step so that the machine's load drifts over all of them
// alike: (1) a plain Bucketer, (2) the same with `straggler_every = 1` (one allgather of 5 int64
// per rank at the end of every finalize), (3) that plus a timeline recorder (every mark_ready,
// bucket, finalize and step recorded). Reported: the median step time of the slowest rank, its
// ratio to (1), and the directly measured cost of the added work (the exchange's own duration,
// the recorder's time per step), which is not subject to step-time noise.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <ddp/bucketer.hpp>
#include <ddp/mpi.hpp>
#include <ddp/timeline.hpp>

#include "common/cli.hpp"
#include "common/shapes.hpp"
#include "common/stats.hpp"
#include "common/table.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

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

}  // namespace

int main(int argc, char** argv) {
  ddp::mpi::environment env(&argc, &argv);
  auto comm = ddp::mpi::communicator::world();
  ddp::communicator_ref ref(comm);
  const int rank = comm.rank();
  try {
    bench::cli args(argc, argv, "Cost of straggler attribution and the timeline per step (mpiexec -n 2)",
                    {{"--shapes", "FILE", "parameter shapes (default: 24 small tensors)"},
                     {"--iters", "N", "measured steps per configuration (default 20)"},
                     {"--compute", "X", "backward compute as a multiple of one flat allreduce (default 1.0)"}});
    if (args.has("--help")) {
      if (rank == 0) args.print_help(std::cout);
      return 0;
    }
    const int iters = static_cast<int>(args.int_or("--iters", 20));
    const double scale = std::stod(args.string_or("--compute", "1.0"));
    std::vector<std::size_t> small;
    for (int i = 0; i < 24; ++i) small.push_back(std::size_t{1} << (12 + i % 6));
    const auto counts = bench::read_counts(args.string_or("--shapes", ""), small);
    std::size_t total = 0;
    for (auto n : counts) total += n;
    std::vector<std::vector<float>> g;
    for (auto n : counts) g.emplace_back(n, 1.0f);
    std::vector<float> flat(total, 1.0f);

    ddp::Bucketer plain(comm);
    ddp::Bucketer observed(comm, {}, {.straggler_every = 1});
    for (auto& x : g) {
      plain.add(x);
      observed.add(x);
    }
    plain.build();
    observed.build();
    ddp::timeline::recorder rec(rank);
    rec.synchronize(comm);

    auto slowest = [&](double ms) {
      std::vector<double> v{ms};
      ref.allreduce(v, ddp::reduce_op::max).wait();
      return v[0];
    };
    std::vector<double> flat_samples;
    for (int i = 0; i < 6; ++i) {
      comm.barrier().wait();
      const auto t0 = clock_type::now();
      ref.allreduce(flat, ddp::reduce_op::avg).wait();
      const double ms = slowest(ms_since(t0));
      if (i > 0) flat_samples.push_back(ms);
    }
    const double t_flat = bench::median(flat_samples);
    const auto compute = std::chrono::nanoseconds(static_cast<long>(scale * t_flat * 1e6));

    auto step = [&](auto& b) {
      for (std::size_t i = counts.size(); i-- > 0;) {
        spin_for(compute * static_cast<long>(counts[i]) / static_cast<long>(total));
        b.mark_ready(i);
      }
      b.finalize();
    };
    // Interleaved: plain, observed, observed + recorder, plain, ...
    std::vector<double> s_plain, s_straggler, s_both, exchange_ms;
    for (int i = 0; i <= iters; ++i) {
      for (int config = 0; config < 3; ++config) {
        observed.set_recorder(config == 2 ? &rec : nullptr);
        comm.barrier().wait();
        const auto t0 = clock_type::now();
        if (config == 0) {
          step(plain);
        } else {
          step(observed);
        }
        const double ms = slowest(ms_since(t0));
        if (i == 0) continue;  // warm-up
        (config == 0 ? s_plain : config == 1 ? s_straggler : s_both).push_back(ms);
      }
    }
    // The exchange alone, as finalize() runs it (one allgather of 5 int64 per rank), measured
    // back to back after a barrier: its cost per step without step-time noise.
    for (int i = 0; i <= 4 * iters; ++i) {
      comm.barrier().wait();
      std::vector<std::int64_t> mine(ddp::timing_words, 1),
          all(ddp::timing_words * static_cast<std::size_t>(comm.size()));
      const auto t0 = clock_type::now();
      comm.allgather(ddp::view(mine), ddp::view(all)).wait();
      const double ms = slowest(ms_since(t0));
      if (i > 0) exchange_ms.push_back(ms);
    }
    // Recording alone: the events of one step, recorded back to back.
    const std::size_t events_per_step = counts.size() + 2 * observed.layout().size() + 3;
    const auto r0 = clock_type::now();
    constexpr int rec_reps = 200;
    ddp::timeline::recorder scratch(rank);
    for (int k = 0; k < rec_reps; ++k) {
      const auto now = clock_type::now();
      for (std::size_t e = 0; e < events_per_step; ++e) scratch.instant("backward", "ready", now, {{"gradient", 1.0}});
      if (k % 50 == 49) scratch.clear();
    }
    const double record_ms = ms_since(r0) / rec_reps;

    const double m_plain = bench::median(s_plain), m_str = bench::median(s_straggler), m_both = bench::median(s_both);
    const double m_exchange = bench::median(exchange_ms);
    bench::table t({{"configuration"},
                    {"median step ms", 2},
                    {"/ plain", 3},
                    {"added work ms/step", 3},
                    {"added / plain step", 4}});
    t.add({std::string("(1) plain Bucketer"), m_plain, 1.0, 0.0, 0.0});
    t.add({std::string("(2) + straggler_every = 1"), m_str, m_str / m_plain, m_exchange, m_exchange / m_plain});
    t.add({std::string("(3) + timeline recorder"), m_both, m_both / m_plain, m_exchange + record_ms,
           (m_exchange + record_ms) / m_plain});
    const auto& rep = observed.last_step().straggler;
    if (rank == 0) {
      std::cout << "Cost of observation per step: " << counts.size() << " tensors, "
                << static_cast<double>(total * 4) / (1 << 20) << " MiB, " << comm.size() << " ranks, "
                << observed.layout().size() << " buckets, backward compute " << scale << " x flat allreduce (" << t_flat
                << " ms); median of " << iters << " interleaved steps, slowest rank\n";
      t.print(std::cout);
      std::cout << "last report: " << rep.describe() << "\n"
                << "recorded events: " << rec.size() << " (" << rec.dropped() << " dropped)\n";
      if (auto csv = args.csv()) {
        std::ofstream out(*csv);
        t.write_csv(out);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "observe_bench: rank " << rank << ": " << e.what() << "\n";
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}
