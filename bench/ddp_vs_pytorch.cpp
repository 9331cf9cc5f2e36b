// ddp side of the side-by-side benchmark against PyTorch DDP (docs/benchmarks.md), plus the
// bucket-size sweep and an allreduce bandwidth sweep. Run it on 2 MPI ranks:
//
//   mpiexec -n 2 ddp_vs_pytorch sync    --shapes resnet50.txt [--iters 20] [--warmup 3]
//   mpiexec -n 2 ddp_vs_pytorch join    [--iters 200] [--rounds 10]
//   mpiexec -n 2 ddp_vs_pytorch buffers --shapes resnet50.txt [--iters 200]
//   mpiexec -n 2 ddp_vs_pytorch sweep   --shapes resnet50.txt [--caps 1,2,5,10,25,50,100]
//   mpiexec -n 2 ddp_vs_pytorch breakdown --shapes resnet50.txt [--iters 15]
//   mpiexec -n 2 ddp_vs_pytorch busbw   [--max-bytes 268435456]
//
// Every mode prints a table on rank 0; `--csv FILE` writes the same numbers as CSV, and
// `--json FILE` writes the raw per-iteration samples (what bench/compare_pytorch.sh combines with
// the PyTorch worker's). Every sample is the slowest rank's time for that iteration (one MAX
// allreduce after the timed loop); each timed iteration starts after an untimed MPI_Barrier.
//
// The methods mirror bench/pytorch/ddp_worker.py:
// - sync: a Bucketer<size_capped> with the defaults (25 MiB buckets, 1 MiB small bucket first)
//   over every parameter of the shapes file; one iteration marks every gradient ready in reverse
//   registration order, then finalize(), over ddp::mpi::communicator. Interleaved with: the same
//   with zero_copy; the README's path (the same Bucketer over ddp::world(env): shared memory, the
//   direct path), and with bucket copies; contiguous gradients (one allocation) over both; a flat
//   allreduce through ddp::world(env); one memcpy of the same bytes; PyTorch's
//   method mirrored (a zero-filling "backward" with and without mark_ready after each gradient);
//   one allreduce of a flat buffer of the same bytes through ddp::mpi::communicator; one raw
//   in-place MPI_Allreduce.
// - join: blocks of --iters Bucketer steps of a small model (256x256 + 256 floats), alternately
//   bare and with JoinContext::notify() before each step; finish() is timed apart.
// - buffers: BufferReducer<broadcast> over a running mean and variance per normalisation layer of
//   the shapes file (1-D "*.weight" parameters), copy path (trainer-owned vectors) and view path
//   (emplaced): the time of one sync().
// - sweep: one Bucketer per cap (small bucket 1 MiB, first), interleaved per iteration.
// - breakdown: where a Bucketer step's time goes: the flat allreduce, the layout's allreduces
//   alone, the Bucketer zero-copy with a hook that does not divide, with the default hook, with
//   copies; one memcpy and one division of all gradient bytes for scale.
// - busbw: allreduce of 4 B .. --max-bytes, ddp::mpi::communicator vs MPI_Allreduce; bus
//   bandwidth = bytes * 2 (n - 1) / n / time.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ddp/buffer_reducer.hpp>
#include <ddp/ddp.hpp>
#include <ddp/mpi.hpp>
#include <ddp/shm/mpi.hpp>

