#pragma once
/// @file mpi/comm_state.hpp
/// @brief `detail::comm_state`: what a communicator and its in-flight work share (the duplicated
/// MPI_Comm, datatypes, thread rules, abort flag, first failure, sequence counter). Held by
/// shared_ptr so work outliving its communicator never touches freed memory.

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/error.hpp>
#include <ddp/mpi/allreduce_selector.hpp>
#include <ddp/mpi/error.hpp>
#include <ddp/mpi/failure_record.hpp>
#include <ddp/mpi/options.hpp>
#include <ddp/mpi/thread_level.hpp>
#include <ddp/mpi/type_table.hpp>
#include <ddp/work.hpp>

namespace ddp::mpi::detail {

/// True while MPI may be called (initialised and not finalized).
[[nodiscard]] inline bool mpi_running() noexcept {
  int initialized = 0;
  int finalized = 1;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

class comm_state {
 public:
  /// Duplicates `parent` and sets up everything the collectives need. Collective over `parent`.
  /// Communication failures are also recorded in `failures` (an environment's), if not null.
  comm_state(MPI_Comm parent, const mpi::options& opts, std::shared_ptr<failure_record> failures = nullptr)
      : options_(opts), selector_(opts.selector()), owner_(std::this_thread::get_id()), failures_(std::move(failures)) {
    constexpr const char* where = "mpi::communicator";
    if (!mpi_running()) {
      throw usage_error(-1, where,
                        "MPI is not running: create a ddp::mpi::environment (or call MPI_Init_thread) first");
    }
    if (parent == MPI_COMM_NULL) throw usage_error(-1, where, "cannot build a communicator from MPI_COMM_NULL");
    int provided = MPI_THREAD_SINGLE;
    check(MPI_Query_thread(&provided), -1, where, "MPI_Query_thread");
    level_ = std::min(static_cast<thread_level>(provided), opts.max_thread_level.value_or(thread_level::multiple));
    if (provided < MPI_THREAD_SERIALIZED) {
      int main_thread = 0;
      MPI_Is_thread_main(&main_thread);
      if (!main_thread) {
        throw usage_error(-1, where,
                          "created on a thread other than the one that initialised MPI, but MPI provides only " +
                              std::string(name_of(static_cast<thread_level>(provided))) +
                              "; that needs MPI_THREAD_SERIALIZED or better");
      }
    }
    check(MPI_Comm_dup(parent, &comm_), -1, where, "MPI_Comm_dup");
    try {
      check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), -1, where, "MPI_Comm_set_errhandler");
      check(MPI_Comm_rank(comm_, &rank_), -1, where, "MPI_Comm_rank");
      check(MPI_Comm_size(comm_, &size_), rank_, where, "MPI_Comm_size");
      int* tag_ub = nullptr;
      int found = 0;
      check(MPI_Comm_get_attr(comm_, MPI_TAG_UB, &tag_ub, &found), rank_, where, "MPI_Comm_get_attr");
      if (found && tag_ub && *tag_ub > 0) tag_ub_ = *tag_ub;
      types_.create(rank_);
    } catch (...) {
      MPI_Comm_free(&comm_);
      throw;
    }
  }

  comm_state(const comm_state&) = delete;
  comm_state& operator=(const comm_state&) = delete;

  /// Frees the duplicated communicator and the datatypes, unless MPI is gone, MPI may not be
  /// called from this thread, or abandoned work may still use them (then they are leaked).
  ~comm_state() {
    if (!mpi_running() || !may_call_mpi_here() || leaked_.load() > 0) {
      types_.forget();
      return;
    }
    std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);
    if (serialize()) lock.lock();
    types_.release();
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  [[nodiscard]] MPI_Comm comm() const noexcept { return comm_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] const mpi::options& options() const noexcept { return options_; }
  [[nodiscard]] const type_table& types() const noexcept { return types_; }
  /// The algorithm of an allreduce region of `bytes` bytes on this communicator (see
  /// `allreduce_selector`, made once from the options).
  [[nodiscard]] algorithm select(std::size_t bytes) const noexcept { return selector_(bytes, size_); }
  /// Allreduce regions of at least this many bytes run the ring (see options::ring_min_bytes).
  [[nodiscard]] std::size_t ring_threshold() const noexcept { return selector_.ring_threshold(size_); }
  /// Thread level in effect: what MPI provides, capped by `options::max_thread_level`.
  [[nodiscard]] thread_level level() const noexcept { return level_; }
  /// True if this communicator locks around its MPI calls.
  [[nodiscard]] bool serialize() const noexcept { return level_ == thread_level::serialized; }

