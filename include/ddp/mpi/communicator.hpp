#pragma once
/// @file mpi/communicator.hpp
/// @brief `ddp::mpi::communicator`: the MPI backend of the `ddp::communicator` concept.
///
/// Owns a duplicate of the MPI_Comm it is built from; host memory only; non-blocking collectives
/// that move only while their work is tested. Allreduce algorithms, scratch memory, threads,
/// errors and teardown: docs/communicators.md ("The MPI backend").

#include <mpi.h>

#include <array>
#include <climits>
#include <cstddef>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include <ddp/backend_contract.hpp>
#include <ddp/communicator.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/mpi/allreduce_selector.hpp>
#include <ddp/mpi/comm_state.hpp>
#include <ddp/mpi/environment.hpp>
#include <ddp/mpi/error.hpp>
#include <ddp/mpi/options.hpp>
#include <ddp/mpi/thread_level.hpp>
#include <ddp/mpi/work.hpp>
#include <ddp/reduce_op.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp::mpi {

/// One rank's handle on a group of MPI processes. Move-only.
class communicator : public single_tensor_calls<communicator> {
 public:
  using single_tensor_calls<communicator>::allreduce;
  using single_tensor_calls<communicator>::broadcast;

  /// Duplicates `comm` (collective over it). Throws `usage_error` if MPI is not running.
  explicit communicator(MPI_Comm comm, mpi::options opts = {})
      : state_(std::make_shared<detail::comm_state>(comm, opts)), rank_(state_->rank()), size_(state_->size()) {}

  /// As above, made with `env`: a communication failure of this communicator (an MPI error, a
  /// timed-out wait, `abort()`) is recorded in `env`, whose destructor then does not block in
  /// MPI_Finalize even if the program caught the error. `env` need not outlive it.
  communicator(const environment& env, MPI_Comm comm, mpi::options opts = {})
      : state_(std::make_shared<detail::comm_state>(comm, opts, env.failures_)),
        rank_(state_->rank()),
        size_(state_->size()) {}

  /// A communicator over all processes (duplicates MPI_COMM_WORLD).
  [[nodiscard]] static communicator world(mpi::options opts = {}) {
    return communicator(MPI_COMM_WORLD, std::move(opts));
  }

  /// A communicator over all processes, made with `env` (see the constructor).
  [[nodiscard]] static communicator world(const environment& env, mpi::options opts = {}) {
    return communicator(env, MPI_COMM_WORLD, std::move(opts));
  }

  /// Moves the handle; the moved-from communicator refuses every call with `usage_error`.
  communicator(communicator&&) noexcept = default;
  /// Moves the handle; the previous one is released as by the destructor.
  communicator& operator=(communicator&&) noexcept = default;
  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;
  /// Frees the duplicate once no work uses it any more (never after MPI_Finalize).
  ~communicator() = default;

  /// This process's rank in the communicator.
  [[nodiscard]] int rank() const { return rank_; }
  /// Number of processes.
  [[nodiscard]] int size() const { return size_; }
  /// The options it was built with. (`mpi::options` names the type inside this class, where
  /// `options` is this function.)
  [[nodiscard]] const mpi::options& options() const { return live("options").options(); }
  /// Thread level in effect (what MPI provides, capped by `options::max_thread_level`).
  [[nodiscard]] thread_level threads() const { return live("threads").level(); }
  /// The duplicated MPI communicator, for inspection. Issuing collectives on it would desync
  /// ddp's sequence; use the parent communicator for the program's own traffic.
  [[nodiscard]] MPI_Comm native_handle() const { return live("native_handle").comm(); }
  /// Allreduces (per dtype group) of at least this many bytes run ddp's ring:
  /// `options::ring_min_bytes * (size() - 1)`; `options::never` on one rank.
  [[nodiscard]] std::size_t ring_threshold() const { return live("ring_threshold").ring_threshold(); }
  /// Number of collectives issued so far (the next one's sequence number).
  [[nodiscard]] std::uint64_t issued() const { return live("issued").peek_seq(); }

  /// In-place allreduce of `tensors` (one coalesced call; dtypes may differ).
  work allreduce(std::span<const tensor_view> tensors, reduce_op op) {
    detail::comm_state& s = begin("allreduce");
    auto w = issue(s, contract::check_allreduce(caller(s), tensors, op));
    if (!w) return work::ready();
    if (tensors.size() == 1) {
      allreduce_region(s, *w, tensors[0], op);
    } else {
      allreduce_grouped(s, *w, tensors, op);
    }
    return work(std::move(w));
  }