namespace {

using ms = std::chrono::duration<double, std::milli>;

// ---- command line -------------------------------------------------------------------------------

struct arguments {
  std::string mode;
  std::string shapes;
  std::string model;  // label for tables; default: the shapes file's stem
  int iters = -1;
  int warmup = 3;
  int rounds = 10;
  std::vector<double> caps_mib{1, 2, 5, 10, 25, 50, 100};
  std::size_t max_bytes = std::size_t{256} << 20;
  std::string csv;
  std::string json;
};

[[noreturn]] void usage(const std::string& why) {
  throw std::invalid_argument(
      why +
      "\nusage: ddp_vs_pytorch sync|join|buffers|sweep|breakdown|busbw [--shapes FILE] [--model NAME] "
      "[--iters N] [--warmup N] [--rounds N] [--caps MiB,MiB,...] [--max-bytes N] "
      "[--csv FILE] [--json FILE]");
}

arguments parse(int argc, char** argv) {
  arguments a;
  if (argc < 2) usage("no mode given");
  a.mode = argv[1];
  for (int i = 2; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) usage("missing value after " + k);
    const std::string v = argv[++i];
    if (k == "--shapes") {
      a.shapes = v;
    } else if (k == "--model") {
      a.model = v;
    } else if (k == "--iters") {
      a.iters = std::stoi(v);
    } else if (k == "--warmup") {
      a.warmup = std::stoi(v);
    } else if (k == "--rounds") {
      a.rounds = std::stoi(v);
    } else if (k == "--caps") {
      a.caps_mib.clear();
      std::stringstream ss(v);
      for (std::string item; std::getline(ss, item, ',');) a.caps_mib.push_back(std::stod(item));
    } else if (k == "--max-bytes") {
      a.max_bytes = static_cast<std::size_t>(std::stoull(v));
    } else if (k == "--csv") {
      a.csv = v;
    } else if (k == "--json") {
      a.json = v;
    } else {
      usage("unknown option " + k);
    }
  }
  if (a.model.empty() && !a.shapes.empty()) {
    std::string stem = a.shapes.substr(a.shapes.find_last_of('/') + 1);
    a.model = stem.substr(0, stem.find('.'));
  }
  return a;
}

// ---- the model: one parameter per line of a shapes file -------------------------------------------

struct parameter_shape {
  std::string name;
  std::size_t count = 0;
  std::size_t dims = 0;
};

std::vector<parameter_shape> read_shapes(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open shapes file " + path);
  std::vector<parameter_shape> out;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    parameter_shape p;
    std::string dims;
    ls >> p.name >> dims;
    if (dims.empty()) throw std::runtime_error("bad line in " + path + ": " + line);
    p.count = 1;
    std::stringstream ds(dims);
    for (std::string d; std::getline(ds, d, 'x');) {
      p.count *= static_cast<std::size_t>(std::stoull(d));
      ++p.dims;
    }
    out.push_back(p);
  }
  if (out.empty()) throw std::runtime_error("no parameters in " + path);
  return out;
}

std::vector<parameter_shape> small_model() { return {{"small.weight", 256 * 256, 2}, {"small.bias", 256, 1}}; }

// Lengths of the normalisation layers: 1-D parameters whose name ends in ".weight".
std::vector<std::size_t> norm_layers(const std::vector<parameter_shape>& shapes) {
  std::vector<std::size_t> out;
  const std::string suffix = ".weight";
  for (const auto& p : shapes) {
    if (p.dims == 1 && p.name.size() > suffix.size() &&
        p.name.compare(p.name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      out.push_back(p.count);
    }
  }
  return out;
}

std::size_t total_elements(const std::vector<parameter_shape>& shapes) {
  std::size_t n = 0;
  for (const auto& p : shapes) n += p.count;
  return n;
}

struct model {
  std::vector<std::vector<float>> params, grads;
  explicit model(const std::vector<parameter_shape>& shapes) {
    for (const auto& p : shapes) {
      params.emplace_back(p.count, 0.0f);
      grads.emplace_back(p.count, 0.0f);
    }
  }
  template <class B>
  void register_with(B& bucketer) {
    for (std::size_t i = 0; i < params.size(); ++i) bucketer.add(params[i], grads[i]);
  }
};

// ---- measurement --------------------------------------------------------------------------------

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

// Untimed barrier, then the time of fn() in milliseconds.
template <class F>
double timed(F&& fn) {
  MPI_Barrier(MPI_COMM_WORLD);
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return ms(std::chrono::steady_clock::now() - t0).count();
}

// Per-iteration maximum over ranks.
std::vector<double> slowest_rank(std::vector<double> v) {
  MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return v;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct results {
  std::map<std::string, std::vector<double>> samples;  // name -> per-iteration ms
  std::vector<std::pair<std::string, std::string>> info;

  void add(const std::string& name, std::vector<double> v) { samples[name] = slowest_rank(std::move(v)); }
  void note(const std::string& k, const std::string& v) { info.emplace_back(k, v); }
  void note(const std::string& k, std::size_t v) { info.emplace_back(k, std::to_string(v)); }
};

// ---- output: an aligned table, the same as CSV, and the raw samples as JSON -----------------------

struct table {
  std::string title;
  std::vector<std::string> header;
  std::vector<std::vector<std::string>> rows;

  void print(std::ostream& os) const {
    std::vector<std::size_t> w(header.size());
    for (std::size_t c = 0; c < header.size(); ++c) w[c] = header[c].size();
    for (const auto& r : rows) {
      for (std::size_t c = 0; c < r.size() && c < w.size(); ++c) w[c] = std::max(w[c], r[c].size());
    }
    os << "\n" << title << "\n";
    auto line = [&](const std::vector<std::string>& cells) {
      std::ostringstream ls;
      for (std::size_t c = 0; c < w.size(); ++c) {
        const std::string cell = c < cells.size() ? cells[c] : "";
        ls << (c ? "  " : "") << std::setw(static_cast<int>(w[c])) << std::left << cell;
      }
      std::string text = ls.str();
      text.erase(text.find_last_not_of(' ') + 1);
      os << text << "\n";
    };
    line(header);
    std::vector<std::string> rule;
    for (std::size_t c = 0; c < w.size(); ++c) rule.push_back(std::string(w[c], '-'));
    line(rule);
    for (const auto& r : rows) line(r);
  }

  static std::string csv_cell(const std::string& s) {
    if (s.find_first_of(",\"\n") == std::string::npos) return s;
    std::string q = "\"";
    for (char ch : s) q += ch == '"' ? std::string("\"\"") : std::string(1, ch);
    return q + "\"";
  }

  void write_csv(const std::string& path) const {
    std::ofstream out(path);
    if (!out) throw std::runtime_error("cannot write " + path);
    for (std::size_t c = 0; c < header.size(); ++c) out << (c ? "," : "") << csv_cell(header[c]);
    out << "\n";
    for (const auto& r : rows) {
      for (std::size_t c = 0; c < r.size(); ++c) out << (c ? "," : "") << csv_cell(r[c]);
      out << "\n";
    }
  }
};

std::string fixed(double v, int digits = 3) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(digits) << v;
  return os.str();
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') out += '\\';
    out += ch;
  }
  return out + "\"";
}

