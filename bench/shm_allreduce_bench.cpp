// The shared-memory allreduce (ddp::shm) against MPI on one node, in one run.
//
// Part 1, bandwidth against message size (f32, sum, in place). Per size, every repetition runs
// each variant once, in rotating order, so machine noise hits all alike; the table reports the
// median over repetitions of the slowest rank's time per call:
//   mpi      MPI_Allreduce(MPI_IN_PLACE, ...) on a duplicate of MPI_COMM_WORLD (the reference)
//   ddp      ddp::mpi::communicator::allreduce(...).wait()
//   shm      ddp::shm::mpi::world()  .allreduce(...).wait()   (buffer in private memory: staged)
//   shm-zc   the same, buffer allocated in the communicator's arena (zero-copy)
//   memcpy   memcpy of the same bytes on every rank at once: the physical reference
// Small sizes time a batch of calls per sample (so a sample lasts at least ~100 us).
//
// Part 2, gradient synchronisation of real models (shapes files: one parameter per line, name
// and shape, e.g. "conv1.weight 64x3x7x7"), f32, per iteration (all gradients marked ready in
// reverse order, then finalize), medians over interleaved repetitions:
//   flat-mpi      one MPI_Allreduce of all gradient bytes (the target's reference)
//   bkt-mpi       Bucketer<size_capped> over ddp::mpi::communicator (default hook)
//   bkt-shm       Bucketer<size_capped> over ddp::shm (default options and hook: copy path)
//   bkt-shm-avg   the same with zero_copy = true (gradients in bucket views; the default hook
//                 divides each bucket in place, then sums: ddp/average.hpp)
//   arena-shm     buckets of the same layout allocated in the shm arena (what the proposed
//                 Bucketer allocator hook gives): gradients written in place, allreduce(avg)
//   flat-shm      one shm allreduce of all gradient bytes
//
//   mpiexec -n 2 shm_allreduce_bench [--max-bytes 256MiB] [--reps 9] [--models DIR] [--csv out.csv]
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <ddp/bucketer.hpp>
#include <ddp/bucketing/size_capped.hpp>
#include <ddp/mpi.hpp>
#include <ddp/shm.hpp>
#include <ddp/shm/mpi.hpp>

#include "common/cli.hpp"
#include "common/stats.hpp"
#include "common/table.hpp"

namespace {

// ---- timing ---------------------------------------------------------------------------------------

// Seconds per call of `fn` (batch calls back to back), the slowest rank's.
double timed(MPI_Comm comm, int batch, const std::function<void()>& fn) {
  MPI_Barrier(comm);
  bench::stopwatch clock;
  for (int i = 0; i < batch; ++i) fn();
  const double mine = clock.seconds() / batch;
  double slowest = 0;
  MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, comm);
  return slowest;
}

// Runs every variant `reps` times, rotating the order each repetition; returns the medians.
std::vector<double> interleaved(MPI_Comm comm, int reps, int batch,
                                const std::vector<std::function<void()>>& variants) {
  std::vector<std::vector<double>> samples(variants.size());
  for (int r = 0; r < reps; ++r) {
    for (std::size_t k = 0; k < variants.size(); ++k) {
      const std::size_t v = (k + static_cast<std::size_t>(r)) % variants.size();
      samples[v].push_back(timed(comm, batch, variants[v]));
    }
  }
  std::vector<double> out;
  for (auto& s : samples) out.push_back(bench::median(s));
  return out;
}

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what); }

// ---- part 1: bandwidth against size ---------------------------------------------------------------

