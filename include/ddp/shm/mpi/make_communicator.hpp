#pragma once
/// @file shm/mpi/make_communicator.hpp
/// @brief `shm::mpi::make_communicator`: a shared-memory communicator over MPI processes — the
/// node found with MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) (or `options::node_of_rank`), its
/// segment an MPI-3 shared window (or POSIX shared memory), and the node leaders' communicator
/// split off for the hierarchical path. Link `ddp::mpi`.

#include <mpi.h>

#include <climits>
#include <exception>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include <ddp/error.hpp>
#include <ddp/mpi/communicator.hpp>
#include <ddp/mpi/environment.hpp>
#include <ddp/mpi/error.hpp>
#include <ddp/mpi/options.hpp>
#include <ddp/shm/communicator.hpp>
#include <ddp/shm/layout.hpp>
#include <ddp/shm/mpi/window_segment.hpp>
#include <ddp/shm/options.hpp>
#include <ddp/shm/posix_segment.hpp>
#include <ddp/shm/segment.hpp>
#include <ddp/shm/topology.hpp>

namespace ddp::shm {

/// A shared-memory communicator wrapping the MPI backend.
using mpi_communicator = communicator<::ddp::mpi::communicator>;

namespace mpi {

/// Where the node's segment lives.
enum class segment_backing : unsigned char {
  window,  ///< MPI_Win_allocate_shared (freed by `close()`, else at process exit)
  posix,   ///< shm_open + mmap, name agreed over the wrapped communicator (unmapped by the destructor)
};

/// MPI-specific set-up knobs.
struct setup_options {
  ::ddp::mpi::options inner{};                        ///< options of the wrapped and the leaders' MPI communicators
  segment_backing backing = segment_backing::window;  ///< where the node's segment lives

  /// Memberwise.
  friend bool operator==(const setup_options&, const setup_options&) = default;
  /// Writes `{inner: ..., backing: window|posix}`.
  friend std::ostream& operator<<(std::ostream& os, const setup_options& o) {
    return os << "{inner: " << o.inner << ", backing: " << (o.backing == segment_backing::window ? "window" : "posix")
              << "}";
  }
};

namespace detail {

/// An MPI_Comm freed when it goes out of scope (set-up only; MPI must still be running).
class owned_comm {
 public:
  owned_comm() = default;
  owned_comm(const owned_comm&) = delete;
  owned_comm& operator=(const owned_comm&) = delete;
  ~owned_comm() {
    if (c_ != MPI_COMM_NULL) MPI_Comm_free(&c_);
  }
  MPI_Comm* out() noexcept { return &c_; }
  [[nodiscard]] MPI_Comm get() const noexcept { return c_; }

