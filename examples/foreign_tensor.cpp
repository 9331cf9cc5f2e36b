// A tensor type from a "foreign" library: its own arena allocator, its own dtype enum, its own
// autograd hook API. Plugging it into ddp takes one tensor_traits specialisation; its hook API
// fits ddp's gradient_hook_registry as it is, so the Bucketer attaches to it and removes its
// hooks again when destroyed.
//
//   mpiexec -n 2 ./foreign_tensor      or      ./foreign_tensor --threads 2
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <vector>

#include <ddp/bucketer.hpp>
#include <ddp/local.hpp>
#include <ddp/mpi.hpp>

// ---- the foreign library (pretend it is a third-party header we cannot change) -----------------
namespace acme {

enum class Type { Float32, Float64, Half };

/// Bump allocator: every array of a model lives in one block.
class Arena {
 public:
  explicit Arena(std::size_t bytes) : block_(new std::byte[bytes]), size_(bytes) {}
  void* allocate(std::size_t bytes) {
    used_ = (used_ + 63) / 64 * 64;
    if (used_ + bytes > size_) throw std::bad_alloc();
    void* p = block_.get() + used_;
    used_ += bytes;
    return p;
  }

 private:
  std::unique_ptr<std::byte[]> block_;
  std::size_t size_, used_ = 0;
};

struct NDArray {
  Type type;
  std::vector<long> shape;
  void* storage;
  NDArray(Arena& arena, Type t, std::vector<long> s) : type(t), shape(std::move(s)) {
    storage = arena.allocate(elements() * (t == Type::Float64 ? 8 : t == Type::Float32 ? 4 : 2));
    std::memset(storage, 0, elements() * (t == Type::Float64 ? 8 : t == Type::Float32 ? 4 : 2));
  }
  [[nodiscard]] std::size_t elements() const {
    std::size_t n = 1;
    for (long d : shape) n *= static_cast<std::size_t>(d);
    return n;
  }
};

/// The library's autograd: per-parameter callbacks when a gradient is final.
class Graph {
 public:
  int add_gradient_hook(std::size_t param, std::function<void()> fn) {
    hooks_[next_] = {param, std::move(fn)};
    return next_++;
  }
  void remove_gradient_hook(int id) noexcept { hooks_.erase(id); }
  void gradient_ready(std::size_t param) {
    for (auto& [id, h] : hooks_) {
      if (h.first == param) h.second();
    }
  }
  [[nodiscard]] std::size_t hook_count() const { return hooks_.size(); }

 private:
  std::map<int, std::pair<std::size_t, std::function<void()>>> hooks_;
  int next_ = 0;
};

}  // namespace acme

// ---- the whole integration ---------------------------------------------------------------------
template <>
struct ddp::tensor_traits<acme::NDArray> {
  static void* data(acme::NDArray& a) { return a.storage; }
  static std::size_t size(const acme::NDArray& a) { return a.elements(); }
  static ddp::dtype dtype(const acme::NDArray& a) {
    switch (a.type) {
      case acme::Type::Float32: return ddp::dtype::f32;
      case acme::Type::Float64: return ddp::dtype::f64;
      case acme::Type::Half: return ddp::dtype::f16;
    }
    return ddp::dtype::f32;
  }
  static ddp::device device(const acme::NDArray&) { return ddp::device::host(); }
};
static_assert(ddp::tensor<acme::NDArray>);
static_assert(ddp::gradient_hook_registry<acme::Graph>);