void bandwidth(const bench::cli& args, MPI_Comm raw) {
  const std::uint64_t min_bytes = std::max<std::uint64_t>(4, args.bytes_or("--min-bytes", 4));
  const std::uint64_t max_bytes = args.bytes_or("--max-bytes", std::uint64_t{256} << 20);
  const std::uint64_t factor = std::max<std::uint64_t>(2, args.bytes_or("--factor", 4));
  const int reps = static_cast<int>(args.int_or("--reps", 9));
  const std::size_t chunk = args.bytes_or("--chunk-bytes", std::size_t{256} << 10);
  const std::size_t max_elems = max_bytes / 4;

  auto mpi = ddp::mpi::communicator::world();
  auto shm = ddp::shm::mpi::world({.chunk_bytes = chunk, .arena_bytes = max_elems * 4});
  const int ranks = mpi.size();
  const bool root = mpi.rank() == 0;
  if (root) {
    std::cout << "# allreduce f32 sum in place, " << ranks << " ranks, shm segment " << shm.backing() << ", chunk "
              << bench::cli::format_bytes(shm.options().chunk_bytes) << ", " << reps
              << " interleaved repetitions, medians of the slowest rank\n";
  }

  std::vector<float> buf(max_elems);
  std::vector<float> dst(max_elems);
  ddp::shm::arena_block block = shm.allocate(max_elems * 4);
  auto* zc = reinterpret_cast<float*>(block.data());

  bench::table t({{"bytes"},
                  {"size"},
                  {"batch"},
                  {"mpi us", 2},
                  {"ddp us", 2},
                  {"shm us", 2},
                  {"shm-zc us", 2},
                  {"memcpy us", 2},
                  {"shm GB/s", 2},
                  {"mpi/shm", 2},
                  {"mpi/shm-zc", 2},
                  {"shm/memcpy", 2},
                  {"shm-zc/memcpy", 2}});
  for (std::uint64_t bytes = min_bytes; bytes <= max_bytes; bytes *= factor) {
    const std::size_t n = bytes / 4;
    std::span<float> b(buf.data(), n);
    std::span<float> z(zc, n);
    // Correctness first: every variant gives the same sums.
    auto check = [&](std::span<float> x, const char* who) {
      std::fill(x.begin(), x.end(), static_cast<float>(mpi.rank() + 1));
      const float want = static_cast<float>(ranks * (ranks + 1) / 2);
      if (std::string(who) == "mpi") {
        MPI_Allreduce(MPI_IN_PLACE, x.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM, raw);
      } else if (std::string(who) == "ddp") {
        mpi.allreduce(x, ddp::reduce_op::sum).wait();
      } else {
        shm.allreduce(x, ddp::reduce_op::sum).wait();
      }
      if (x.front() != want || x.back() != want) fail(std::string(who) + " allreduce gave a wrong sum");
    };
    check(b, "mpi");
    check(b, "ddp");
    check(b, "shm");
    check(z, "shm");
    // Zeros from here on: sums stay finite and normal however many calls run.
    std::fill(b.begin(), b.end(), 0.0f);
    std::fill(z.begin(), z.end(), 0.0f);
    const int batch = static_cast<int>(std::clamp<std::uint64_t>((std::uint64_t{1} << 20) / bytes, 1, 200));
    const std::vector<std::function<void()>> variants{
        [&] { MPI_Allreduce(MPI_IN_PLACE, b.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM, raw); },
        [&] { mpi.allreduce(b, ddp::reduce_op::sum).wait(); },
        [&] { shm.allreduce(b, ddp::reduce_op::sum).wait(); },
        [&] { shm.allreduce(z, ddp::reduce_op::sum).wait(); },
        [&] { std::memcpy(dst.data(), b.data(), bytes); },
    };
    const auto m = interleaved(raw, reps, batch, variants);
    const double us = 1e6;
    t.add({static_cast<std::int64_t>(bytes), bench::cli::format_bytes(bytes), std::int64_t{batch}, m[0] * us, m[1] * us,
           m[2] * us, m[3] * us, m[4] * us, static_cast<double>(bytes) / m[2] * 1e-9, m[0] / m[2], m[0] / m[3],
           m[2] / m[4], m[3] / m[4]});
    if (root) std::cerr << "  " << bench::cli::format_bytes(bytes) << " done\n";
  }
  if (root) {
    t.print(std::cout);
    if (auto csv = args.csv()) t.write_csv(*csv);
  }
}

