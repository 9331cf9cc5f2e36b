// Buffer synchronisation: 200 small BatchNorm-like buffers (64 to 2048 floats), synced with one
// collective per buffer versus coalesced by BufferReducer (one collective per group), over MPI.
//
//   mpiexec -n 2 buffer_sync_bench [--iters N] [--warmup N] [--buffers N] [--csv FILE]
//
// Each mode is timed over `iters` syncs after `warmup`, the modes taking turns sync by sync; a
// sync's time is the slowest rank's (ranks start together after a barrier). The table reports
// the best, median and mean sync, and the speed-up of each mode's median over the two per-buffer
// modes with the same strategy.
//
// Modes, all through BufferReducer so they do the same work apart from coalescing:
// - per-buffer, one at a time: every buffer has its own custom strategy (one group each) that
//   issues the built-in strategy's collective on that buffer alone and waits for it: 200
//   collectives per sync, one after the other (a naive per-buffer hook loop);
// - per-buffer, in flight: the same 200 collectives, all issued before any is waited for
//   (PyTorch's per-buffer hook path at its best);
// - coalesced, copy path: buffers owned by the trainer (`add`): pack, one collective, unpack;
// - coalesced, view path: buffers living in the reducer's storage (`emplace`): one collective.

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <ddp/buffer_reducer.hpp>
#include <ddp/mpi.hpp>
#include <ddp/strategies/allreduce.hpp>
#include <ddp/strategies/broadcast.hpp>
#include <ddp/strategies/custom.hpp>

namespace {

struct config {
  int iters = 200;
  int warmup = 20;
  std::size_t buffers = 200;
  std::string csv;
};

config parse(int argc, char** argv) {
  config c;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--iters") {
      c.iters = std::max(1, std::atoi(next().c_str()));
    } else if (a == "--warmup") {
      c.warmup = std::max(0, std::atoi(next().c_str()));
    } else if (a == "--buffers") {
      c.buffers = static_cast<std::size_t>(std::max(1, std::atoi(next().c_str())));
    } else if (a == "--csv") {
      c.csv = next();
    } else {
      std::fprintf(stderr, "usage: %s [--iters N] [--warmup N] [--buffers N] [--csv FILE]\n", argv[0]);
      std::exit(2);
    }
  }
  return c;
}

/// BatchNorm-like sizes: channel counts of a ResNet, 64 to 2048, in a fixed mixed order.
std::vector<std::size_t> buffer_sizes(std::size_t n) {
  const std::size_t channels[] = {64, 256, 128, 512, 256, 1024, 512, 2048, 64, 128};
  std::vector<std::size_t> sizes(n);
  for (std::size_t k = 0; k < n; ++k) sizes[k] = channels[(k * 7 + k / 10) % 10];
  return sizes;
}

enum class kind { mean, broadcast };
enum class mode { one_at_a_time, in_flight, copy_path, view_path };

const char* name_of(kind k) { return k == kind::mean ? "allreduce_mean" : "broadcast"; }
const char* name_of(mode m) {
  switch (m) {
    case mode::one_at_a_time: return "per-buffer, one at a time";
    case mode::in_flight: return "per-buffer, in flight";
    case mode::copy_path: return "coalesced, copy path";
    case mode::view_path: return "coalesced, view path";
  }
  return "?";
}

struct row {
  kind k;
  mode m;
  std::size_t collectives = 0;
  double min_us = 0;  ///< best sync: the cost without interference from other processes
  double median_us = 0;
  double mean_us = 0;
  double vs_one_at_a_time = 1;  ///< median of per-buffer one at a time / this median
  double vs_in_flight = 1;      ///< median of per-buffer in flight / this median
};

/// The built-in strategy's collective on one buffer.
ddp::work one_collective(kind k, std::span<const ddp::tensor_view> b, ddp::communicator_ref c) {
  return k == kind::mean ? c.allreduce(b, ddp::reduce_op::avg) : c.broadcast(b, 0);
}

/// One mode of one strategy: its reducer, the trainer's buffers, and its measured times. Kept
/// behind a pointer: the reducer refers to the buffers by address.
struct bench_case {
  kind k;
  mode m;
  std::vector<std::vector<float>> owned;
  ddp::BufferReducer<ddp::strategies::any> reducer;
  std::vector<double> times;

