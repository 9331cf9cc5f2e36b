#pragma once
/// @file shm/communicator.hpp
/// @brief `ddp::shm::communicator<Inner, Cross>`: a communicator decorator whose allreduce runs
/// through shared memory among the ranks of a node and, across nodes, over one leader per node.
///
/// Wrap any ddp communicator and hand the result to any component in its place; allreduce takes
/// the shared-memory path, every other collective is forwarded unchanged. On one node an
/// allreduce completes in the call; across nodes over sockets (the default) it runs on a thread of
/// the communicator's, in call order, so its network time overlaps the caller's work. Every rank
/// ends with the same bits. The algorithm, when it completes, failures and threads:
/// docs/shm-allreduce.md.

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <ddp/backend_contract.hpp>
#include <ddp/communicator.hpp>
#include <ddp/detail/host_reduce.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/net/ring.hpp>
#include <ddp/reduce_op.hpp>
#include <ddp/shm/arena.hpp>
#include <ddp/shm/job_queue.hpp>
#include <ddp/shm/layout.hpp>
#include <ddp/shm/node_engine.hpp>
#include <ddp/shm/options.hpp>
#include <ddp/shm/posix_segment.hpp>
#include <ddp/shm/segment.hpp>
#include <ddp/shm/tensor_group.hpp>
#include <ddp/shm/topology.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp::shm {

/// Allocator of zero-copy bucket storage: `bytes` zero-filled, aligned bytes in the calling
/// rank's arena, alive while any copy of the pointer is. The shape a Bucketer hook would take.
using bucket_allocator = std::function<std::shared_ptr<std::byte>(std::size_t bytes)>;

/// The pieces a communicator is assembled from (what a backend-specific factory such as
/// `make_mpi_communicator` produces).
template <class Cross>
struct node_parts {
  node_topology topology;           ///< which ranks share this rank's node, and who leads it
  segment_layout layout;            ///< how the node's shared segment is carved up
  std::shared_ptr<segment> shared;  ///< the node's segment; null when this rank is alone on its node
  std::optional<Cross> leaders;     ///< on node leaders when there are several nodes
  std::optional<net::ring> ring;    ///< on node leaders whose options choose across_nodes::sockets
};

/// Connects the node leaders' sockets ring over their communicator (its allgather carries each
/// leader's addresses). Collective over `leaders`; throws communication_error or timeout_error.
template <ddp::communicator Cross>
[[nodiscard]] net::ring connect_leaders_ring(Cross& leaders, const options& opts) {
  const net::context ctx{leaders.rank(), "shm::communicator: connecting the node leaders' sockets ring"};
  const auto allgather = [&](const net::ring_record& mine) {
    std::vector<net::ring_record> all(static_cast<std::size_t>(leaders.size()));
    net::ring_record in = mine;
    leaders
        .allgather(tensor_view{&in, sizeof in, dtype::u8}, tensor_view{all.data(), sizeof in * all.size(), dtype::u8})
        .wait();
    return all;
  };
  return net::ring::connect(leaders.rank(), leaders.size(), allgather, opts.socket_interface,
                            net::clock::now() + opts.timeout, ctx, opts.secret, opts.insecure_no_secret);
}

/// See the file comment. `Inner`: the wrapped communicator (owned; pass `communicator_ref` to
/// wrap without owning). `Cross`: the type of the leaders' communicator.
template <ddp::communicator Inner, ddp::communicator Cross = Inner>
class communicator : public single_tensor_calls<communicator<Inner, Cross>> {
 public:
  using single_tensor_calls<communicator>::allreduce;
  using single_tensor_calls<communicator>::broadcast;
  using inner_type = Inner;  ///< the wrapped communicator's type
  using cross_type = Cross;  ///< the node leaders' communicator's type

