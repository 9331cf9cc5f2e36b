#pragma once
/// @file reproducible/reducer.hpp
/// @brief `ReproducibleReducer`: gradients averaged over a global batch of M micro-batches with
/// the same bits at every world size (DP = 1, 2, 3, 4, ...), not only on every rank of one run.
///
/// Each rank adds its contiguous micro-batches in a fixed tree over global indices
/// (reproducible/tree.hpp); `finalize()` allgathers the ranks' cover nodes and completes the
/// tree on every rank. The default Bucketer path is untouched. How it works, why the bits cannot
/// depend on the world size, and the cost: docs/reproducible.md.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/communicator.hpp>
#include <ddp/detail/aligned_buffer.hpp>
#include <ddp/detail/fnv1a.hpp>
#include <ddp/error.hpp>
#include <ddp/partition.hpp>
#include <ddp/reproducible/accumulator.hpp>
#include <ddp/reproducible/detail/kernels.hpp>
#include <ddp/reproducible/tree.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp {

/// Knobs of a `ReproducibleReducer`.
struct reproducible_options {
  /// Divide the root by the number of micro-batches (the mean over the global batch); false
  /// leaves the sum.
  bool average = true;
  /// Elements per allgather, in bytes of the group's dtype (0: a whole dtype group at once).
  std::size_t chunk_bytes = std::size_t{4} << 20;
  /// Chunks whose allgathers are in flight at once (bounds the scratch memory).
  std::size_t max_chunks_in_flight = 4;
  /// Compare (micro-batches, gradient count, elements, layout fingerprint) across ranks in
  /// `build()`: one allgather. Turn off over a fault-tolerance Manager, which has no quorum at
  /// build time (give it `layout_fingerprint()` instead).
  bool check_layout = true;
  /// Keep this rank's cover nodes after `finalize()`; a later `begin(key)` with the same key
  /// (the retry of a step that did not commit: same parameters, same global batch) reuses those
  /// whose micro-batches lie in its new range instead of recomputing them.
  bool reuse_after_failure = false;
};

/// What the last `finalize()` did.
struct reproducible_stats {
  int ranks = 0;                   ///< world size of the step
  item_range range{};              ///< this rank's micro-batches
  std::size_t computed = 0;        ///< micro-batches accumulated in this step
  std::size_t reused = 0;          ///< micro-batches kept from a failed attempt (`reuse_after_failure`)
  std::size_t cover = 0;           ///< this rank's cover nodes
  std::size_t max_cover = 0;       ///< K: nodes per rank in the cross-rank reduction
  std::size_t collectives = 0;     ///< allgathers issued
  std::size_t bytes_received = 0;  ///< other ranks' node bytes received
  double finalize_ms = 0;          ///< time in `finalize()`
  double wait_ms = 0;              ///< of which waiting for collectives
};

/// Gradients averaged over M micro-batches with world-size-invariant bits (see the file
/// description). Neither copyable nor movable (holds views of the registered gradients).
///
/// @code
/// ddp::ReproducibleReducer red(comm, /*micro_batches=*/8);
/// for (auto& p : model.parameters()) red.add(p.grad);
/// red.build();
/// for (...) {                                  // every step
///   red.begin(step);                           // this rank's micro-batches: red.range()
///   for (std::size_t i : red.pending()) {      // global micro-batch indices
///     model.compute_gradients(micro_batch(step, i));   // overwrite p.grad
///     red.accumulate(i);
///   }
///   red.finalize();                            // p.grad = mean over all 8, same bits at any DP
///   optimizer.step();
/// }
/// @endcode
class ReproducibleReducer {
 public:
  /// @param comm           communicator for the cross-rank reduction (must outlive the reducer)
  /// @param micro_batches  M: micro-batches per global batch (per step), the tree's leaves
  /// @param options        see `reproducible_options`
  /// @throws usage_error if `micro_batches` is 0
  ReproducibleReducer(communicator_ref comm, std::size_t micro_batches, reproducible_options options = {})
      : comm_(comm), tree_(check_leaves(comm, micro_batches)), opts_(options) {}