 private:
  MPI_Comm c_ = MPI_COMM_NULL;
};

inline void check(int code, int rank, const char* call) {
  if (code != MPI_SUCCESS) [[unlikely]] {
    throw ::ddp::mpi::mpi_error(rank, "shm::mpi::make_communicator", call, code);
  }
}

}  // namespace detail

namespace detail {

// A simulated node (`node_of_rank`) must lie within one real node: its ranks share one segment.
// Collective over `all`; the same usage_error on every rank when some simulated node spans hosts.
inline void check_within_hosts(MPI_Comm all, MPI_Comm simulated, int rank, int simulated_node) {
  owned_comm real;
  check(MPI_Comm_split_type(all, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, real.out()), rank, "MPI_Comm_split_type");
  int host = rank;  // the real node's lowest rank names it
  check(MPI_Allreduce(MPI_IN_PLACE, &host, 1, MPI_INT, MPI_MIN, real.get()), rank, "MPI_Allreduce");
  int span[2] = {host, -host};  // lowest and (negated) highest host among the simulated node's ranks
  check(MPI_Allreduce(MPI_IN_PLACE, span, 2, MPI_INT, MPI_MIN, simulated), rank, "MPI_Allreduce");
  int spanning = span[0] != -span[1] ? simulated_node : -1;
  check(MPI_Allreduce(MPI_IN_PLACE, &spanning, 1, MPI_INT, MPI_MAX, all), rank, "MPI_Allreduce");
  if (spanning >= 0) {
    throw usage_error(rank, "shm::mpi::make_communicator",
                      "node_of_rank puts ranks of different hosts in node " + std::to_string(spanning) +
                          ": the ranks of a node share its memory, so they must run on one host");
  }
}

// make_communicator's body; `env` (may be null) records the MPI communicators' failures.
[[nodiscard]] inline mpi_communicator make(const ::ddp::mpi::environment* env, MPI_Comm parent, options opts,
                                           const setup_options& setup) {
  const auto mpi_comm = [&](MPI_Comm c) {  // duplicates c; throws if MPI is not running
    return env ? ::ddp::mpi::communicator(*env, c, setup.inner) : ::ddp::mpi::communicator(c, setup.inner);
  };
  ::ddp::mpi::communicator inner = mpi_comm(parent);
  const int rank = inner.rank();
  const int size = inner.size();

  // Set-up traffic goes over a private duplicate that returns errors instead of aborting.
  detail::owned_comm work;
  detail::check(MPI_Comm_dup(parent, work.out()), rank, "MPI_Comm_dup");
  detail::check(MPI_Comm_set_errhandler(work.get(), MPI_ERRORS_RETURN), rank, "MPI_Comm_set_errhandler");

  detail::owned_comm node;
  if (!opts.node_of_rank.empty()) {
    if (static_cast<int>(opts.node_of_rank.size()) != size) {
      throw usage_error(rank, "shm::mpi::make_communicator",
                        "node_of_rank has " + std::to_string(opts.node_of_rank.size()) +
                            " entries for a communicator of size " + std::to_string(size));
    }
    const node_topology given = node_topology::from_labels(rank, opts.node_of_rank);
    detail::check(MPI_Comm_split(work.get(), given.node, rank, node.out()), rank, "MPI_Comm_split");
    check_within_hosts(work.get(), node.get(), rank, given.node);
  } else {
    detail::check(MPI_Comm_split_type(work.get(), MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, node.out()), rank,
                  "MPI_Comm_split_type");
  }
  // Label every rank by its node's lowest rank: the same numbering on every rank.
  int leader = rank;
  detail::check(MPI_Allreduce(MPI_IN_PLACE, &leader, 1, MPI_INT, MPI_MIN, node.get()), rank, "MPI_Allreduce");
  std::vector<int> labels(static_cast<std::size_t>(size));
  detail::check(MPI_Allgather(&leader, 1, MPI_INT, labels.data(), 1, MPI_INT, work.get()), rank, "MPI_Allgather");

  node_parts<::ddp::mpi::communicator> parts;
  parts.topology = node_topology::from_labels(rank, labels);
  parts.layout = segment_layout(parts.topology.node_size, opts.chunk_bytes, opts.arena_bytes, rank);
  const node_topology& t = parts.topology;

  if (setup.backing == segment_backing::posix) {
    parts.shared = open_posix_segment(inner, t, parts.layout);  // collective over inner; agrees on errors
  } else {
    std::exception_ptr problem;
    int kind = INT_MAX;  // of this rank's failure: 0 inconsistent options, 1 no shared memory
    if (t.node_size > 1) {
      try {
        const segment_layout& layout = parts.layout;
        auto seg = window_segment::allocate(node.get(), layout.total_bytes(), layout.slot(0, 0), rank,
                                            [&](std::byte* data) { layout.initialise(data); });
        layout.check(seg->data(), rank);
        parts.shared = std::move(seg);
      } catch (const usage_error&) {
        problem = std::current_exception();
        kind = 0;
      } catch (const error&) {
        problem = std::current_exception();
        kind = 1;
      }
    }
    // Every rank learns the first failure, and throws the same type.
    struct {
      int kind;
      int rank;
    } first{kind, rank};
    detail::check(MPI_Allreduce(MPI_IN_PLACE, &first, 1, MPI_2INT, MPI_MINLOC, work.get()), rank, "MPI_Allreduce");
    if (first.kind != INT_MAX) {
      if (problem && kind == first.kind) std::rethrow_exception(problem);
      const std::string what = "rank " + std::to_string(first.rank) + " could not set up its node's shared window";
      if (first.kind == 0)
        throw usage_error(rank, "shm::mpi::make_communicator", what + ": ranks passed different options");
      throw segment_error(rank, "shm::mpi::make_communicator", what);
    }
  }

  if (t.nodes > 1) {
    detail::owned_comm leaders;
    detail::check(MPI_Comm_split(work.get(), t.is_leader() ? 0 : MPI_UNDEFINED, rank, leaders.out()), rank,
                  "MPI_Comm_split");
    if (t.is_leader()) parts.leaders.emplace(mpi_comm(leaders.get()));
    // The leaders' sockets ring (options::inter_node); every rank learns whether one failed.
    std::string problem;
    if (t.is_leader() && opts.inter_node == across_nodes::sockets) {
      try {
        parts.ring.emplace(connect_leaders_ring(*parts.leaders, opts));
      } catch (const error& e) {
        problem = e.message();
      }
    }
    struct {
      int failed;
      int rank;
    } first{problem.empty() ? 0 : 1, problem.empty() ? INT_MAX : rank};
    detail::check(MPI_Allreduce(MPI_IN_PLACE, &first, 1, MPI_2INT, MPI_MAXLOC, work.get()), rank, "MPI_Allreduce");
    if (first.failed) {
      throw communication_error(
          rank, "shm::mpi::make_communicator",
          problem.empty() ? "rank " + std::to_string(first.rank) + " could not connect the node leaders' sockets ring"
                          : problem);
    }
  }
  return mpi_communicator(std::move(inner), std::move(opts), std::move(parts));
}

}  // namespace detail

/// Builds the shared-memory communicator over `parent`. Collective over `parent`.
/// @throws segment_error (every rank) if the node's memory cannot be allocated or mapped
/// @throws usage_error (every rank) if ranks of a node passed different options; mpi_error if an MPI call fails
[[nodiscard]] inline mpi_communicator make_communicator(MPI_Comm parent, options opts = {}, setup_options setup = {}) {
  return detail::make(nullptr, parent, std::move(opts), setup);
}

/// As above, with its MPI communicators made with `env` (a failure is recorded there, so that
/// `env`'s destructor does not block in MPI_Finalize; see `ddp::mpi::environment`).
[[nodiscard]] inline mpi_communicator make_communicator(const ::ddp::mpi::environment& env, MPI_Comm parent,
                                                        options opts = {}, setup_options setup = {}) {
  return detail::make(&env, parent, std::move(opts), setup);
}

/// `make_communicator(MPI_COMM_WORLD, ...)`.
[[nodiscard]] inline mpi_communicator world(options opts = {}, setup_options setup = {}) {
  return make_communicator(MPI_COMM_WORLD, std::move(opts), std::move(setup));
}

/// `make_communicator(env, MPI_COMM_WORLD, ...)`.
[[nodiscard]] inline mpi_communicator world(const ::ddp::mpi::environment& env, options opts = {},
                                            setup_options setup = {}) {
  return make_communicator(env, MPI_COMM_WORLD, std::move(opts), std::move(setup));
}

}  // namespace mpi
}  // namespace ddp::shm