  /// Wraps `inner`; collective over it (a host-name allgather unless `opts.node_of_rank` is set,
  /// then three allgathers to agree on a POSIX shared-memory segment per node). Ranks spread over
  /// several nodes need a leaders' communicator: use the constructor taking `make_leaders`.
  /// @throws segment_error (on every rank) if shared memory cannot be created or mapped
  /// @throws usage_error if the ranks span several nodes
  explicit communicator(Inner inner, shm::options opts = {})
      : communicator(std::move(inner), std::move(opts), [](const node_topology&) { return std::optional<Cross>{}; }) {}

  /// As above; on each node leader, when there are several nodes, `make_leaders(topology)`
  /// returns the communicator of the node leaders (rank = node index, size = number of nodes).
  /// One more allgather checks every leader got one.
  template <class MakeLeaders>
  requires std::is_invocable_r_v<std::optional<Cross>, MakeLeaders&, const node_topology&> communicator(
      Inner inner, shm::options opts, MakeLeaders make_leaders)
      : inner_(std::move(inner)) {
    check_options(opts, inner_.rank());
    node_parts<Cross> parts;
    parts.topology = detect_topology(inner_, opts.node_of_rank);
    parts.layout = segment_layout(parts.topology.node_size, opts.chunk_bytes, opts.arena_bytes, inner_.rank());
    parts.shared = open_posix_segment(inner_, parts.topology, parts.layout);
    std::string problem;
    if (parts.topology.nodes > 1 && parts.topology.is_leader()) {
      parts.leaders = make_leaders(parts.topology);
      problem = leaders_problem(parts.topology, parts.leaders);
      if (problem.empty() && opts.inter_node == across_nodes::sockets) {
        try {
          parts.ring.emplace(connect_leaders_ring(*parts.leaders, opts));
        } catch (const error& e) {
          problem = e.message();
        }
      }
    }
    agree_or_throw(problem, parts.topology);
    assemble(std::move(opts), std::move(parts));
  }

  /// Assembles a communicator from parts made elsewhere (a backend factory). Not collective.
  communicator(Inner inner, shm::options opts, node_parts<Cross> parts) : inner_(std::move(inner)) {
    check_options(opts, inner_.rank());
    if (parts.topology.nodes > 1 && parts.topology.is_leader()) {
      if (auto problem = leaders_problem(parts.topology, parts.leaders); !problem.empty()) {
        throw usage_error(inner_.rank(), "shm::communicator", problem);
      }
      if (opts.inter_node == across_nodes::sockets && !parts.ring) {
        throw usage_error(inner_.rank(), "shm::communicator",
                          "options::inter_node is sockets but the parts hold no ring (connect_leaders_ring)");
      }
    }
    assemble(std::move(opts), std::move(parts));
  }

  /// Moves the wrapper; the shared segment stays mapped.
  communicator(communicator&&) noexcept = default;
  /// Moves the wrapper; the shared segment stays mapped.
  communicator& operator=(communicator&&) noexcept = default;
  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;
  /// Unmaps this rank's view of the segment (once no arena block uses it). Never communicates;
  /// see `close()` for backings that free memory collectively.
  ~communicator() = default;

  /// This rank in the wrapped communicator.
  [[nodiscard]] int rank() const { return inner_.rank(); }
  /// Ranks of the wrapped communicator.
  [[nodiscard]] int size() const { return inner_.size(); }

  /// In-place allreduce of `tensors` (one coalesced call; dtypes may differ), through shared
  /// memory. Complete on return on one node; across nodes over sockets, when the work completes
  /// (see the file comment).
  work allreduce(std::span<const tensor_view> tensors, reduce_op op) { return reduce(tensors, op, 1.0); }

  /// In-place sum of `tensors` in which every rank's floating-point values are multiplied by
  /// `factor` on their way into shared memory (the averaging rule of ddp/average.hpp, with no pass
  /// of its own); integer tensors are summed as they are. Completes as `allreduce` does.
  work allreduce_premul_sum(std::span<const tensor_view> tensors, double factor) {
    return reduce(tensors, reduce_op::sum, factor);
  }

  /// True: every input is copied into the node's segment anyway (arena tensors excepted), so a
  /// coalesced call over scattered tensors costs what one over a contiguous buffer does.
  [[nodiscard]] bool stages_input() const noexcept { return true; }