void write_json(const std::string& path, const std::string& mode, const std::string& model, const results& r) {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write " + path);
  out << std::setprecision(9) << "{\"case\": " << json_string(mode) << ", \"model\": " << json_string(model)
      << ", \"world\": " << world_size() << ", \"samples\": {";
  bool first = true;
  for (const auto& [name, v] : r.samples) {
    out << (first ? "" : ", ") << json_string(name) << ": [";
    for (std::size_t i = 0; i < v.size(); ++i) out << (i ? ", " : "") << v[i];
    out << "]";
    first = false;
  }
  out << "}, \"info\": {";
  first = true;
  for (const auto& [k, v] : r.info) {
    out << (first ? "" : ", ") << json_string(k) << ": " << json_string(v);
    first = false;
  }
  out << "}}\n";
}

// A table of the samples: median, min, max, count per row, plus a note.
table summary(const std::string& title, const std::string& model, const results& r,
              const std::map<std::string, std::string>& notes = {}) {
  table t{title, {"model", "measured", "median_ms", "min_ms", "max_ms", "n", "note"}, {}};
  for (const auto& [name, v] : r.samples) {
    const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
    const auto note = notes.find(name);
    t.rows.push_back({model, name, fixed(median(v)), fixed(*lo), fixed(*hi), std::to_string(v.size()),
                      note == notes.end() ? "" : note->second});
  }
  return t;
}

// ---- the modes ----------------------------------------------------------------------------------