// ---- part 2: model gradients through the Bucketer ---------------------------------------------------

std::vector<std::size_t> read_shapes(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail("cannot open shapes file " + path);
  std::vector<std::size_t> sizes;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string name;
    std::string shape;
    if (!(fields >> name >> shape)) continue;
    std::size_t n = 1;
    std::istringstream dims(shape);
    for (std::string d; std::getline(dims, d, 'x');) n *= std::stoull(d);
    sizes.push_back(n);
  }
  if (sizes.empty()) fail("no parameters in " + path);
  return sizes;
}

void model(const bench::cli& args, MPI_Comm raw, const std::string& name, const std::string& path, bench::table& t) {
  const auto sizes = read_shapes(path);
  std::size_t total = 0;
  for (std::size_t s : sizes) total += s;
  const int reps = static_cast<int>(args.int_or("--model-reps", 7));
  const std::size_t chunk = args.bytes_or("--chunk-bytes", std::size_t{256} << 10);

  auto mpi = ddp::mpi::communicator::world();
  // The arena holds one copy of the gradients, laid out in buckets (granule padding included).
  auto shm = ddp::shm::mpi::world({.chunk_bytes = chunk, .arena_bytes = total * 4 + sizes.size() * 512 + (1 << 20)});

  std::vector<std::vector<float>> grads;
  for (std::size_t s : sizes) grads.emplace_back(s, 1.0f);
  std::vector<float> flat(total, 0.0f);

  ddp::Bucketer<ddp::bucketing::size_capped> over_mpi(mpi);
  ddp::Bucketer<ddp::bucketing::size_capped> over_shm(shm);
  ddp::Bucketer<ddp::bucketing::size_capped> over_shm_avg(shm, {}, {.zero_copy = true});
  for (auto& g : grads) {
    over_mpi.add(g);
    over_shm.add(g);
    over_shm_avg.add(g);
  }
  over_mpi.build();
  over_shm.build();
  over_shm_avg.build();
  const std::size_t n = sizes.size();
  auto step = [n](auto& b) {
    for (std::size_t i = n; i-- > 0;) b.mark_ready(i);
    b.finalize();
  };

  // Buckets of the same layout in the arena (what a Bucketer allocator hook would produce).
  std::vector<ddp::gradient_info> infos;
  for (std::size_t i = 0; i < n; ++i) infos.push_back({i, sizes[i], ddp::dtype::f32, ddp::device::host()});
  const ddp::bucket_layout layout = ddp::bucketing::size_capped{}.layout(infos);
  ddp::shm::bucket_allocator allocate = shm.allocator();
  std::vector<std::shared_ptr<std::byte>> storage;
  std::vector<ddp::tensor_view> arena_buckets;
  for (const auto& members : layout.buckets) {
    std::size_t elems = 0;
    for (std::size_t g : members) elems += sizes[g];
    storage.push_back(allocate(elems * 4));
    arena_buckets.push_back({storage.back().get(), elems, ddp::dtype::f32, ddp::device::host()});
    auto x = arena_buckets.back().as<float>();
    std::fill(x.begin(), x.end(), 1.0f);
  }
  auto arena_step = [&] {
    for (auto& b : arena_buckets) shm.allreduce(b, ddp::reduce_op::avg).wait();
  };

  // Correctness: averages of ones are ones everywhere (flat sums of zeros stay zero).
  step(over_mpi);
  step(over_shm);
  step(over_shm_avg);
  arena_step();
  for (const auto& g : grads) {
    if (g.front() != 1.0f || g.back() != 1.0f) fail(name + ": Bucketer average is wrong");
  }
  for (auto& b : arena_buckets) {
    if (b.as<float>().front() != 1.0f) fail(name + ": arena bucket average is wrong");
  }

  const std::vector<std::function<void()>> variants{
      [&] { MPI_Allreduce(MPI_IN_PLACE, flat.data(), static_cast<int>(total), MPI_FLOAT, MPI_SUM, raw); },
      [&] { step(over_mpi); },
      [&] { step(over_shm); },
      [&] { step(over_shm_avg); },
      arena_step,
      [&] { shm.allreduce(flat, ddp::reduce_op::sum).wait(); },
  };
  const auto m = interleaved(raw, reps, 1, variants);
  const double ms = 1e3;
  t.add({name, static_cast<std::int64_t>(total), static_cast<std::int64_t>(total * 4 >> 20),
         static_cast<std::int64_t>(layout.buckets.size()), m[0] * ms, m[1] * ms, m[2] * ms, m[3] * ms, m[4] * ms,
         m[5] * ms, m[0] / m[2], m[0] / m[3], m[0] / m[4]});
}