 private:
  work reduce(std::span<const tensor_view> tensors, reduce_op op, double factor) {
    live("allreduce");
    std::lock_guard lk(s_->mutex);
    op_info info = contract::check_allreduce(caller(), tensors, op);
    if (!std::isfinite(factor)) {
      throw usage_error(rank(), info.describe(), "the pre-multiplication factor is not finite");
    }
    if (s_->broken.load()) {
      throw usage_error(rank(), info.describe(),
                        "communicator used after abort(), close() or a failed shared-memory collective");
    }
    info.seq = s_->seq++;
    if (info.count == 0) return work::ready();
    if (size() == 1) {
      for (const tensor_view& t : tensors) ddp::detail::scale_in_place(t.type, t.data, t.count, factor);
      return work::ready();
    }
    if (s_->queue) {  // several nodes over sockets: on the queue's thread, in call order
      auto status = s_->queue->push(
          [st = s_.get(), views = std::vector<tensor_view>(tensors.begin(), tensors.end()), op, info, factor] {
            if (st->broken.load()) {
              throw communication_error(st->rank, info.describe(), "an earlier allreduce of this communicator failed");
            }
            run_or_break(*st, nullptr, views, op, info, factor);
          });
      return work(std::make_unique<detail::queued_job>(info, std::move(status)));
    }
    try {
      run_or_break(*s_, leaders_ ? &*leaders_ : nullptr, tensors, op, info, factor);
    } catch (const usage_error&) {
      throw;
    } catch (...) {
      return work::failed(std::current_exception());
    }
    return work::ready();
  }

 public:
  /// Forwarded to the wrapped communicator.
  work broadcast(std::span<const tensor_view> tensors, int root) { return inner_.broadcast(tensors, root); }
  /// Forwarded to the wrapped communicator.
  work allgather(tensor_view in, tensor_view out) { return inner_.allgather(in, out); }
  /// Forwarded to the wrapped communicator.
  work reduce_scatter(tensor_view in, tensor_view out, reduce_op op) { return inner_.reduce_scatter(in, out, op); }
  /// Forwarded to the wrapped communicator.
  work barrier() { return inner_.barrier(); }

  /// Marks the node's segment aborted (peers waiting in shared memory fail at once with
  /// `communication_error`), aborts the wrapped and leaders' communicators; later allreduces
  /// throw `usage_error`.
  void abort() noexcept {
    if (s_) {
      s_->broken = true;
      if (s_->engine) s_->engine->abort(1);
    }
    inner_.abort();
    if (leaders_) leaders_->abort();
    if (s_ && s_->ring) s_->ring->abort();
  }

  /// Releases the segment now, collectively over the node where the backing needs it (an MPI
  /// window: MPI_Win_free). Call on every rank, with no arena block alive. Later allreduces
  /// throw `usage_error`; the forwarded collectives keep working.
  void close() {
    live("shm::communicator::close");
    if (s_->queue) s_->queue->drain();
    std::lock_guard lk(s_->mutex);
    if (s_->pool && s_->pool->used() > 0) {
      throw usage_error(rank(), "shm::communicator::close",
                        std::to_string(s_->pool->used()) + " bytes of arena blocks are still alive");
    }
    s_->broken = true;
    s_->engine.reset();
    s_->pool.reset();
    if (s_->shared) s_->shared->close();
    s_->shared.reset();
  }

  // ---- zero-copy buffers ---------------------------------------------------------------------

  /// `bytes` zero-filled bytes in this rank's arena. A tensor that lies in it (as the only tensor
  /// of its dtype in a call) is reduced where it is: no copy in, and peers read it directly.
  /// @throws usage_error without an arena (options::arena_bytes) or when it is exhausted
  [[nodiscard]] arena_block allocate(std::size_t bytes) {
    live("shm::communicator::allocate");
    return shm::allocate(s_->pool, bytes, rank());
  }

