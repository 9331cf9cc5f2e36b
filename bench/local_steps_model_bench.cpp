// When to use which (include/ddp/local_steps/cost_model.hpp): what synchronous data parallelism,
// DiLoCo and Streaming DiLoCo cost per inner step in communication, for a few model sizes and
// link rates. A model, not a measurement: it runs on one process and prints two tables.
//
//   local_steps_model_bench [--replicas 4] [--latency-ms 1] [--sync-every 100] [--fragments 4]
//                           [--delay 5] [--overlap 0.6] [--step-s 1] [--csv FILE]
//
// Every model takes --step-s seconds of compute per inner step (a replica sized to its model:
// more GPUs for a larger one); with the same hardware for every size, compute and bytes would
// both grow with the parameter count and the sizes would give the same shares, apart from
// latency. The first table is bytes each rank sends,
// per parameter (any model size: multiply); the second the share of each step spent computing,
// per mode, and the fastest mode on time alone (convergence is not in the model:
// docs/local-steps.md#when-to-use-which). --csv writes every field of every case.
#include <cstddef>
#include <cstdint>
#include <exception>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <ddp/local_steps/cost_model.hpp>

#include "common/cli.hpp"
#include "common/table.hpp"

namespace {

using ddp::outer_wire;
using ddp::sync_mode;

struct model_size {
  const char* name;
  double parameters;
  std::size_t tensors;  // about 12 per transformer layer
};

struct column {
  const char* label;
  ddp::sync_plan plan;
};

std::string fixed(double v, int digits) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(digits) << v;
  return os.str();
}

std::string rate(double gbit) { return gbit < 1 ? fixed(gbit * 1000, 0) + " Mbit/s" : fixed(gbit, 0) + " Gbit/s"; }