  /// In-place broadcast of `tensors` from `root` (one coalesced call).
  work broadcast(std::span<const tensor_view> tensors, int root) {
    detail::comm_state& s = begin("broadcast");
    auto w = issue(s, contract::check_broadcast(caller(s), tensors, root));
    if (!w) return work::ready();
    std::size_t non_empty = 0;
    const tensor_view* only = nullptr;
    std::size_t bytes = 0;
    for (const tensor_view& t : tensors) {
      if (t.count == 0) continue;
      ++non_empty;
      only = &t;
      bytes += t.bytes();
    }
    if (non_empty == 1) {
      ibcast(s, *w, only->byte_data(), only->count, s.types().datatype(only->type), size_of(only->type), root);
    } else {
      // One byte buffer for all tensors: a broadcast does not care about dtypes.
      std::byte* staging = w->add_staging(bytes);
      std::size_t offset = 0;
      for (const tensor_view& t : tensors) {
        if (t.count == 0) continue;
        if (rank_ == root) {
          std::memcpy(staging + offset, t.data, t.bytes());
        } else {
          w->copy_on_completion(staging + offset, t);
        }
        offset += t.bytes();
      }
      ibcast(s, *w, staging, bytes, MPI_BYTE, 1, root);
    }
    return work(std::move(w));
  }

  /// `out.count == in.count * size()`; rank r's `in` lands at `out[r * in.count]`. `in` may be
  /// that slice of `out` (in-place allgather); other overlaps are rejected.
  work allgather(tensor_view in, tensor_view out) {
    detail::comm_state& s = begin("allgather");
    const op_info info = contract::check_allgather(caller(s), in, out);
    const bool in_place = contract::is_in_place_allgather(rank_, in, out);
    check_count(info, in.count);
    auto w = issue(s, info);
    if (!w) return work::ready();
    const MPI_Datatype type = s.types().datatype(in.type);
    const int n = static_cast<int>(in.count);
    int rc = MPI_SUCCESS;
    {
      detail::call_guard guard(s);
      rc = MPI_Iallgather(in_place ? MPI_IN_PLACE : in.data, n, type, out.data, n, type, s.comm(), w->new_request());
    }
    s.check_issue(rc, w->info(), "MPI_Iallgather");
    return work(std::move(w));
  }

  /// `in.count == out.count * size()`; rank r gets block r of the reduction. No overlap allowed.
  work reduce_scatter(tensor_view in, tensor_view out, reduce_op op) {
    detail::comm_state& s = begin("reduce_scatter");
    const op_info info = contract::check_reduce_scatter(caller(s), in, out, op);
    check_count(info, out.count);
    auto w = issue(s, info);
    if (!w) return work::ready();
    int rc = MPI_SUCCESS;
    {
      detail::call_guard guard(s);
      rc = MPI_Ireduce_scatter_block(in.data, out.data, static_cast<int>(out.count), s.types().datatype(out.type),
                                     s.types().op(out.type, op), s.comm(), w->new_request());
    }
    s.check_issue(rc, w->info(), "MPI_Ireduce_scatter_block");
    if (op == reduce_op::avg) w->divide_on_completion(out);
    return work(std::move(w));
  }

  /// Completes once every rank called it.
  work barrier() {
    detail::comm_state& s = begin("barrier");
    op_info info = contract::check_barrier(caller(s));
    info.seq = s.next_seq();
    auto w = std::make_unique<detail::mpi_work>(state_, info);
    int rc = MPI_SUCCESS;
    {
      detail::call_guard guard(s);
      rc = MPI_Ibarrier(s.comm(), w->new_request());
    }
    s.check_issue(rc, info, "MPI_Ibarrier");
    return work(std::move(w));
  }

  /// Local: pending work of this communicator fails with `communication_error`, later calls
  /// throw `usage_error`. Peers are not told (they time out); MPI_Abort is never called. Counts
  /// as a communication failure for the environment the communicator was made with.
  /// MPI cannot cancel a collective, so the failing work first lets MPI finish with its buffers:
  /// at most until abort time + timeout, for all pending work together, after which whatever
  /// MPI may still write is leaked (see work.hpp).
  void abort() noexcept {
    if (state_) state_->abort();
  }

 private:
  static constexpr std::size_t max_count = INT_MAX;  // MPI counts are ints

  [[nodiscard]] const detail::comm_state& live(const char* what) const {
    if (!state_) throw usage_error(rank_, what, "use of a moved-from mpi::communicator");
    return *state_;
  }

  detail::comm_state& begin(const char* name) {
    if (!state_) [[unlikely]] {
      throw usage_error(rank_, name, "use of a moved-from mpi::communicator");
    }
    if (state_->aborted()) [[unlikely]] {
      throw usage_error(rank_, name, "communicator used after abort()");
    }
    state_->check_thread(name);
    return *state_;
  }