  /// `allocate` as a type-erased allocator (for bucket storage).
  [[nodiscard]] bucket_allocator allocator() {
    live("shm::communicator::allocator");
    return [a = s_->pool, r = rank()](std::size_t bytes) {
      auto block = std::make_shared<arena_block>(shm::allocate(a, bytes, r));
      std::byte* p = block->data();
      return std::shared_ptr<std::byte>(std::move(block), p);
    };
  }

  /// True if `t` lies in this rank's arena.
  [[nodiscard]] bool in_arena(tensor_view t) const noexcept {
    return s_ && s_->pool && t.count > 0 && s_->pool->contains(t.data, t.bytes());
  }

  // ---- introspection -------------------------------------------------------------------------

  /// Which ranks share this rank's node.
  [[nodiscard]] const node_topology& topology() const noexcept { return s_->topology; }
  /// The options every rank agreed on. (`shm::options` names the type inside this class, where
  /// `options` is this function.)
  [[nodiscard]] const shm::options& options() const noexcept { return s_->opts; }
  /// The wrapped communicator (it carries every collective this one does not accelerate).
  [[nodiscard]] Inner& inner() noexcept { return inner_; }
  /// The wrapped communicator.
  [[nodiscard]] const Inner& inner() const noexcept { return inner_; }
  /// The leaders' communicator (on node leaders when there are several nodes), else null.
  [[nodiscard]] Cross* leaders() noexcept { return leaders_ ? &*leaders_ : nullptr; }
  /// The inter-node step this rank takes as a node leader (`options().inter_node`), or nullopt
  /// when it takes none (one node, or not a leader).
  [[nodiscard]] std::optional<across_nodes> inter_node() const noexcept {
    if (s_ && s_->ring) return across_nodes::sockets;
    if (leaders_) return across_nodes::leaders_communicator;
    return std::nullopt;
  }
  /// "posix", "mpi window", or "none" (this rank is alone on its node).
  [[nodiscard]] const char* backing() const noexcept { return s_ && s_->shared ? s_->shared->backing() : "none"; }
  /// Bytes of the node's segment (0 if none).
  [[nodiscard]] std::size_t segment_bytes() const noexcept { return s_ && s_->shared ? s_->shared->size() : 0; }

 private:
  struct state {
    shm::options opts;
    node_topology topology;
    std::shared_ptr<segment> shared;
    std::optional<node_engine> engine;
    std::shared_ptr<shm::arena> pool;  // this rank's arena, or null
    std::mutex mutex;
    std::atomic<bool> broken{false};
    std::uint64_t seq = 0;
    int rank = 0;
    int size = 1;
    std::optional<net::ring> ring;             // on node leaders with inter_node == sockets
    std::vector<std::byte> ring_staging;       // packs a group of several tensors for the ring
    std::unique_ptr<detail::job_queue> queue;  // several nodes over sockets; destroyed first

    state() = default;
    state(const state&) = delete;
    state& operator=(const state&) = delete;
    // Allreduces still queued when the communicator goes: fail them fast rather than let them
    // wait for peers until the timeout, then stop the queue's thread.
    ~state() {
      if (queue && !queue->idle()) {
        broken = true;
        if (engine) engine->abort(1);
        if (ring) ring->abort();
      }
      queue.reset();
    }
  };

  void live(const char* what) const {
    if (!s_) throw usage_error(-1, what, "use of a moved-from shm::communicator");
  }

  static void check_options(const shm::options& o, int rank) {
    if (o.chunk_bytes == 0) throw usage_error(rank, "shm::communicator", "options::chunk_bytes must be positive");
  }

  static std::string leaders_problem(const node_topology& t, const std::optional<Cross>& leaders) {
    if (!leaders) {
      return "the ranks span " + std::to_string(t.nodes) +
             " nodes: the leaders need a communicator among themselves (pass make_leaders, or use "
             "shm::mpi::make_communicator)";
    }
    if (leaders->size() != t.nodes || leaders->rank() != t.node) {
      return "the leaders' communicator has rank " + std::to_string(leaders->rank()) + " of " +
             std::to_string(leaders->size()) + "; node " + std::to_string(t.node) + " of " + std::to_string(t.nodes) +
             " expected";
    }
    return {};
  }