  ReproducibleReducer(const ReproducibleReducer&) = delete;
  ReproducibleReducer& operator=(const ReproducibleReducer&) = delete;
  /// Abandons in-flight collectives (never waits with a collective, never throws).
  ~ReproducibleReducer() = default;

  // ---- registration ------------------------------------------------------------------------

  /// Registers a gradient (any tensor type); returns its index. Before `build()` only.
  template <tensor G>
  std::size_t add(G& gradient) {
    return add(view(gradient));
  }
  /// Registers a gradient given as a view: the trainer writes each micro-batch's gradient there
  /// before `accumulate()`, and `finalize()` writes the mean there.
  /// @throws usage_error after `build()`, for a non-floating dtype, non-host memory, a null data
  ///   pointer, or memory already registered
  std::size_t add(tensor_view gradient) {
    const char* op = "ReproducibleReducer::add";
    if (acc_) throw usage_error(comm_.rank(), op, "gradients must be registered before build()");
    if (!is_floating(gradient.type)) {
      throw usage_error(comm_.rank(), op,
                        "gradient " + std::to_string(grads_.size()) + " has dtype " +
                            std::string(name_of(gradient.type)) + "; only f32, f64, f16 and bf16 are added");
    }
    if (!gradient.where.is_host()) {
      throw usage_error(comm_.rank(), op,
                        "gradient " + std::to_string(grads_.size()) + " is on " + gradient.where.str() +
                            "; this version reduces host memory only");
    }
    if (gradient.count && !gradient.data) throw usage_error(comm_.rank(), op, "null data pointer");
    for (const auto& g : grads_) {
      if (g.count && gradient.count && g.data == gradient.data) {
        throw usage_error(comm_.rank(), op, "the same memory is registered twice");
      }
    }
    grads_.push_back(gradient);
    return grads_.size() - 1;
  }

  /// Lays out the node buffers and (with `check_layout`) verifies that every rank registered the
  /// same gradients and the same number of micro-batches. Collective with `check_layout`. Called
  /// by the first `begin()` if not called before; a second call does nothing.
  /// @throws usage_error if ranks differ, naming them
  void build() {
    if (acc_) return;
    std::vector<reproducible::tensor_shape> shapes;
    for (const auto& g : grads_) shapes.push_back({g.type, g.count});
    reproducible::layout l(std::move(shapes));
    fingerprint_ = ddp::detail::fnv1a_offset_basis;
    auto mix = [this](std::uint64_t v) { fingerprint_ = ddp::detail::fnv1a_u64(v, fingerprint_); };
    mix(tree_.leaves());
    for (const auto& t : l.tensors()) {
      mix(static_cast<std::uint64_t>(t.type));
      mix(t.count);
    }
    if (opts_.check_layout) check_across_ranks();
    acc_.emplace(tree_, std::move(l));
  }

  // ---- per step ----------------------------------------------------------------------------

  /// Starts a step: this rank's range follows the communicator's size and rank now. `key`
  /// identifies (parameters, global batch), e.g. the committed step count: with
  /// `reuse_after_failure`, a key equal to the previous step's keeps that step's nodes that lie in
  /// the new range. Calling it again restarts the step.
  void begin(std::uint64_t key) { start_step(true, key); }
  /// Starts a step that reuses nothing. `accumulate()` calls it if the step was not begun.
  void begin() { start_step(false, 0); }

  /// The micro-batches this rank computes in the current (or, before `begin()`, the next) step.
  [[nodiscard]] item_range range() const {
    return begun_ ? range_ : contiguous_share(tree_.leaves(), comm_.size(), comm_.rank());
  }
  /// Micro-batches of `range()` still to accumulate in this step (all of them unless some were
  /// reused or already accumulated), in order.
  [[nodiscard]] std::vector<std::size_t> pending() const {
    if (begun_) return acc_->pending();
    const item_range r = range();
    std::vector<std::size_t> out;
    for (std::size_t i = r.first; i < r.last; ++i) out.push_back(i);
    return out;
  }