int run(const bench::cli& args) {
  MPI_Comm raw = MPI_COMM_NULL;  // the raw MPI variants get their own duplicate, like ddp
  MPI_Comm_dup(MPI_COMM_WORLD, &raw);
  int rank = 0;
  int ranks = 1;
  MPI_Comm_rank(raw, &rank);
  MPI_Comm_size(raw, &ranks);
  if (!args.has("--skip-sizes")) bandwidth(args, raw);

  const std::string dir = args.string_or("--models", "/work/shared/data");
  if (!args.has("--skip-models")) {
    bench::table t({{"model"},
                    {"params"},
                    {"MiB"},
                    {"buckets"},
                    {"flat-mpi ms", 1},
                    {"bkt-mpi ms", 1},
                    {"bkt-shm ms", 1},
                    {"bkt-shm-avg ms", 1},
                    {"arena-shm ms", 1},
                    {"flat-shm ms", 1},
                    {"flat-mpi/bkt-shm", 2},
                    {"flat-mpi/bkt-shm-avg", 2},
                    {"flat-mpi/arena-shm", 2}});
    std::vector<std::pair<std::string, std::string>> models;
    if (args.has("--shapes")) {
      models.emplace_back("custom", *args.get("--shapes"));
    } else {
      models = {{"resnet50", dir + "/resnet50_shapes.txt"}, {"bert-base", dir + "/bert_base_shapes.txt"}};
    }
    for (const auto& [name, path] : models) {
      model(args, raw, name, path, t);
      if (rank == 0) std::cerr << "  " << name << " done\n";
    }
    if (rank == 0) {
      std::cout << "\n# gradient synchronisation per iteration, f32, " << ranks << " ranks, "
                << args.int_or("--model-reps", 7) << " interleaved repetitions, medians of the slowest rank\n";
      t.print(std::cout);
      if (auto csv = args.get("--models-csv")) t.write_csv(*csv);
    }
  }
  MPI_Comm_free(&raw);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ddp::mpi::environment env(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  try {
    const bench::cli args(argc, argv, "ddp::shm allreduce against MPI_Allreduce, ddp over MPI and memcpy",
                          {{"--min-bytes", "BYTES", "smallest message (default 4)"},
                           {"--max-bytes", "BYTES", "largest message (default 256MiB)"},
                           {"--factor", "N", "size step (default 4)"},
                           {"--reps", "N", "interleaved repetitions per size (default 9)"},
                           {"--chunk-bytes", "BYTES", "shm pipeline chunk (default 256KiB)"},
                           {"--skip-sizes", "", "skip the bandwidth table"},
                           {"--skip-models", "", "skip the model table"},
                           {"--models", "DIR", "directory of resnet50_shapes.txt and bert_base_shapes.txt"},
                           {"--shapes", "FILE", "one shapes file instead of the two models"},
                           {"--model-reps", "N", "interleaved repetitions per model (default 7)"},
                           {"--models-csv", "FILE", "also write the model table as CSV to FILE"}});
    if (args.help_requested()) {
      if (rank == 0) args.print_help(std::cout);
      return 0;
    }
    return run(args);
  } catch (const std::exception& e) {
    std::cerr << "shm_allreduce_bench: rank " << rank << ": " << e.what() << '\n';
    MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
}