  /// Most point-to-point streams one collective may run at once (one per dtype group).
  static constexpr std::uint64_t streams_per_op = 8;

  /// The point-to-point tag of stream `stream` of collective `seq`, so concurrent rings never
  /// match each other's messages. Wraps at MPI_TAG_UB (at least 32767: 4096 collectives, far
  /// more than are ever in flight at once).
  [[nodiscard]] int tag_for(std::uint64_t seq, std::uint64_t stream) const noexcept {
    return static_cast<int>((seq * streams_per_op + stream) % (static_cast<std::uint64_t>(tag_ub_) + 1));
  }

  /// Takes the next sequence number.
  std::uint64_t next_seq() noexcept { return seq_.fetch_add(1, std::memory_order_relaxed); }
  /// The sequence number the next operation will get (for error messages of rejected calls).
  [[nodiscard]] std::uint64_t peek_seq() const noexcept { return seq_.load(std::memory_order_relaxed); }

  void abort() noexcept {
    if (aborted()) return;
    aborted_at_.store(clock::now().time_since_epoch().count(), std::memory_order_relaxed);
    aborted_.store(true, std::memory_order_release);
    try {
      note_failure("rank " + std::to_string(rank_), "the communicator was aborted (abort()); its peers are not told");
    } catch (...) {
      note_failure(std::string(), std::string());
    }
  }
  [[nodiscard]] bool aborted() const noexcept { return aborted_.load(std::memory_order_acquire); }
  /// When abort() was first called (valid once aborted()).
  [[nodiscard]] clock::time_point aborted_at() const noexcept {
    return clock::time_point(clock::duration(aborted_at_.load(std::memory_order_relaxed)));
  }

  /// Records a communication failure of `info` (an MPI error, a timed-out wait): the first one
  /// starts the shared abandon deadline (see `abandon_deadline`) and is reported to the
  /// environment the communicator was made with, whose destructor then skips MPI_Finalize.
  void note_failure(const op_info& info, const std::string& what) noexcept {
    try {
      note_failure("rank " + std::to_string(info.rank) + ", " + info.describe(), what);
    } catch (...) {
      note_failure(std::string(), std::string());
    }
  }

  /// Until when abandoning the pending operation `info` keeps driving it before leaking it: its
  /// timeout from `now`; for work pending at abort(), from the abort; for work issued before
  /// the first failure, from that failure. So N operations pending when things went wrong cost
  /// one timeout together, not one each.
  [[nodiscard]] clock::time_point abandon_deadline(const op_info& info, clock::time_point now) const noexcept {
    clock::time_point deadline = (aborted() ? aborted_at() : now) + info.timeout;
    if (failed_.load(std::memory_order_acquire) && info.seq < failed_seq_.load(std::memory_order_relaxed)) {
      const clock::time_point failed_at(clock::duration(failed_at_.load(std::memory_order_relaxed)));
      deadline = std::min(deadline, failed_at + info.timeout);
    }
    return deadline;
  }

  /// Checks the return code of an MPI call issuing `info`: a failure is recorded, then thrown.
  void check_issue(int code, const op_info& info, const char* call) {
    if (code != MPI_SUCCESS) [[unlikely]] {
      const mpi_error e(info.rank, info.describe(), call, code);
      note_failure(info, e.what());
      throw e;
    }
  }

  /// Records that abandoned work deliberately leaked requests that may still use this
  /// communicator's MPI objects: they are then never freed.
  void note_leak() noexcept { leaked_.fetch_add(1); }

  /// False if MPI's thread level forbids calling MPI from the current thread.
  [[nodiscard]] bool may_call_mpi_here() const noexcept {
    return level_ >= thread_level::serialized || std::this_thread::get_id() == owner_;
  }