  /// The registered gradients hold micro-batch `micro_batch`'s gradients (global index, in
  /// `range()`): adds them to the tree. They may be overwritten as soon as this returns.
  /// @throws usage_error if `micro_batch` is not in `range()` or was accumulated already
  void accumulate(std::size_t micro_batch) {
    if (!begun_) begin();
    try {
      acc_->add(micro_batch, grads_);
    } catch (const usage_error& e) {
      throw usage_error(rank_, "ReproducibleReducer::accumulate", e.what());
    }
    ++computed_;
  }

  /// Completes the reduction across ranks and writes the mean over all M micro-batches (the sum
  /// with `average = false`) into every registered gradient, with the same bits on every rank and
  /// at every world size. Collective.
  /// @throws usage_error if micro-batches of `range()` were not accumulated, naming them, or if
  ///   the communicator's size changed since `begin()`
  /// @throws communication_error / timeout_error from the collectives
  void finalize() {
    if (!begun_) begin();
    const auto t0 = clock::now();
    step_end guard{this};
    if (comm_.size() != size_ || comm_.rank() != rank_) {
      throw usage_error(rank_, "ReproducibleReducer::finalize",
                        "the communicator changed from rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
                            " to rank " + std::to_string(comm_.rank()) + " of " + std::to_string(comm_.size()) +
                            " since begin()");
    }
    if (!acc_->complete()) throw_missing();
    if (acc_->nodes() != tree_.cover(range_)) {  // the accumulator's invariant; never expected to fail
      throw error(rank_, "ReproducibleReducer::finalize", "internal error: the stored nodes are not the range's cover");
    }
    const plan& pl = plan_for(size_);
    stats_ = reproducible_stats{};
    stats_.ranks = size_;
    stats_.range = range_;
    stats_.computed = computed_;
    stats_.reused = acc_->reused();
    stats_.cover = acc_->nodes().size();
    stats_.max_cover = pl.kmax;
    if (size_ == 1) {
      reduce_locally(pl);
    } else {
      reduce_across(pl);
    }
    stats_.finalize_ms = ms_between(t0, clock::now());
  }

  // ---- introspection ---------------------------------------------------------------------------

  /// M, the micro-batches per global batch.
  [[nodiscard]] std::size_t micro_batches() const noexcept { return tree_.leaves(); }
  /// The reduction tree.
  [[nodiscard]] const reproducible::tree& shape() const noexcept { return tree_; }
  /// Number of registered gradients.
  [[nodiscard]] std::size_t size() const noexcept { return grads_.size(); }
  /// FNV-1a hash of M and every gradient's dtype and count (valid after `build()`), e.g. for
  /// `Manager::set_layout_fingerprint`.
  [[nodiscard]] std::uint64_t layout_fingerprint() const noexcept { return fingerprint_; }
  /// What the last `finalize()` did.
  [[nodiscard]] const reproducible_stats& last_step() const noexcept { return stats_; }
  /// The options.
  [[nodiscard]] const reproducible_options& options() const noexcept { return opts_; }

 private:
  using clock = std::chrono::steady_clock;

  // The upper tree as a stack program over the gathered cover nodes: `load i` pushes input i
  // (node k of rank r is input k * P + r), `add` replaces the two top entries by their sum.
  struct instr {
    bool load = false;
    std::size_t input = 0;
  };
  struct plan {
    int ranks = 0;
    std::size_t kmax = 0;
    std::vector<instr> program;
    std::size_t depth = 0;  // largest stack
  };

  struct step_end {
    ReproducibleReducer* self;
    ~step_end() {
      self->inflight_.clear();  // abandons whatever is still pending (after an error)
      self->begun_ = false;
    }
  };

  static std::size_t check_leaves(communicator_ref comm, std::size_t m) {
    if (m == 0) throw usage_error(comm.rank(), "ReproducibleReducer", "needs at least one micro-batch per step");
    return m;
  }

  static double ms_between(clock::time_point a, clock::time_point b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
  }