  bench_case(ddp::mpi::communicator& comm, const std::vector<std::size_t>& sizes, kind k_, mode m_)
      : k(k_),
        m(m_),
        owned(sizes.size()),
        reducer(comm, k_ == kind::mean ? ddp::strategies::any(ddp::strategies::allreduce_mean{})
                                       : ddp::strategies::any(ddp::strategies::broadcast{})) {
    namespace st = ddp::strategies;
    std::vector<ddp::buffer_handle<float>> handles;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      switch (m) {
        case mode::one_at_a_time:
          owned[i].assign(sizes[i], 1.0f);
          // A separate custom object per buffer: never equal, so one group (one collective) each.
          reducer.add(owned[i], st::custom([k = k](std::span<const ddp::tensor_view> b, ddp::communicator_ref c) {
                        one_collective(k, b, c).wait();
                        return ddp::work::ready();
                      }));
          break;
        case mode::in_flight:
          owned[i].assign(sizes[i], 1.0f);
          reducer.add(owned[i], st::custom([k = k](std::span<const ddp::tensor_view> b, ddp::communicator_ref c) {
                        return one_collective(k, b, c);
                      }));
          break;
        case mode::copy_path:
          owned[i].assign(sizes[i], 1.0f);
          reducer.add(owned[i]);
          break;
        case mode::view_path: handles.push_back(reducer.emplace<float>(sizes[i])); break;
      }
    }
    reducer.build();
    for (auto h : handles) std::fill(reducer.span(h).begin(), reducer.span(h).end(), 1.0f);
  }

  /// One sync; keeps the slowest rank's time.
  void time_one_sync(bool keep) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = std::chrono::steady_clock::now();
    reducer.sync();
    const double mine = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    double slowest = 0;
    MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (keep) times.push_back(slowest);
  }

  [[nodiscard]] row result() const {
    row r{k, m};
    r.collectives = reducer.stats().collectives_per_sync;
    double sum = 0;
    for (double t : times) sum += t;
    r.mean_us = sum / static_cast<double>(times.size());
    std::vector<double> sorted = times;
    std::sort(sorted.begin(), sorted.end());
    r.median_us = sorted[sorted.size() / 2];
    r.min_us = sorted.front();
    return r;
  }
};

}  // namespace

int main(int argc, char** argv) {
  ddp::mpi::environment env(&argc, &argv);
  int rc = 0;
  {
    const config cfg = parse(argc, argv);
    auto comm = ddp::mpi::communicator::world();
    const std::vector<std::size_t> sizes = buffer_sizes(cfg.buffers);
    std::size_t floats = 0;
    for (std::size_t s : sizes) floats += s;

    // Modes take turns, one sync each, so that load from other processes on the machine falls
    // on all of them alike.
    std::vector<std::unique_ptr<bench_case>> cases;
    for (kind k : {kind::mean, kind::broadcast}) {
      for (mode m : {mode::one_at_a_time, mode::in_flight, mode::copy_path, mode::view_path}) {
        cases.push_back(std::make_unique<bench_case>(comm, sizes, k, m));
      }
    }
    for (int it = -cfg.warmup; it < cfg.iters; ++it) {
      for (auto& c : cases) c->time_one_sync(it >= 0);
    }
    std::vector<row> rows;
    for (const auto& c : cases) rows.push_back(c->result());
    for (std::size_t first = 0; first < rows.size(); first += 4) {
      for (std::size_t i = first; i < first + 4; ++i) {
        rows[i].vs_one_at_a_time = rows[first].median_us / rows[i].median_us;
        rows[i].vs_in_flight = rows[first + 1].median_us / rows[i].median_us;
      }
    }

    if (comm.rank() == 0) {
      std::printf("buffer sync: %zu buffers of 64..2048 f32 (%zu floats, %.0f KiB), %d ranks, %d syncs per mode\n\n",
                  sizes.size(), floats, static_cast<double>(floats) * 4 / 1024, comm.size(), cfg.iters);
      std::printf("%-15s %-26s %11s %9s %12s %10s %16s %12s\n", "strategy", "mode", "collectives", "min [us]",
                  "median [us]", "mean [us]", "x one at a time", "x in flight");
      for (const row& r : rows) {
        std::printf("%-15s %-26s %11zu %9.1f %12.1f %10.1f %15.1fx %11.1fx\n", name_of(r.k), name_of(r.m),
                    r.collectives, r.min_us, r.median_us, r.mean_us, r.vs_one_at_a_time, r.vs_in_flight);
      }
      if (!cfg.csv.empty()) {
        std::ofstream out(cfg.csv);
        out << "strategy,mode,ranks,buffers,floats,collectives_per_sync,min_us,median_us,mean_us,"
               "speedup_vs_one_at_a_time,speedup_vs_in_flight\n";
        for (const row& r : rows) {
          out << name_of(r.k) << ",\"" << name_of(r.m) << "\"," << comm.size() << ',' << sizes.size() << ',' << floats
              << ',' << r.collectives << ',' << r.min_us << ',' << r.median_us << ',' << r.mean_us << ','
              << r.vs_one_at_a_time << ',' << r.vs_in_flight << '\n';
        }
        if (!out) {
          std::fprintf(stderr, "cannot write %s\n", cfg.csv.c_str());
          rc = 1;
        }
      }
    }
  }
  return rc;
}