  /// Throws `usage_error` if the current thread may not call MPI. `operation` names the call.
  void check_thread(const char* operation) const {
    if (may_call_mpi_here()) [[likely]] {
      return;
    }
    throw usage_error(rank_, operation,
                      "called from a thread other than the one that created the communicator, but MPI provides only " +
                          std::string(name_of(level_)) +
                          "; calls from several threads need MPI_THREAD_SERIALIZED or better (initialise MPI with "
                          "MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...), e.g. through ddp::mpi::environment)");
  }

  /// Scratch memory of at least `bytes`, reused from earlier collectives when possible: fresh
  /// multi-MiB allocations are mmap'ed and page-faulted on every call, which measurably slows
  /// large allreduces. Hand it back with `return_scratch`.
  std::unique_ptr<std::byte[]> take_scratch(std::size_t bytes, std::size_t& capacity) {
    {
      std::lock_guard<std::mutex> lock(scratch_mutex_);
      for (auto it = scratch_.begin(); it != scratch_.end(); ++it) {
        if (it->second >= bytes) {
          capacity = it->second;
          auto buffer = std::move(it->first);
          scratch_.erase(it);
          return buffer;
        }
      }
    }
    capacity = bytes;
    return std::make_unique_for_overwrite<std::byte[]>(bytes);
  }

  /// Keeps `buffer` for later collectives (a few, the largest), or frees it.
  void return_scratch(std::unique_ptr<std::byte[]> buffer, std::size_t capacity) noexcept {
    std::lock_guard<std::mutex> lock(scratch_mutex_);
    if (scratch_.size() < max_kept_scratch) {
      scratch_.emplace_back(std::move(buffer), capacity);
      return;
    }
    auto smallest = scratch_.begin();
    for (auto it = scratch_.begin(); it != scratch_.end(); ++it) {
      if (it->second < smallest->second) smallest = it;
    }
    if (smallest->second < capacity) *smallest = {std::move(buffer), capacity};
  }

  /// The lock serialising this communicator's MPI calls at MPI_THREAD_SERIALIZED.
  [[nodiscard]] std::mutex& mutex() const noexcept { return mutex_; }

 private:
  mpi::options options_;
  allreduce_selector selector_;
  std::thread::id owner_;
  thread_level level_ = thread_level::single;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = -1;
  int size_ = 0;
  int tag_ub_ = 32767;  // the minimum the MPI standard guarantees
  type_table types_;
  mutable std::mutex mutex_;
  // Records the first failure (once; `failed_` is published last).
  void note_failure(const std::string& where, const std::string& what) noexcept {
    if (failing_.exchange(true)) return;
    failed_at_.store(clock::now().time_since_epoch().count(), std::memory_order_relaxed);
    failed_seq_.store(peek_seq(), std::memory_order_relaxed);
    failed_.store(true, std::memory_order_release);
    if (!failures_) return;
    try {
      failures_->note(where.empty() ? what : where + ": " + what);
    } catch (...) {
      failures_->note(std::string());
    }
  }

  std::atomic<bool> aborted_{false};
  std::atomic<clock::rep> aborted_at_{0};
  std::shared_ptr<failure_record> failures_;  // the environment's, or null
  std::atomic<bool> failing_{false};
  std::atomic<bool> failed_{false};
  std::atomic<clock::rep> failed_at_{0};
  std::atomic<std::uint64_t> failed_seq_{0};
  std::atomic<std::uint64_t> seq_{0};
  std::atomic<int> leaked_{0};
  // Enough for the rings of the buckets a trainer keeps in flight (2 segments each, 8 MiB by
  // default: at most 32 MiB kept).
  static constexpr std::size_t max_kept_scratch = 4;
  std::mutex scratch_mutex_;
  std::vector<std::pair<std::unique_ptr<std::byte[]>, std::size_t>> scratch_;
};

/// Holds the communicator's lock for the scope when it serialises MPI calls; free otherwise.
class call_guard {
 public:
  explicit call_guard(const comm_state& s) : mutex_(s.serialize() ? &s.mutex() : nullptr) {
    if (mutex_) mutex_->lock();
  }
  call_guard(const call_guard&) = delete;
  call_guard& operator=(const call_guard&) = delete;
  ~call_guard() {
    if (mutex_) mutex_->unlock();
  }

 private:
  std::mutex* mutex_;
};

}  // namespace ddp::mpi::detail