  void start_step(bool keyed, std::uint64_t key) {
    build();
    size_ = comm_.size();
    rank_ = comm_.rank();
    range_ = contiguous_share(tree_.leaves(), size_, rank_);
    const bool keep = opts_.reuse_after_failure && keyed && last_keyed_ && key == last_key_;
    acc_->begin(range_, keep);
    last_keyed_ = keyed;
    last_key_ = key;
    computed_ = 0;
    begun_ = true;
  }

  void check_across_ranks() {
    std::size_t elems = 0;
    for (const auto& g : grads_) elems += g.count;
    const auto n = static_cast<std::size_t>(comm_.size());
    std::vector<std::int64_t> mine{static_cast<std::int64_t>(tree_.leaves()), static_cast<std::int64_t>(grads_.size()),
                                   static_cast<std::int64_t>(elems), static_cast<std::int64_t>(fingerprint_)};
    std::vector<std::int64_t> all(4 * n);
    comm_.allgather(view(mine), view(all)).wait();
    std::string diff;
    for (std::size_t r = 0; r < n; ++r) {
      if (std::equal(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(4 * r))) continue;
      diff += (diff.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " has " +
              std::to_string(all[4 * r]) + " micro-batches, " + std::to_string(all[4 * r + 1]) + " gradients / " +
              std::to_string(all[4 * r + 2]) + " elements";
    }
    if (!diff.empty()) {
      throw usage_error(comm_.rank(), "ReproducibleReducer::build",
                        "micro-batches or gradients differ across ranks: this rank has " +
                            std::to_string(tree_.leaves()) + " micro-batches, " + std::to_string(grads_.size()) +
                            " gradients / " + std::to_string(elems) + " elements; differing: " + diff);
    }
  }

  [[noreturn]] void throw_missing() const {
    const auto missing = acc_->pending();
    std::string list;
    for (std::size_t k = 0; k < missing.size() && k < 10; ++k) list += (k ? ", " : "") + std::to_string(missing[k]);
    if (missing.size() > 10) list += ", ...";
    throw usage_error(rank_, "ReproducibleReducer::finalize",
                      std::to_string(missing.size()) + " of this rank's micro-batches [" +
                          std::to_string(range_.first) + ", " + std::to_string(range_.last) +
                          ") were never accumulated (" + list + ")");
  }

  const plan& plan_for(int ranks) {
    if (plan_.ranks == ranks) return plan_;
    plan p;
    p.ranks = ranks;
    std::map<reproducible::node, std::size_t> inputs;
    for (int r = 0; r < ranks; ++r) {
      const auto c = tree_.cover_of_rank(ranks, r);
      p.kmax = std::max(p.kmax, c.size());
      for (std::size_t k = 0; k < c.size(); ++k) {
        inputs[c[k]] = k * static_cast<std::size_t>(ranks) + static_cast<std::size_t>(r);
      }
    }
    std::size_t sp = 0;
    emit(tree_.root(), inputs, p, sp);
    plan_ = std::move(p);
    return plan_;
  }

  // Post-order walk of the upper tree: the additions in the tree's order.
  void emit(reproducible::node n, const std::map<reproducible::node, std::size_t>& inputs, plan& p, std::size_t& sp) {
    if (auto it = inputs.find(n); it != inputs.end()) {
      p.program.push_back({true, it->second});
      p.depth = std::max(p.depth, ++sp);
      return;
    }
    const reproducible::node r = reproducible::tree::right(n);
    emit(reproducible::tree::left(n), inputs, p, sp);
    if (!tree_.exists(r)) return;  // pass-through
    emit(r, inputs, p, sp);
    p.program.push_back({false, 0});
    --sp;
  }

  // ---- evaluation ------------------------------------------------------------------------------

  // Runs the program over elements [0, len) of one chunk of group g starting at group element
  // `start`; input i's chunk begins at inputs[i]. Writes root (/ M) into the gradients.
  template <class T>
  void evaluate(const plan& pl, std::size_t g, std::size_t start, std::size_t len,
                const std::vector<const T*>& inputs) {
    constexpr std::size_t block = 2048;
    scratch_.resize(std::max<std::size_t>(pl.depth, 1) * block * sizeof(T));
    T* temps = reinterpret_cast<T*>(scratch_.data());
    std::vector<const T*> stack(pl.depth + 1);
    for (std::size_t b0 = 0; b0 < len; b0 += block) {
      const std::size_t e = std::min(block, len - b0);
      std::size_t sp = 0;
      for (const instr& in : pl.program) {
        if (in.load) {
          stack[sp++] = inputs[in.input] + b0;
        } else {
          T* dst = temps + (sp - 2) * block;
          reproducible::detail::add<T>(dst, stack[sp - 2], stack[sp - 1], e);
          stack[sp - 2] = dst;
          --sp;
        }
      }
      write_out<T>(g, start + b0, stack[0], e);
    }
  }

  // Group g's elements [from, from + n) = src (/ M), into the registered gradients.
  template <class T>
  void write_out(std::size_t g, std::size_t from, const T* src, std::size_t n) {
    const auto& places = acc_->buffer_layout().places();
    const auto& order = group_tensors_[g];
    // First tensor whose end lies beyond `from`.
    auto it = std::upper_bound(order.begin(), order.end(), from,
                               [&](std::size_t v, std::size_t t) { return v < places[t].offset + places[t].count; });
    for (; it != order.end() && n > 0; ++it) {
      const auto& pl = places[*it];
      if (pl.count == 0) continue;
      const std::size_t off = from - pl.offset;
      const std::size_t m = std::min(n, pl.count - off);
      T* dst = static_cast<T*>(grads_[*it].data) + off;
      if (opts_.average) {
        reproducible::detail::divide<T>(dst, src, m, tree_.leaves());
      } else {
        std::memcpy(dst, src, m * sizeof(T));
      }
      src += m;
      from += m;
      n -= m;
    }
  }

  void index_groups() {
    if (!group_tensors_.empty()) return;
    const auto& l = acc_->buffer_layout();
    group_tensors_.resize(l.groups().size());
    for (std::size_t t = 0; t < l.places().size(); ++t) group_tensors_[l.places()[t].group].push_back(t);
  }

  // One rank: the root is this rank's single cover node.
  void reduce_locally(const plan& pl) {
    index_groups();
    const auto nodes = acc_->nodes();
    const auto& l = acc_->buffer_layout();
    for (std::size_t g = 0; g < l.groups().size(); ++g) {
      const tensor_view gv = l.group_view(acc_->value(nodes.at(0)), g);
      reproducible::detail::visit_floating(gv.type, [&]<class T>(T) {
        const std::vector<const T*> inputs{static_cast<const T*>(gv.data)};
        evaluate<T>(pl, g, 0, gv.count, inputs);
      });
    }
  }

  struct chunk {
    std::size_t group = 0, start = 0, len = 0;
  };
  struct flight {
    std::size_t chunk = 0, slot = 0;
    std::vector<work> works;
  };

  void reduce_across(const plan& pl) {
    index_groups();
    const auto& l = acc_->buffer_layout();
    const auto p = static_cast<std::size_t>(size_);
    const auto mine = acc_->nodes();
    std::vector<chunk> chunks;
    std::size_t slot_bytes = 0;
    for (std::size_t g = 0; g < l.groups().size(); ++g) {
      const auto& gr = l.groups()[g];
      const std::size_t esz = size_of(gr.type);
      const std::size_t per = opts_.chunk_bytes ? std::max<std::size_t>(1, opts_.chunk_bytes / esz) : gr.count;
      for (std::size_t s = 0; s < gr.count; s += per) {
        chunks.push_back({g, s, std::min(per, gr.count - s)});
        slot_bytes = std::max(slot_bytes, chunks.back().len * esz);
      }
    }
    const std::size_t window = std::max<std::size_t>(1, std::min(opts_.max_chunks_in_flight, chunks.size()));
    if (recv_.size() < window || recv_bytes_ < slot_bytes * pl.kmax * p) {
      recv_.clear();
      recv_bytes_ = slot_bytes * pl.kmax * p;
      for (std::size_t s = 0; s < window; ++s) recv_.emplace_back(recv_bytes_);
    }
    if (mine.size() < pl.kmax && dummy_.size() < slot_bytes) dummy_ = ddp::detail::aligned_buffer(slot_bytes);

    std::vector<std::size_t> free_slots;
    for (std::size_t s = window; s-- > 0;) free_slots.push_back(s);
    std::size_t next = 0;
    double evaluating = 0;
    const auto loop_start = clock::now();
    auto launch = [&](std::size_t c) {
      const chunk& ch = chunks[c];
      const auto& gr = l.groups()[ch.group];
      const std::size_t esz = size_of(gr.type);
      flight f;
      f.chunk = c;
      f.slot = free_slots.back();
      free_slots.pop_back();
      for (std::size_t k = 0; k < pl.kmax; ++k) {
        const tensor_view in = k < mine.size() ? l.group_view(acc_->value(mine[k]), ch.group).slice(ch.start, ch.len)
                                               : tensor_view{dummy_.data(), ch.len, gr.type, device::host()};
        const tensor_view out{recv_[f.slot].data() + k * p * ch.len * esz, p * ch.len, gr.type, device::host()};
        f.works.push_back(comm_.allgather(in, out));
        ++stats_.collectives;
        stats_.bytes_received += (p - 1) * ch.len * esz;
      }
      inflight_.push_back(std::move(f));
    };
    auto finish = [&](flight& f) {
      const auto t = clock::now();
      const chunk& ch = chunks[f.chunk];
      const auto& gr = l.groups()[ch.group];
      reproducible::detail::visit_floating(gr.type, [&]<class T>(T) {
        const T* base = reinterpret_cast<const T*>(recv_[f.slot].data());
        std::vector<const T*> inputs(pl.kmax * p);
        for (std::size_t i = 0; i < inputs.size(); ++i) inputs[i] = base + i * ch.len;
        evaluate<T>(pl, ch.group, ch.start, ch.len, inputs);
      });
      free_slots.push_back(f.slot);
      evaluating += ms_between(t, clock::now());
    };

    // Each work enforces its own deadline when tested (work.hpp), and the loop waits without a
    // core: a hung peer ends this at the collectives' timeout (through a Manager, the step's).
    const auto launch_free = [&] {
      while (next < chunks.size() && !free_slots.empty()) launch(next++);
    };
    launch_free();
    ddp::detail::progress_mode mode = ddp::detail::progress_mode::background;
    for (const auto& f : inflight_) {
      for (const auto& w : f.works) {
        if (w.progress() == ddp::detail::progress_mode::polled) mode = ddp::detail::progress_mode::polled;
      }
    }
    for (ddp::detail::idle_backoff idle(mode); next < chunks.size() || !inflight_.empty();) {
      launch_free();
      bool advanced = false;
      for (std::size_t i = 0; i < inflight_.size();) {
        bool done = true;
        for (auto& w : inflight_[i].works) done = w.test() && done;  // test every one: progress for all
        if (done) {
          finish(inflight_[i]);
          inflight_.erase(inflight_.begin() + static_cast<std::ptrdiff_t>(i));
          advanced = true;
        } else {
          ++i;
        }
      }
      if (advanced) {
        idle.reset();
        continue;
      }
      idle.pause();
    }
    stats_.wait_ms = ms_between(loop_start, clock::now()) - evaluating;
  }

  communicator_ref comm_;
  reproducible::tree tree_;
  reproducible_options opts_;
  std::vector<tensor_view> grads_;
  std::optional<reproducible::accumulator> acc_;
  std::uint64_t fingerprint_ = 0;
  std::vector<std::vector<std::size_t>> group_tensors_;  // per group: tensor indices by offset

  bool begun_ = false;
  int size_ = 1;
  int rank_ = 0;
  item_range range_{};
  std::size_t computed_ = 0;
  bool last_keyed_ = false;
  std::uint64_t last_key_ = 0;

  plan plan_;
  std::vector<std::byte> scratch_;
  std::vector<ddp::detail::aligned_buffer> recv_;  // declared before inflight_: outlives the work
  std::size_t recv_bytes_ = 0;
  ddp::detail::aligned_buffer dummy_;
  std::vector<flight> inflight_;
  reproducible_stats stats_;
};

}  // namespace ddp