namespace {

void run(ddp::communicator_ref comm) {
  const int rank = comm.rank();
  acme::Arena arena(1 << 20);
  acme::NDArray w(arena, acme::Type::Float32, {32, 16}), gw(arena, acme::Type::Float32, {32, 16});
  acme::NDArray b(arena, acme::Type::Float64, {32}), gb(arena, acme::Type::Float64, {32});
  acme::NDArray s(arena, acme::Type::Half, {8}), gs(arena, acme::Type::Half, {8});
  acme::Graph graph;

  std::size_t hooks_while_alive = 0;
  {
    ddp::Bucketer grads(comm);
    grads.add(w, gw);
    grads.add(b, gb);
    grads.add(s, gs);
    grads.attach(graph);  // one hook per parameter in acme's autograd
    hooks_while_alive = graph.hook_count();

    for (int step = 0; step < 3; ++step) {
      auto* fw = static_cast<float*>(gw.storage);
      auto* fb = static_cast<double*>(gb.storage);
      auto* fs = static_cast<ddp::half*>(gs.storage);
      for (std::size_t i = 0; i < gw.elements(); ++i) fw[i] = static_cast<float>(rank + 1);
      for (std::size_t i = 0; i < gb.elements(); ++i) fb[i] = 10.0 * (rank + 1);
      for (std::size_t i = 0; i < gs.elements(); ++i) fs[i] = ddp::half(0.5f * static_cast<float>(rank + 1));
      graph.gradient_ready(2);  // acme's backward pass fires the hooks, last layer first
      graph.gradient_ready(1);
      graph.gradient_ready(0);
      grads.finalize();
    }
    const float mean_rank = static_cast<float>(comm.size() + 1) / 2.0f;
    bool ok = true;  // every element of the three arrays holds the mean over the ranks
    for (std::size_t i = 0; i < gw.elements(); ++i) ok = ok && static_cast<float*>(gw.storage)[i] == mean_rank;
    for (std::size_t i = 0; i < gb.elements(); ++i) ok = ok && static_cast<double*>(gb.storage)[i] == 10.0 * mean_rank;
    for (std::size_t i = 0; i < gs.elements(); ++i) {
      ok = ok && static_cast<float>(static_cast<ddp::half*>(gs.storage)[i]) == 0.5f * mean_rank;
    }
    std::printf("rank %d: averaged f32/f64/f16 gradients of acme arrays over %d ranks: %s (%zu buckets)\n", rank,
                comm.size(), ok ? "correct" : "WRONG", grads.layout().size());
    if (!ok) throw std::runtime_error("wrong averages");
  }
  // Every rank must hold the same gradients, bit for bit: a hash of every byte of the three
  // gradient arrays, gathered from every rank and compared.
  std::uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (const acme::NDArray* g : {&gw, &gb, &gs}) {
    const auto* p = static_cast<const unsigned char*>(g->storage);
    const std::size_t bytes =
        ddp::tensor_traits<acme::NDArray>::size(*g) * ddp::size_of(ddp::tensor_traits<acme::NDArray>::dtype(*g));
    for (std::size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  }
  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<std::int64_t> mine{static_cast<std::int64_t>(h)}, all(n);
  comm.allgather(ddp::view(mine), ddp::view(all)).wait();
  bool identical = true;
  for (auto x : all) identical = identical && x == mine[0];
  if (rank == 0) {
    std::printf("gradients bit-identical on all %d ranks: %s (hash %016llx)\n", comm.size(), identical ? "yes" : "NO",
                static_cast<unsigned long long>(h));
  }
  if (!identical) throw std::runtime_error("gradients differ across ranks");

  // Destroying the Bucketer removed its hooks from acme's graph, on every rank.
  std::printf("rank %d: hooks in acme's graph: %zu while the Bucketer lived, %zu after it was destroyed\n", rank,
              hooks_while_alive, graph.hook_count());
  std::vector<std::int64_t> left{static_cast<std::int64_t>(graph.hook_count())}, lefts(n);
  comm.allgather(ddp::view(left), ddp::view(lefts)).wait();
  bool clean = true;
  for (auto k : lefts) clean = clean && k == 0;
  if (rank == 0) std::printf("no hooks left in acme's graph on all %d ranks: %s\n", comm.size(), clean ? "yes" : "NO");
  if (!clean) throw std::runtime_error("hooks left behind");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc > 2 && std::strcmp(argv[1], "--threads") == 0) {
      ddp::local::run(std::atoi(argv[2]), [](ddp::local::communicator& c) { run(c); });
      return 0;
    }
    ddp::mpi::environment env(&argc, &argv);
    auto comm = ddp::world(env);  // shared memory inside a node, TCP between nodes
    run(comm);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "foreign_tensor: %s\n", e.what());
    return 1;
  }
}