  // The calling rank, for the contract checks (backend_contract.hpp): the call would get the next
  // sequence number; host memory only.
  contract::caller caller(const detail::comm_state& s) const {
    return {rank_, size_, s.peek_seq(), s.options().timeout,
            contract::memory_rule::host("the MPI backend", "ddp does not assume a CUDA-aware MPI")};
  }

  // Numbers the checked call `info` and makes its work; null if it moves no element (then nothing
  // is issued, but the sequence number is taken on every rank alike).
  std::unique_ptr<detail::mpi_work> issue(detail::comm_state& s, op_info info) {
    info.seq = s.next_seq();
    if (info.count == 0) return nullptr;
    return std::make_unique<detail::mpi_work>(state_, info);
  }

  void check_count(const op_info& info, std::size_t per_rank) const {
    if (per_rank > max_count) {
      throw usage_error(rank_, info.describe(),
                        std::to_string(per_rank) + " elements per rank exceed MPI's limit of " +
                            std::to_string(max_count) + "; split the tensor");
    }
  }

  // Allreduce of one contiguous region in place by the algorithm the selector picks for its size:
  // ddp's ring, recursive doubling or halving-doubling, or MPI_Iallreduce (in chunks of at most
  // INT_MAX elements). `avg` divides on completion (ddp's own algorithms divide by themselves).
  void allreduce_region(detail::comm_state& s, detail::mpi_work& w, tensor_view region, reduce_op op) {
    if (region.count == 0) return;
    if (const algorithm a = s.select(region.bytes()); a != algorithm::mpi_iallreduce) {
      w.add_p2p(a, region, op);
      return;
    }
    const MPI_Datatype type = s.types().datatype(region.type);
    const MPI_Op mpi_op = s.types().op(region.type, op);
    for (std::size_t done = 0; done < region.count;) {
      const std::size_t n = std::min(max_count, region.count - done);
      int rc = MPI_SUCCESS;
      {
        detail::call_guard guard(s);
        rc = MPI_Iallreduce(MPI_IN_PLACE, region.byte_data() + done * size_of(region.type), static_cast<int>(n), type,
                            mpi_op, s.comm(), w.new_request());
      }
      s.check_issue(rc, w.info(), "MPI_Iallreduce");
      done += n;
    }
    if (op == reduce_op::avg) w.divide_on_completion(region);
  }

  // Coalesced allreduce: one region per dtype (a lone tensor in place, several through staging),
  // in dtype order, which every rank derives from the same call.
  void allreduce_grouped(detail::comm_state& s, detail::mpi_work& w, std::span<const tensor_view> tensors,
                         reduce_op op) {
    std::array<std::size_t, dtype_count> counts{};
    std::array<std::size_t, dtype_count> members{};
    std::array<const tensor_view*, dtype_count> lone{};
    for (const tensor_view& t : tensors) {
      if (t.count == 0) continue;
      const auto k = static_cast<std::size_t>(t.type);
      counts[k] += t.count;
      ++members[k];
      lone[k] = &t;
    }
    for (std::size_t k = 0; k < dtype_count; ++k) {
      if (members[k] == 0) continue;
      if (members[k] == 1) {
        allreduce_region(s, w, *lone[k], op);
        continue;
      }
      const auto type = static_cast<dtype>(k);
      std::byte* staging = w.add_staging(counts[k] * size_of(type));
      std::size_t offset = 0;
      for (const tensor_view& t : tensors) {
        if (t.count == 0 || t.type != type) continue;
        std::memcpy(staging + offset, t.data, t.bytes());
        offset += t.bytes();
      }
      allreduce_region(s, w, {staging, counts[k], type, device::host()}, op);
      offset = 0;
      for (const tensor_view& t : tensors) {
        if (t.count == 0 || t.type != type) continue;
        w.copy_on_completion(staging + offset, t);
        offset += t.bytes();
      }
    }
  }

  // MPI_Ibcast of `count` elements of `elem` bytes, in chunks of at most INT_MAX elements.
  void ibcast(detail::comm_state& s, detail::mpi_work& w, std::byte* data, std::size_t count, MPI_Datatype type,
              std::size_t elem, int root) {
    for (std::size_t done = 0; done < count;) {
      const std::size_t n = std::min(max_count, count - done);
      int rc = MPI_SUCCESS;
      {
        detail::call_guard guard(s);
        rc = MPI_Ibcast(data + done * elem, static_cast<int>(n), type, root, s.comm(), w.new_request());
      }
      s.check_issue(rc, w.info(), "MPI_Ibcast");
      done += n;
    }
  }

  std::shared_ptr<detail::comm_state> state_;
  int rank_ = -1;
  int size_ = 0;
};

static_assert(ddp::communicator<communicator>);

}  // namespace ddp::mpi