int run(const bench::cli& args) {
  const int replicas = static_cast<int>(args.int_or("--replicas", 4));
  const double latency_ms = args.double_or("--latency-ms", 1.0);
  const int h = static_cast<int>(args.int_or("--sync-every", 100));
  const int f = static_cast<int>(args.int_or("--fragments", 4));
  const int tau = static_cast<int>(args.int_or("--delay", 5));
  const double overlap = args.double_or("--overlap", 0.6);
  const double step_s = args.double_or("--step-s", 1.0);

  const std::vector<model_size> models{{"125M", 125e6, 150}, {"1B", 1e9, 200}, {"7B", 7e9, 300}};
  const std::vector<std::pair<const char*, int>> dtypes{{"f32", 4}, {"bf16", 2}};
  const std::vector<double> links_gbit{0.1, 1, 10, 100};
  // LocalSGD costs what DiLoCo's native wire does (the same bytes): one column for both.
  const std::vector<column> columns{
      {"dp", {.mode = sync_mode::data_parallel}},
      {"dp bf16", {.mode = sync_mode::data_parallel, .wire = outer_wire::bf16}},
      {"dp overlap", {.mode = sync_mode::data_parallel, .overlap = overlap}},
      {"diloco", {.mode = sync_mode::diloco, .sync_every = h}},
      {"diloco bf16", {.mode = sync_mode::diloco, .sync_every = h, .wire = outer_wire::bf16}},
      {"diloco int8", {.mode = sync_mode::diloco, .sync_every = h, .wire = outer_wire::int8}},
      {"streaming", {.mode = sync_mode::streaming_diloco, .sync_every = h, .fragments = f, .delay = tau}},
      {"streaming bf16",
       {.mode = sync_mode::streaming_diloco, .sync_every = h, .wire = outer_wire::bf16, .fragments = f, .delay = tau}},
  };

  std::cout << "# " << replicas << " replicas, link latency " << fixed(latency_ms, 2) << " ms; H = " << h
            << ", streaming F = " << f << ", tau = " << tau << "; dp overlap = " << fixed(overlap, 2) << " of compute; "
            << fixed(step_s, 2) << " s of compute per inner step\n";
  for (const auto& c : columns) {
    std::cout << "#   " << c.label << ": " << ddp::describe(c.plan)
              << (c.plan.overlap > 0 ? ", overlap " + fixed(c.plan.overlap, 2) : std::string()) << "\n";
  }

  // Bytes per parameter: the same for every model size and link (1B parameters in 200 tensors).
  bench::table bytes(
      {{"mode"}, {"f32 B/param/step", 4}, {"f32 peak B/param", 3}, {"bf16 B/param/step", 4}, {"bf16 peak B/param", 3}});
  for (const auto& c : columns) {
    std::vector<bench::cell> row{std::string(c.label)};
    for (const auto& [dname, dbytes] : dtypes) {
      const ddp::training_setup s{
          .parameters = 1e9, .dtype_bytes = dbytes, .tensors = 200, .replicas = replicas, .compute_s = 1};
      const auto cost = ddp::cost_of(s, c.plan);
      row.emplace_back(cost.bytes_per_step / s.parameters);
      row.emplace_back(cost.peak_bytes / s.parameters);
    }
    bytes.add(std::move(row));
  }
  std::cout << "\n# bytes each rank sends, per parameter: per inner step (amortised), and in one exchange\n";
  bytes.print(std::cout);

  std::vector<bench::table::column> grid_columns{{"model"}, {"dtype"}, {"link"}};
  for (const auto& c : columns) grid_columns.push_back({c.label, 1});
  grid_columns.push_back({"fastest"});
  bench::table grid(grid_columns);
  bench::table all({{"model"},
                    {"dtype"},
                    {"link Gbit/s", 1},
                    {"mode"},
                    {"collective"},
                    {"compute s", 4},
                    {"exchange s", 4},
                    {"comm s/step", 5},
                    {"exposed s/step", 5},
                    {"bytes/step", 0},
                    {"peak bytes", 0},
                    {"step s", 4},
                    {"utilisation", 4}});
  for (const auto& m : models) {
    for (const auto& [dname, dbytes] : dtypes) {
      for (const double gbit : links_gbit) {
        const ddp::training_setup s{.parameters = m.parameters,
                                    .dtype_bytes = dbytes,
                                    .tensors = m.tensors,
                                    .replicas = replicas,
                                    .compute_s = step_s,
                                    .link = ddp::gbit_link(gbit, latency_ms)};
        std::vector<bench::cell> row{std::string(m.name), std::string(dname), rate(gbit)};
        std::size_t fastest = 0;  // ties go to the earlier column, as in ddp::rank_modes
        double fastest_s = 0;
        for (std::size_t i = 0; i < columns.size(); ++i) {
          const auto cost = ddp::cost_of(s, columns[i].plan);
          row.emplace_back(100 * cost.utilisation);
          if (i == 0 || cost.effective_step_s < fastest_s) {
            fastest = i;
            fastest_s = cost.effective_step_s;
          }
          all.add({std::string(m.name), std::string(dname), gbit, ddp::describe(columns[i].plan),
                   std::string(cost.collective), s.compute_s, cost.exchange_s, cost.comm_s, cost.exposed_s,
                   cost.bytes_per_step, cost.peak_bytes, cost.step_s, cost.utilisation});
        }
        row.emplace_back(std::string(columns[fastest].label));
        grid.add(std::move(row));
      }
    }
  }
  std::cout << "\n# % of each inner step spent computing (compute / (compute + exposed communication))\n";
  grid.print(std::cout);
  if (const auto csv = args.csv()) all.write_csv(*csv);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const bench::cli args(argc, argv, "local_steps_model_bench: the local-steps cost model's table",
                          {{"--replicas", "N", "ranks that synchronise, one per site (4)"},
                           {"--latency-ms", "MS", "one-way link latency (1)"},
                           {"--sync-every", "H", "inner steps per outer step (100)"},
                           {"--fragments", "F", "Streaming DiLoCo fragments (4)"},
                           {"--delay", "TAU", "Streaming DiLoCo overlap, in inner steps (5)"},
                           {"--overlap", "X", "share of compute the 'dp overlap' allreduce hides under (0.6)"},
                           {"--step-s", "S", "seconds of compute per inner step, every model (1)"}});
    if (args.help_requested()) {
      args.print_help(std::cout);
      return 0;
    }
    return run(args);
  } catch (const std::exception& e) {
    std::cerr << "local_steps_model_bench: " << e.what() << "\n";
    return 2;
  }
}