  // Every rank learns whether set-up failed anywhere, so all throw together.
  void agree_or_throw(const std::string& problem, const node_topology& t) {
    std::vector<std::uint8_t> mine{problem.empty() ? std::uint8_t{0} : std::uint8_t{1}};
    std::vector<std::uint8_t> all(static_cast<std::size_t>(t.size));
    inner_.allgather(view(mine), view(all)).wait();
    for (std::size_t r = 0; r < all.size(); ++r) {
      if (all[r] == 0) continue;
      throw usage_error(t.rank, "shm::communicator",
                        static_cast<int>(r) == t.rank ? problem : "set-up failed on rank " + std::to_string(r));
    }
  }

  void assemble(shm::options opts, node_parts<Cross> parts) {
    s_ = std::make_unique<state>();
    s_->opts = std::move(opts);
    s_->topology = std::move(parts.topology);
    s_->shared = std::move(parts.shared);
    leaders_ = std::move(parts.leaders);
    s_->ring = std::move(parts.ring);
    s_->rank = inner_.rank();
    s_->size = inner_.size();
    // The inter-node step over sockets leaves MPI alone: it can run on a thread of its own.
    if (s_->topology.nodes > 1 && s_->opts.inter_node == across_nodes::sockets) {
      s_->queue = std::make_unique<detail::job_queue>();
    }
    const node_topology& t = s_->topology;
    if (s_->shared) {
      // More ranks than CPUs: the peer a rank waits for may need this very core, so never spin.
      const unsigned cpus = std::thread::hardware_concurrency();
      const bool oversubscribed = cpus != 0 && static_cast<unsigned>(t.node_size) > cpus;
      s_->engine.emplace(s_->shared->data(), parts.layout, t.node_rank, t.node_ranks(),
                         oversubscribed ? 0u : s_->opts.spins_before_yield, s_->opts.single_phase_bytes);
      if (parts.layout.arena_bytes() > 0) {
        s_->pool = std::make_shared<shm::arena>(s_->shared->data() + parts.layout.arena(t.node_rank),
                                                parts.layout.arena_bytes(), s_->shared);
      }
    } else if (s_->opts.arena_bytes > 0) {
      // Alone on the node: nobody to share with, but allocate() must still work. Back the
      // arena with private memory (never zero-copy relevant: there is no staging either).
      auto mem = std::shared_ptr<std::byte[]>(new std::byte[round_up(s_->opts.arena_bytes, page_bytes) + page_bytes]);
      auto* aligned = reinterpret_cast<std::byte*>(round_up(reinterpret_cast<std::uintptr_t>(mem.get()), page_bytes));
      s_->pool = std::make_shared<shm::arena>(aligned, round_up(s_->opts.arena_bytes, page_bytes), mem);
    }
  }

  // The calling rank, for the allreduce's contract check (backend_contract.hpp). Caller holds
  // the mutex (it guards the sequence number).
  contract::caller caller() const {
    return {rank(), size(), s_->seq, s_->opts.timeout, contract::memory_rule::host("the shared-memory allreduce")};
  }

  // One group per dtype (in dtype order, which every rank derives from the same call).
  static std::vector<tensor_group> groups_of(const state& st, std::span<const tensor_view> tensors) {
    std::array<tensor_group, dtype_count> by_type{};
    for (const tensor_view& t : tensors) {
      if (t.count == 0) continue;
      auto& g = by_type[static_cast<std::size_t>(t.type)];
      g.type = t.type;
      g.add(t);
    }
    std::vector<tensor_group> out;
    for (auto& g : by_type) {
      if (g.total == 0) continue;
      if (g.parts.size() == 1 && st.shared && st.pool && st.pool->contains(g.parts[0].data, g.parts[0].bytes())) {
        g.zero_copy_offset = static_cast<std::size_t>(g.parts[0].byte_data() - st.shared->data());
      }
      out.push_back(std::move(g));
    }
    return out;
  }

