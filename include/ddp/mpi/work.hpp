#pragma once
/// @file mpi/work.hpp
/// @brief `detail::mpi_work`: the state behind every `ddp::work` the MPI backend returns.
///
/// One object per collective (the only allocation of a small allreduce). It holds the MPI
/// request(s) or ring(s) of the call, the staging memory of coalesced calls, and what to do on
/// completion (divide for `avg`, copy staging back into the tensors). `poll()` drives it with
/// MPI_Test: Open MPI makes no progress between MPI calls.
///
/// Abandoning it while pending (handle destroyed, failed, or aborted) cannot cancel the
/// collective: it keeps driving it up to its timeout, then deliberately leaks the requests and
/// every buffer MPI may still write, and says so on stderr. Work whose wait timed out is leaked
/// at once; work pending when the communicator failed or was aborted shares one deadline. A
/// tensor reduced in place is the caller's memory: after a leak MPI may still write it if the
/// peers eventually join, so a timed-out collective should be treated as fatal (or the tensor
/// kept alive).
///
/// Failures (an MPI error, a timed-out wait, an abandon that ran out of time) are recorded in the
/// communicator's state, and from there in the environment the communicator was made with.

#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/detail/host_reduce.hpp>
#include <ddp/error.hpp>
#include <ddp/mpi/allreduce_selector.hpp>
#include <ddp/mpi/comm_state.hpp>
#include <ddp/mpi/error.hpp>
#include <ddp/mpi/halving_doubling.hpp>
#include <ddp/mpi/p2p_allreduce.hpp>
#include <ddp/mpi/recursive_doubling.hpp>
#include <ddp/mpi/ring_allreduce.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp::mpi::detail {

class mpi_work final : public work_state {
 public:
  mpi_work(std::shared_ptr<comm_state> comm, const op_info& info) : work_state(info), comm_(std::move(comm)) {}
  mpi_work(const mpi_work&) = delete;
  mpi_work& operator=(const mpi_work&) = delete;

  /// Never frees memory MPI may still write: whatever is still pending here is leaked.
  ~mpi_work() override {
    if (in_flight()) leak("destroyed while pending");
  }

  // --- building (by the communicator, while issuing) -------------------------------------------

  /// Where to store the next MPI request of this operation.
  MPI_Request* new_request() {
    if (!first_used_) {
      first_used_ = true;
      return &request_;
    }
    return &more_requests_.emplace_back(MPI_REQUEST_NULL);
  }

  /// Adds ddp's own allreduce `a` (ring, recursive doubling or halving-doubling) of `region` and
  /// posts its first messages. At most `comm_state::streams_per_op` per operation (one per dtype
  /// group).
  void add_p2p(algorithm a, tensor_view region, reduce_op op) {
    const std::uint64_t stream = rings_.size();
    switch (a) {
      case algorithm::ring:
        rings_.push_back(std::make_unique<ring_allreduce>(*comm_, info(), region, op, stream));
        break;
      case algorithm::recursive_doubling:
        rings_.push_back(std::make_unique<recursive_doubling_allreduce>(*comm_, info(), region, op, stream));
        break;
      case algorithm::halving_doubling:
        rings_.push_back(std::make_unique<halving_doubling_allreduce>(*comm_, info(), region, op, stream));
        break;
      case algorithm::mpi_iallreduce: return;  // not point-to-point: the communicator issues it
    }
    start_last();
  }

 private:
  void start_last() {
    try {
      rings_.back()->progress();
    } catch (const communication_error& e) {
      comm_->note_failure(info(), e.what());
      throw;
    }
  }

 public:
  /// Allocates staging memory owned by this operation (uninitialised).
  std::byte* add_staging(std::size_t bytes) {
    staged_bytes_ += bytes;
    return staging_.emplace_back(std::make_unique_for_overwrite<std::byte[]>(bytes)).get();
  }

  /// On completion, divide `v` by the communicator size (for `avg`). Runs before copy-backs.
  void divide_on_completion(tensor_view v) {
    if (v.count == 0) return;
    if (divide_.count == 0) {
      divide_ = v;
    } else {
      more_divides_.push_back(v);
    }
  }

  /// On completion, copy `to.bytes()` bytes from `from` into `to`.
  void copy_on_completion(const std::byte* from, tensor_view to) { copies_.push_back({from, to}); }

  // --- work_state ------------------------------------------------------------------------------

  bool poll() override {
    if (finished_) return true;
    if (comm_->aborted()) [[unlikely]] {
      throw communication_error(info().rank, info().describe(),
                                "the communicator was aborted (abort()) while this operation was pending");
    }
    comm_->check_thread(info().name);
    try {
      if (!drive()) return false;
    } catch (const communication_error& e) {
      comm_->note_failure(info(), e.what());
      throw;
    }
    finish();
    return true;
  }

  // Open MPI moves a request only inside MPI calls, and ddp's ring only when its handle is tested.
  [[nodiscard]] ddp::detail::progress_mode progress() const noexcept override {
    return ddp::detail::progress_mode::polled;
  }