table run_sync(const arguments& a, const ddp::mpi::environment& env, ddp::mpi::communicator& comm, results& r) {
  const auto shapes = read_shapes(a.shapes);
  const int iters = a.iters > 0 ? a.iters : 20;
  model m(shapes);
  const std::size_t n = shapes.size();
  using bucketer_type = ddp::Bucketer<ddp::bucketing::size_capped>;
  // Registers the model's gradients with `b`, builds it, and returns one step: every gradient
  // marked ready in reverse registration order, then finalize().
  auto prepare = [&](bucketer_type& b) {
    m.register_with(b);
    b.build();
    return [&b, n] {
      for (std::size_t i = n; i-- > 0;) b.mark_ready(i);
      b.finalize();
    };
  };
  bucketer_type grads(comm);  // defaults: 25 MiB cap, 1 MiB small bucket first
  auto step = prepare(grads);
  // Zero-copy (PyTorch's gradient_as_bucket_view): gradients live in the buckets, no copies.
  bucketer_type in_place(comm, {}, {.zero_copy = true});
  auto step_in_place = prepare(in_place);
  // The README's path: ddp::world(env) (shared memory inside the node) and a Bucketer with its
  // defaults, which hands the gradients to the shared-memory allreduce directly (no bucket copies,
  // averaging in its kernel). And the same communicator with bucket copies, for comparison.
  auto shm = ddp::world(env);
  bucketer_type over_shm(shm);
  auto step_shm = prepare(over_shm);
  if (!over_shm.direct()) {
    throw std::runtime_error("the default Bucketer over ddp::world() did not take the direct path");
  }
  bucketer_type shm_copies(shm, {}, {.direct_when_staged = false});
  auto step_shm_copies = prepare(shm_copies);
  // Contiguous gradients (llm.c's layout): every gradient a view of one allocation, in
  // registration order; over MPI (each bucket summed in place) and over ddp::world(env) (each
  // bucket one tensor of the direct call).
  std::vector<float> block(total_elements(shapes), 0.0f);
  auto prepare_contiguous = [&](bucketer_type& b) {
    for (std::size_t i = 0, at = 0; i < n; at += m.grads[i].size(), ++i) {
      b.add(m.params[i], ddp::tensor_view{block.data() + at, m.grads[i].size(), ddp::dtype::f32, ddp::device::host()});
    }
    b.build();
    return [&b, n] {
      for (std::size_t i = n; i-- > 0;) b.mark_ready(i);
      b.finalize();
    };
  };
  bucketer_type contiguous(comm);
  auto step_contiguous = prepare_contiguous(contiguous);
  bucketer_type contiguous_shm(shm);
  auto step_contiguous_shm = prepare_contiguous(contiguous_shm);
  // The PyTorch method, mirrored: a "backward" that writes every gradient (zeros) in reverse
  // registration order, with and without marking each ready as soon as it is written.
  auto fill = [&](std::size_t i) { std::fill(m.grads[i].begin(), m.grads[i].end(), 0.0f); };
  auto backward_only = [&] {
    for (std::size_t i = n; i-- > 0;) fill(i);
  };
  auto backward_synced = [&] {
    for (std::size_t i = n; i-- > 0;) {
      fill(i);
      grads.mark_ready(i);
    }
    grads.finalize();
  };
  std::vector<float> flat(total_elements(shapes), 0.0f);
  std::vector<float> flat_copy(flat.size(), 1.0f);
  // The physical limit here: one memcpy of the same bytes (every allreduce reads and writes them).
  auto copy_once = [&] { std::memcpy(flat_copy.data(), flat.data(), flat.size() * sizeof(float)); };
  auto ddp_flat = [&] { comm.allreduce(flat, ddp::reduce_op::sum).wait(); };
  auto shm_flat = [&] { shm.allreduce(flat, ddp::reduce_op::sum).wait(); };
  auto mpi_flat = [&] {
    MPI_Allreduce(MPI_IN_PLACE, flat.data(), static_cast<int>(flat.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  };
  for (int w = 0; w < a.warmup; ++w) {
    timed(step);
    timed(step_in_place);
    timed(step_shm);
    timed(step_shm_copies);
    timed(step_contiguous);
    timed(step_contiguous_shm);
    timed(shm_flat);
    timed(copy_once);
    timed(backward_only);
    timed(backward_synced);
    timed(ddp_flat);
    timed(mpi_flat);
  }
  std::vector<double> bucketer, marking, waiting, zero_copy, shm_bucketer, shm_bucketer_copies, contiguous_mpi,
      contiguous_world, flat_shm, memcpy_ms, plain_bw, synced_bw, flat_ddp, flat_mpi;
  for (int i = 0; i < iters; ++i) {
    bucketer.push_back(timed(step));
    marking.push_back(grads.last_step().backward_ms);
    waiting.push_back(grads.last_step().finalize_wait_ms);
    zero_copy.push_back(timed(step_in_place));
    shm_bucketer.push_back(timed(step_shm));
    shm_bucketer_copies.push_back(timed(step_shm_copies));
    contiguous_mpi.push_back(timed(step_contiguous));
    contiguous_world.push_back(timed(step_contiguous_shm));
    flat_shm.push_back(timed(shm_flat));
    memcpy_ms.push_back(timed(copy_once));
    plain_bw.push_back(timed(backward_only));
    synced_bw.push_back(timed(backward_synced));
    flat_ddp.push_back(timed(ddp_flat));
    flat_mpi.push_back(timed(mpi_flat));
  }
  r.add("ddp_bucketer", bucketer);
  r.add("ddp_bucketer_marking", marking);
  r.add("ddp_bucketer_finalize", waiting);
  r.add("ddp_bucketer_zero_copy", zero_copy);
  r.add("ddp_shm_bucketer", shm_bucketer);
  r.add("ddp_shm_bucketer_copies", shm_bucketer_copies);
  r.add("ddp_contiguous_bucketer", contiguous_mpi);
  r.add("ddp_contiguous_shm_bucketer", contiguous_world);
  r.add("ddp_shm_flat_allreduce", flat_shm);
  r.add("memcpy", memcpy_ms);
  r.add("ddp_plain_backward", plain_bw);
  r.add("ddp_synced_backward", synced_bw);
  r.add("ddp_flat_allreduce", flat_ddp);
  r.add("mpi_flat_allreduce", flat_mpi);
  r.note("parameters", n);
  r.note("elements", flat.size());
  r.note("bytes", flat.size() * sizeof(float));
  r.note("buckets", grads.layout().size());
  std::size_t in_place_buckets = 0;
  for (const auto& b : contiguous.last_step().buckets) in_place_buckets += b.in_place ? 1 : 0;
  r.note("contiguous_in_place_buckets", in_place_buckets);
  const std::string buckets = std::to_string(grads.layout().size()) + " buckets, size_capped{25 MiB, 1 MiB first}";
  return summary("gradient synchronisation, " + std::to_string(n) + " parameters, " +
                     fixed(static_cast<double>(flat.size() * 4) / (1 << 20), 1) + " MiB",
                 a.model, r,
                 {{"ddp_bucketer", buckets},
                  {"ddp_bucketer_marking", "of which: first mark_ready to finalize() (copies in, launches)"},
                  {"ddp_bucketer_finalize", "of which: finalize() waiting for the buckets"},
                  {"ddp_bucketer_zero_copy", "bucketer_options{.zero_copy = true}: no copies in or out"},
                  {"ddp_shm_bucketer", "README path: Bucketer defaults over ddp::world(env) (direct, no copies)"},
                  {"ddp_shm_bucketer_copies", "the same with bucket copies (direct_when_staged = false)"},
                  {"ddp_contiguous_bucketer", "contiguous gradients (one allocation), MPI: " +
                                                  std::to_string(in_place_buckets) + " buckets summed in place"},
                  {"ddp_contiguous_shm_bucketer", "contiguous gradients over ddp::world(env): one tensor per bucket"},
                  {"ddp_shm_flat_allreduce", "one allreduce through ddp::world(env)"},
                  {"memcpy", "one memcpy of the same bytes (the physical limit)"},
                  {"ddp_plain_backward", "zero-fill every gradient, reverse order"},
                  {"ddp_synced_backward", "the same, mark_ready after each fill, then finalize()"},
                  {"ddp_flat_allreduce", "one allreduce through ddp::mpi::communicator"},
                  {"mpi_flat_allreduce", "one in-place MPI_Allreduce"}});
}

table run_join(const arguments& a, ddp::mpi::communicator& comm, results& r) {
  const auto shapes = small_model();
  const int iters = a.iters > 0 ? a.iters : 200;
  model m(shapes);
  ddp::Bucketer grads(comm);
  m.register_with(grads);
  grads.build();
  auto step = [&] {
    for (std::size_t i = shapes.size(); i-- > 0;) grads.mark_ready(i);
    grads.finalize();
  };
  for (int w = 0; w < a.warmup; ++w) step();
  std::vector<double> bare, joined, finish;
  for (int round = 0; round < a.rounds; ++round) {
    bare.push_back(timed([&] {
                     for (int i = 0; i < iters; ++i) step();
                   }) /
                   iters);
    MPI_Barrier(MPI_COMM_WORLD);
    ddp::JoinContext join({}, grads);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) {
      join.notify();
      step();
    }
    const auto t1 = std::chrono::steady_clock::now();
    join.finish();
    const auto t2 = std::chrono::steady_clock::now();
    joined.push_back(ms(t1 - t0).count() / iters);
    finish.push_back(ms(t2 - t1).count());
  }
  r.add("ddp_step_bare", bare);
  r.add("ddp_step_join", joined);
  r.add("ddp_join_finish", finish);
  r.note("elements", total_elements(shapes));
  r.note("iterations_per_block", static_cast<std::size_t>(iters));
  return summary("join: per-iteration time of a Bucketer step (small model, " + std::to_string(total_elements(shapes)) +
                     " floats), blocks of " + std::to_string(iters),
                 "small", r,
                 {{"ddp_step_bare", "no JoinContext"},
                  {"ddp_step_join", "JoinContext::notify() before each step"},
                  {"ddp_join_finish", "JoinContext::finish(): one round + parameter broadcast"}});
}

table run_buffers(const arguments& a, ddp::mpi::communicator& comm, results& r) {
  const auto layers = norm_layers(read_shapes(a.shapes));
  if (layers.empty()) throw std::runtime_error("no normalisation layers (1-D *.weight) in " + a.shapes);
  const int iters = a.iters > 0 ? a.iters : 200;
  std::vector<std::vector<float>> owned;  // trainer-owned buffers (copy path)
  for (std::size_t n : layers) {
    owned.emplace_back(n, 0.0f);  // running mean
    owned.emplace_back(n, 1.0f);  // running variance
  }
  ddp::BufferReducer copy_path(comm);  // default strategy: broadcast from rank 0
  for (auto& b : owned) copy_path.add(b);
  copy_path.build();
  ddp::BufferReducer view_path(comm);
  for (std::size_t n : layers) {
    (void)view_path.emplace<float>(n);
    (void)view_path.emplace<float>(n);
  }
  view_path.build();
  for (int w = 0; w < a.warmup; ++w) {
    timed([&] { copy_path.sync(); });
    timed([&] { view_path.sync(); });
  }
  std::vector<double> copy_ms, view_ms;
  for (int i = 0; i < iters; ++i) {
    copy_ms.push_back(timed([&] { copy_path.sync(); }));
    view_ms.push_back(timed([&] { view_path.sync(); }));
  }
  std::size_t elements = 0;
  for (const auto& b : owned) elements += b.size();
  r.add("ddp_buffers_broadcast_copy", copy_ms);
  r.add("ddp_buffers_broadcast_view", view_ms);
  r.note("buffers", owned.size());
  r.note("elements", elements);
  r.note("bytes", elements * sizeof(float));
  r.note("collectives_per_sync", copy_path.stats().collectives_per_sync);
  return summary("buffer sync: " + std::to_string(owned.size()) + " buffers (" +
                     fixed(static_cast<double>(elements * 4) / 1024, 1) + " KiB), BufferReducer<broadcast>, one sync",
                 a.model, r,
                 {{"ddp_buffers_broadcast_copy", "trainer-owned vectors: pack, broadcast, unpack"},
                  {"ddp_buffers_broadcast_view", "emplaced buffers: broadcast in place"}});
}

table run_sweep(const arguments& a, ddp::mpi::communicator& comm, results& r) {
  const auto shapes = read_shapes(a.shapes);
  const int iters = a.iters > 0 ? a.iters : 15;
  model m(shapes);
  std::vector<std::unique_ptr<ddp::Bucketer<ddp::bucketing::size_capped>>> bucketers;
  for (double cap : a.caps_mib) {
    ddp::bucketing::size_capped policy{.cap_bytes = static_cast<std::size_t>(cap * (1 << 20))};
    bucketers.push_back(std::make_unique<ddp::Bucketer<ddp::bucketing::size_capped>>(comm, policy));
    m.register_with(*bucketers.back());
    bucketers.back()->build();
  }
  const std::size_t n = shapes.size();
  auto step = [&](ddp::Bucketer<ddp::bucketing::size_capped>& b) {
    for (std::size_t i = n; i-- > 0;) b.mark_ready(i);
    b.finalize();
  };
  for (int w = 0; w < a.warmup; ++w) {
    for (auto& b : bucketers) timed([&] { step(*b); });
  }
  std::vector<std::vector<double>> samples(bucketers.size());
  for (int i = 0; i < iters; ++i) {
    for (std::size_t k = 0; k < bucketers.size(); ++k) samples[k].push_back(timed([&] { step(*bucketers[k]); }));
  }
  const double bytes = static_cast<double>(total_elements(shapes) * sizeof(float));
  table t{"bucket-size sweep: Bucketer<size_capped>, " + a.model + " (" + fixed(bytes / (1 << 20), 1) +
              " MiB), small bucket 1 MiB first",
          {"cap_MiB", "buckets", "median_ms", "min_ms", "max_ms", "n", "GB_per_s"},
          {}};
  for (std::size_t k = 0; k < bucketers.size(); ++k) {
    std::ostringstream name;
    name << "ddp_bucketer_cap_" << a.caps_mib[k] << "MiB";
    r.add(name.str(), samples[k]);
    const auto& v = r.samples[name.str()];
    const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
    const double med = median(v);
    std::ostringstream cap;
    cap << a.caps_mib[k];
    t.rows.push_back({cap.str(), std::to_string(bucketers[k]->layout().size()), fixed(med), fixed(*lo), fixed(*hi),
                      std::to_string(v.size()), fixed(bytes / (med * 1e-3) / 1e9, 2)});
    r.note(name.str() + "_buckets", bucketers[k]->layout().size());
  }
  return t;
}

// Where the Bucketer's time goes, each piece timed on its own, interleaved.
table run_breakdown(const arguments& a, ddp::mpi::communicator& comm, results& r) {
  const auto shapes = read_shapes(a.shapes);
  const int iters = a.iters > 0 ? a.iters : 15;
  const std::size_t n = shapes.size();
  model m(shapes);
  using bucketer = ddp::Bucketer<ddp::bucketing::size_capped>;
  auto make = [&](ddp::bucketer_options o) {
    auto b = std::make_unique<bucketer>(comm, ddp::bucketing::size_capped{}, o);
    m.register_with(*b);
    return b;
  };
  auto copying = make({});
  auto in_place = make({.zero_copy = true});
  auto no_divide = make({.zero_copy = true});
  no_divide->register_comm_hook([](ddp::grad_bucket& b) { return b.comm.allreduce(b.data, ddp::reduce_op::sum); });
  copying->build();
  in_place->build();
  no_divide->build();
  std::vector<std::vector<float>> buckets;  // the default layout's bucket sizes, as plain buffers
  for (const auto& members : copying->layout().buckets) {
    std::size_t count = 0;
    for (std::size_t i : members) count += shapes[i].count;
    buckets.emplace_back(count, 0.0f);
  }
  std::vector<float> flat(total_elements(shapes), 0.0f), other(flat.size(), 0.0f);
  auto step = [&](bucketer& b) {
    for (std::size_t i = n; i-- > 0;) b.mark_ready(i);
    b.finalize();
  };
  const std::vector<std::pair<std::string, std::function<void()>>> parts{
      {"flat_allreduce", [&] { comm.allreduce(flat, ddp::reduce_op::sum).wait(); }},
      {"bucket_allreduces_only",
       [&] {
         std::vector<ddp::work> w;
         for (auto& b : buckets) w.push_back(comm.allreduce(b, ddp::reduce_op::sum));
         for (auto& x : w) x.wait();
       }},
      {"bucketer_zero_copy_sum_only", [&] { step(*no_divide); }},
      {"bucketer_zero_copy", [&] { step(*in_place); }},
      {"bucketer", [&] { step(*copying); }},
      {"memcpy_all_gradients", [&] { std::memcpy(other.data(), flat.data(), flat.size() * sizeof(float)); }},
      {"divide_all_gradients", [&] { ddp::detail::divide_in_place(ddp::dtype::f32, flat.data(), flat.size(), 2); }},
  };
  std::vector<std::vector<double>> samples(parts.size());
  for (int w = 0; w < a.warmup; ++w) {
    for (const auto& p : parts) timed(p.second);
  }
  for (int i = 0; i < iters; ++i) {
    for (std::size_t k = 0; k < parts.size(); ++k) samples[k].push_back(timed(parts[k].second));
  }
  const std::map<std::string, std::string> what{
      {"flat_allreduce", "1 allreduce of all gradient bytes (ddp::mpi)"},
      {"bucket_allreduces_only", "the layout's allreduces, launched together, waited in order"},
      {"bucketer_zero_copy_sum_only", "+ Bucketer bookkeeping (zero-copy, hook without division)"},
      {"bucketer_zero_copy", "+ the division after the sum (default hook)"},
      {"bucketer", "+ copies in and out (default options)"},
      {"memcpy_all_gradients", "one memcpy of all gradient bytes"},
      {"divide_all_gradients", "one in-place division of all gradients"},
  };
  table t{"where the Bucketer's time goes: " + a.model + ", " + std::to_string(buckets.size()) + " buckets",
          {"step", "median_ms", "min_ms", "n", "what"},
          {}};
  for (std::size_t k = 0; k < parts.size(); ++k) {
    r.add(parts[k].first, samples[k]);
    const auto& v = r.samples[parts[k].first];
    t.rows.push_back({parts[k].first, fixed(median(v)), fixed(*std::min_element(v.begin(), v.end())),
                      std::to_string(v.size()), what.at(parts[k].first)});
  }
  r.note("buckets", buckets.size());
  return t;
}

table run_busbw(const arguments& a, ddp::mpi::communicator& comm, results& r) {
  const double size = world_size();
  table t{"allreduce bandwidth (float32, sum, in place)",
          {"bytes", "ddp_median_us", "ddp_busbw_GBps", "mpi_median_us", "mpi_busbw_GBps", "reps"},
          {}};
  const int samples_per_size = a.iters > 0 ? a.iters : 7;
  for (std::size_t bytes = 4; bytes <= a.max_bytes; bytes *= 4) {
    std::vector<float> buf(bytes / sizeof(float), 0.0f);
    // Repeat small messages inside one sample so the clock and barrier do not dominate.
    const int reps = static_cast<int>(std::clamp<std::size_t>((std::size_t{16} << 20) / bytes, 1, 1000));
    auto ddp_call = [&] {
      for (int k = 0; k < reps; ++k) comm.allreduce(buf, ddp::reduce_op::sum).wait();
    };
    auto mpi_call = [&] {
      for (int k = 0; k < reps; ++k) {
        MPI_Allreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(buf.size()), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      }
    };
    timed(ddp_call);
    timed(mpi_call);
    std::vector<double> d, m;
    for (int i = 0; i < samples_per_size; ++i) {
      d.push_back(timed(ddp_call) / reps);
      m.push_back(timed(mpi_call) / reps);
    }
    const std::string key = std::to_string(bytes);
    r.add("ddp_allreduce_" + key, d);
    r.add("mpi_allreduce_" + key, m);
    const double dm = median(r.samples["ddp_allreduce_" + key]);
    const double mm = median(r.samples["mpi_allreduce_" + key]);
    auto busbw = [&](double msec) { return static_cast<double>(bytes) * 2 * (size - 1) / size / (msec * 1e-3) / 1e9; };
    t.rows.push_back(
        {key, fixed(dm * 1e3, 2), fixed(busbw(dm), 3), fixed(mm * 1e3, 2), fixed(busbw(mm), 3), std::to_string(reps)});
  }
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  ddp::mpi::environment env(&argc, &argv);
  int rc = 0;
  try {
    const arguments a = parse(argc, argv);
    if ((a.mode == "sync" || a.mode == "buffers" || a.mode == "sweep" || a.mode == "breakdown") && a.shapes.empty()) {
      usage(a.mode + " needs --shapes FILE");
    }
    auto comm = ddp::mpi::communicator::world();
    results r;
    table t;
    if (a.mode == "sync") {
      t = run_sync(a, env, comm, r);
    } else if (a.mode == "join") {
      t = run_join(a, comm, r);
    } else if (a.mode == "buffers") {
      t = run_buffers(a, comm, r);
    } else if (a.mode == "sweep") {
      t = run_sweep(a, comm, r);
    } else if (a.mode == "breakdown") {
      t = run_breakdown(a, comm, r);
    } else if (a.mode == "busbw") {
      t = run_busbw(a, comm, r);
    } else {
      usage("unknown mode " + a.mode);
    }
    if (world_rank() == 0) {
      t.title += " | " + std::to_string(world_size()) + " MPI ranks; slowest rank per iteration";
      t.print(std::cout);
      if (!a.csv.empty()) t.write_csv(a.csv);
      if (!a.json.empty()) write_json(a.json, a.mode, a.mode == "join" ? "small" : a.model, r);
    }
  } catch (const std::exception& e) {
    std::cerr << "ddp_vs_pytorch: rank " << world_rank() << ": " << e.what() << "\n";
    rc = 1;
  }
  if (rc != 0) MPI_Abort(MPI_COMM_WORLD, rc);
  return rc;
}