  // Runs the allreduce; a failure marks the communicator broken (peers in shared memory fail at
  // once) and propagates.
  static void run_or_break(state& st, Cross* leaders, std::span<const tensor_view> tensors, reduce_op op,
                           const op_info& info, double factor) {
    try {
      run(st, leaders, tensors, op, info, factor);
    } catch (const usage_error&) {
      throw;
    } catch (...) {
      st.broken = true;
      if (st.engine) st.engine->abort(2);
      throw;
    }
  }

  static void run(state& st, Cross* leaders, std::span<const tensor_view> tensors, reduce_op op, const op_info& info,
                  double factor) {
    const clock::time_point deadline = clock::now() + st.opts.timeout;
    const node_topology& t = st.topology;
    const auto groups = groups_of(st, tensors);
    const std::int64_t world = st.size;
    if (t.nodes == 1) {
      for (std::size_t k = 0; k < groups.size(); ++k) {
        st.engine->run(node_phase::allreduce, groups[k], static_cast<std::uint32_t>(k), op,
                       op == reduce_op::avg ? world : 1, info, deadline, factor);
      }
      return;
    }
    // Several nodes: reduce to the leader, leaders allreduce, broadcast from the leader.
    const reduce_op partial = op == reduce_op::avg ? reduce_op::sum : op;
    if (!st.engine) {  // alone on its node: nobody stages this rank's input, so scale it here
      for (const auto& g : groups) {
        for (const tensor_view& p : g.parts) ddp::detail::scale_in_place(p.type, p.data, p.count, factor);
      }
    } else {
      for (std::size_t k = 0; k < groups.size(); ++k) {
        st.engine->run(node_phase::reduce_to_leader, groups[k], static_cast<std::uint32_t>(k), partial, 1, info,
                       deadline, factor);
      }
    }
    if (t.is_leader()) {
      std::vector<tensor_view> parts;
      for (const auto& g : groups) parts.insert(parts.end(), g.parts.begin(), g.parts.end());
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now());
      if (st.ring) {
        const net::context ctx{st.rank, info.describe()};
        for (const auto& g : groups) ring_allreduce(st, g, partial, deadline, ctx);
      } else {
        leaders->allreduce(std::span<const tensor_view>(parts), partial)
            .wait_for(std::max(left, std::chrono::milliseconds(1)));
      }
      if (op == reduce_op::avg) {
        for (const auto& p : parts) ddp::detail::divide_in_place(p.type, p.data, p.count, world);
      }
    }
    if (st.engine) {
      for (std::size_t k = 0; k < groups.size(); ++k) {
        st.engine->run(node_phase::broadcast, groups[k], static_cast<std::uint32_t>(k), op, 1, info, deadline);
      }
    }
  }

  // One dtype's tensors over the sockets ring, as one sequence: ranks may split the same
  // elements into different tensors (a gradient moved out of its bucket on one rank only), so a
  // group of several tensors travels packed.
  static void ring_allreduce(state& st, const tensor_group& g, reduce_op op, clock::time_point deadline,
                             const net::context& ctx) {
    if (g.parts.size() == 1) return st.ring->allreduce(g.parts[0], op, deadline, ctx);
    const std::size_t width = size_of(g.type);
    st.ring_staging.resize(g.total * width);
    for (std::size_t k = 0; k < g.parts.size(); ++k) {
      std::memcpy(st.ring_staging.data() + g.starts[k] * width, g.parts[k].data, g.parts[k].bytes());
    }
    st.ring->allreduce(tensor_view{st.ring_staging.data(), g.total, g.type}, op, deadline, ctx);
    for (std::size_t k = 0; k < g.parts.size(); ++k) {
      std::memcpy(g.parts[k].data, st.ring_staging.data() + g.starts[k] * width, g.parts[k].bytes());
    }
  }

  Inner inner_;
  std::optional<Cross> leaders_;
  std::unique_ptr<state> s_;
};

}  // namespace ddp::shm