  // Spins on MPI_Test like a blocking MPI call would: the caller has nothing else to do, and
  // every test is progress. Yields after a while (oversubscribed ranks), and polls gently once
  // a wait has lasted a second (a hung peer should not burn a core until the timeout). A
  // deadline already past costs one test: work::wait_all expires every pending part that way,
  // and on an oversubscribed node each MPI_Test may yield the core.
  bool wait_until(clock::time_point deadline) override {
    const auto start = clock::now();
    for (unsigned spins = 1;; ++spins) {
      if (poll()) return true;
      if (spins >= 1024) std::this_thread::yield();
      if (spins % 64 == 0 || spins == 1) {
        const auto now = clock::now();
        if (now >= deadline) {
          timed_out_ = true;
          comm_->note_failure(info(), "its wait timed out");
          return false;
        }
        if (now - start > std::chrono::seconds(1)) std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    }
  }

  // MPI cannot cancel a collective, and an in-place one writes the caller's tensor: wait for it
  // (driving it) up to its timeout, then leak what MPI may still write. Work pending when the
  // communicator was aborted or first failed shares one deadline (comm_state::abandon_deadline),
  // so N pending operations never cost N timeouts. A work whose wait already timed out is leaked
  // at once.
  void abandon() noexcept override {
    if (!in_flight()) return;
    if (!timed_out_ && can_call_mpi()) {
      const auto now = clock::now();
      const auto deadline = comm_->abandon_deadline(info(), now);
      for (unsigned spins = 1; in_flight() && advance_quietly(); ++spins) {
        if (spins % 64 == 0 && clock::now() >= deadline) break;
        if (clock::now() - now > std::chrono::seconds(1)) {
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        } else {
          std::this_thread::yield();
        }
      }
    }
    if (in_flight()) {
      if (!timed_out_) comm_->note_failure(info(), "abandoned, and did not complete within its timeout");
      leak(timed_out_ ? "abandoned after its wait timed out" : "abandoned, and did not complete within its timeout");
    }
  }

 private:
  struct copy_back {
    const std::byte* from;
    tensor_view to;
  };

  [[nodiscard]] bool can_call_mpi() const noexcept { return mpi_running() && comm_->may_call_mpi_here(); }

  // Tests every request and advances every ring; true once all completed. Throws mpi_error.
  bool drive() {
    bool complete = test(request_);
    for (MPI_Request& r : more_requests_) complete = test(r) && complete;
    for (auto& ring : rings_) complete = ring->progress() && complete;
    return complete;
  }

  // drive() for noexcept paths; false if the operation failed (poll reports such errors).
  bool advance_quietly() noexcept {
    try {
      (void)drive();
      return true;
    } catch (...) {
      return false;
    }
  }

  bool test(MPI_Request& r) {
    if (r == MPI_REQUEST_NULL) return true;
    int flag = 0;
    int rc = MPI_SUCCESS;
    {
      call_guard guard(*comm_);
      rc = MPI_Test(&r, &flag, MPI_STATUS_IGNORE);
    }
    check(rc, info(), "MPI_Test");
    return flag != 0;
  }

  void finish() {
    const int n = comm_->size();
    if (divide_.count) ddp::detail::divide_in_place(divide_.type, divide_.data, divide_.count, n);
    for (const tensor_view& v : more_divides_) ddp::detail::divide_in_place(v.type, v.data, v.count, n);
    for (const copy_back& c : copies_) std::memcpy(c.to.data, c.from, c.to.bytes());
    finished_ = true;
    staging_.clear();
    rings_.clear();
  }

  [[nodiscard]] bool in_flight() const noexcept {
    if (finished_) return false;
    if (request_ != MPI_REQUEST_NULL) return true;
    for (MPI_Request r : more_requests_) {
      if (r != MPI_REQUEST_NULL) return true;
    }
    for (const auto& ring : rings_) {
      if (ring->in_flight()) return true;
    }
    return false;
  }

  // Deliberately never frees what MPI may still write, and keeps the communicator's MPI objects
  // alive for the leaked requests. One line on stderr says what was leaked.
  void leak(const char* why) noexcept {
    const std::size_t bytes = staged_bytes_;
    for (auto& s : staging_) (void)s.release();
    for (auto& ring : rings_) {
      if (ring->in_flight()) (void)ring.release();
    }
    request_ = MPI_REQUEST_NULL;
    for (MPI_Request& r : more_requests_) r = MPI_REQUEST_NULL;
    comm_->note_leak();
    finished_ = true;
    try {
      std::fprintf(stderr,
                   "ddp: rank %d, %s: %s; leaking its MPI requests and %zu bytes of staging memory (MPI cannot "
                   "cancel a collective)\n",
                   info().rank, info().describe().c_str(), why, bytes);
    } catch (...) {
      std::fprintf(stderr, "ddp: rank %d, %s #%llu: %s; leaking its MPI requests\n", info().rank, info().name,
                   static_cast<unsigned long long>(info().seq), why);
    }
  }

  std::shared_ptr<comm_state> comm_;
  MPI_Request request_ = MPI_REQUEST_NULL;  // the one request of most operations
  bool first_used_ = false;
  bool finished_ = false;
  bool timed_out_ = false;
  tensor_view divide_{nullptr, 0, dtype::f32, device::host()};
  std::vector<MPI_Request> more_requests_;  // further dtype groups, or chunks above INT_MAX elements
  std::vector<std::unique_ptr<p2p_allreduce>>
      rings_;  // ddp's own algorithms (ring, recursive doubling, halving-doubling)
  std::vector<std::unique_ptr<std::byte[]>> staging_;
  std::size_t staged_bytes_ = 0;
  std::vector<tensor_view> more_divides_;
  std::vector<copy_back> copies_;
};

}  // namespace ddp::mpi::detail
