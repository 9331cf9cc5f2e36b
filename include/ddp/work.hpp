#pragma once
/// @file work.hpp
/// @brief `work`: the move-only handle every non-blocking collective returns.
///
/// Semantics shared by all backends:
/// - `test()` drives the operation forward (Open MPI makes no progress between calls) and returns
///   true once it completed; `wait()` blocks up to the operation's timeout. Both rethrow the
///   operation's error, every time they are called after it failed.
/// - Continuations added with `then()` run once, in the thread that observes completion, before
///   `test()`/`wait()` return; an exception from one becomes the work's error.
/// - The destructor never throws and never starts communication. A still-pending operation is
///   handed to its backend's `abandon()`, which makes sure the backend stops touching the
///   operation's buffers (the local backend withdraws; MPI waits up to the timeout, then leaks
///   the request and its staging memory rather than free memory MPI may still write).

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/reduce_op.hpp>

namespace ddp {

/// Clock of every deadline in the library: monotonic, so a wall-clock jump cannot fire or
/// stretch a timeout.
using clock = std::chrono::steady_clock;

/// Default deadline of a blocking wait. Generous: it exists to turn a hang into an error.
inline constexpr std::chrono::milliseconds default_timeout{std::chrono::minutes(5)};

/// What an operation is: enough to name it in an error on any rank. Cheap to copy (no strings).
struct op_info {
  int rank = -1;          ///< rank that issued the operation
  const char* name = "";  ///< static string: "allreduce", "broadcast", ...
  std::uint64_t seq = 0;  ///< position in the communicator's sequence of collectives
  ddp::dtype type = dtype::f32;  ///< element type (of the call's first tensor)
  std::size_t count = 0;  ///< total elements over all tensors of the call
  int root = -1;          ///< broadcast root, or -1
  reduce_op op = reduce_op::sum;  ///< reduction of an allreduce / reduce_scatter
  std::chrono::milliseconds timeout = default_timeout;  ///< deadline of `work::wait()`

  /// "allreduce #12 (sum, f32 x 1024)"
  [[nodiscard]] std::string describe() const {
    std::string s = std::string(name) + " #" + std::to_string(seq);
    if (std::string_view(name) == "barrier") return s;
    s += " (";
    if (std::string_view(name) == "allreduce" || std::string_view(name) == "reduce_scatter") {
      s += std::string(name_of(op)) + ", ";
    }
    if (root >= 0) s += "root " + std::to_string(root) + ", ";
    s += std::string(name_of(type)) + " x " + std::to_string(count) + ")";
    return s;
  }
};

/// Backend side of a work handle. Backends derive from it; users never see it.
class work_state {
 public:
  /// @param info  the operation, as named in errors and by `work::describe()`
  explicit work_state(op_info info) : info_(info) {}
  work_state(const work_state&) = delete;
  work_state& operator=(const work_state&) = delete;
  virtual ~work_state() = default;

  /// Advances the operation; returns true once it completed. Throws `ddp::error` on failure.
  virtual bool poll() = 0;

  /// Blocks until completion (true) or `deadline` (false). Throws on failure. The default polls
  /// with back-off: spinning first keeps small-message latency low, yielding later keeps
  /// oversubscribed runs (4 ranks on 2 cores) moving.
  virtual bool wait_until(clock::time_point deadline) {
    for (unsigned spins = 0;; ++spins) {
      if (poll()) return true;
      if (spins >= 64) {
        if (clock::now() >= deadline) return false;
        if (spins < 4096) {
          std::this_thread::yield();
        } else {
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
      }
    }
  }

  /// The owner gives up on a pending operation (timed out, or the handle is destroyed). After
  /// this returns, the backend must not touch the caller's buffers any more, or must have
  /// deliberately leaked whatever it may still write.
  virtual void abandon() noexcept {}

  /// The operation this state runs.
  [[nodiscard]] const op_info& info() const noexcept { return info_; }

 private:
  op_info info_;
};

/// Move-only handle of a non-blocking operation.
class [[nodiscard]] work {
 public:
  /// An empty handle is a completed no-op (the result of a collective that had nothing to do).
  work() = default;
  /// Handle of a pending operation; backends call this with their `work_state`.
  explicit work(std::unique_ptr<work_state> state) : state_(std::move(state)) {}

  /// Takes over the operation, its continuations and its error; `other` becomes empty.
  work(work&& other) noexcept
      : state_(std::move(other.state_)), then_(std::move(other.then_)), error_(std::move(other.error_)) {}
  /// Abandons this handle's pending operation (as the destructor does), then takes over `other`'s.
  work& operator=(work&& other) noexcept {
    if (this != &other) {
      release();
      state_ = std::move(other.state_);
      then_ = std::move(other.then_);
      error_ = std::move(other.error_);
    }
    return *this;
  }
  work(const work&) = delete;
  work& operator=(const work&) = delete;
  ~work() { release(); }

  /// A completed handle.
  [[nodiscard]] static work ready() { return work(); }
  /// A handle that failed with `e` (rethrown by test/wait).
  [[nodiscard]] static work failed(std::exception_ptr e) {
    work w;
    w.error_ = std::move(e);
    return w;
  }

  /// Non-blocking: drives the operation and returns true once it completed.
  /// @throws the operation's error
  bool test() {
    if (error_) std::rethrow_exception(error_);
    if (!state_) return true;
    try {
      if (!state_->poll()) return false;
    } catch (...) {
      fail(std::current_exception());
    }
    complete();
    return true;
  }

  /// Blocks until completion or the operation's timeout.
  /// @throws timeout_error naming the operation; the operation's own error
  void wait() { wait_for(state_ ? state_->info().timeout : default_timeout); }

  /// Blocks until completion or `timeout`.
  void wait_for(std::chrono::milliseconds timeout) {
    if (error_) std::rethrow_exception(error_);
    if (!state_) return;
    bool ok = false;
    try {
      ok = state_->wait_until(clock::now() + timeout);
    } catch (...) {
      fail(std::current_exception());
    }
    if (!ok) {
      const op_info info = state_->info();
      fail(std::make_exception_ptr(timeout_error(
          info.rank, info.describe(),
          "did not complete within " + std::to_string(timeout.count()) +
              " ms (a peer is slow, dead, or issued a different collective)")));
    }
    complete();
  }

  /// True once completed successfully. Does not drive progress.
  [[nodiscard]] bool done() const noexcept { return !state_ && !error_; }
  /// True if the operation failed (without throwing).
  [[nodiscard]] bool failed() const noexcept { return error_ != nullptr; }
  /// The stored error, or null.
  [[nodiscard]] std::exception_ptr error() const noexcept { return error_; }
  /// Deadline `wait()` uses (the backend's per-operation timeout).
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept {
    return state_ ? state_->info().timeout : default_timeout;
  }
  /// Description of the operation ("" once completed).
  [[nodiscard]] std::string describe() const { return state_ ? state_->info().describe() : std::string(); }

  /// Adds a continuation run once when the operation completes successfully (immediately if it
  /// already has). Returns *this so calls chain.
  work& then(std::function<void()> fn) & {
    if (error_) return *this;
    if (!state_) {
      run_now(fn);
    } else {
      then_.push_back(std::move(fn));
    }
    return *this;
  }
  /// `then()` on a temporary: `comm.allreduce(...).then(fn)` yields the handle by rvalue.
  work&& then(std::function<void()> fn) && { return std::move(then(std::move(fn))); }

  /// One handle for many: completes when all have; fails with the first error.
  [[nodiscard]] static work all(std::vector<work> parts);

 private:
  void run_now(const std::function<void()>& fn) {
    try {
      fn();
    } catch (...) {
      error_ = std::current_exception();
    }
  }

  void fail(std::exception_ptr e) {
    if (state_) state_->abandon();
    state_.reset();
    then_.clear();
    error_ = std::move(e);
    std::rethrow_exception(error_);
  }

  void complete() {
    state_.reset();
    auto fns = std::move(then_);
    then_.clear();
    for (auto& fn : fns) {
      run_now(fn);
      if (error_) std::rethrow_exception(error_);
    }
  }

  void release() noexcept {
    if (state_) state_->abandon();
    state_.reset();
  }

  std::unique_ptr<work_state> state_;
  std::vector<std::function<void()>> then_;
  std::exception_ptr error_;
};

namespace detail {
/// State of `work::all`: polls its parts in order.
class all_work_state final : public work_state {
 public:
  explicit all_work_state(std::vector<work> parts)
      : work_state(parts_info(parts)), parts_(std::move(parts)) {}
  bool poll() override {
    bool all_done = true;
    for (auto& p : parts_) all_done = p.test() && all_done;
    return all_done;
  }
  // Waiting part by part names the operation that timed out, not the group.
  bool wait_until(clock::time_point deadline) override {
    for (auto& p : parts_) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now());
      p.wait_for(std::max(left, std::chrono::milliseconds(0)));
    }
    return true;
  }

 private:
  static op_info parts_info(const std::vector<work>&) {
    op_info info;
    info.name = "group";
    return info;
  }
  std::vector<work> parts_;
};
}  // namespace detail

inline work work::all(std::vector<work> parts) {
  std::erase_if(parts, [](const work& w) { return w.done(); });
  if (parts.empty()) return work::ready();
  if (parts.size() == 1) return std::move(parts.front());
  for (auto& p : parts) {
    if (p.failed()) return work::failed(p.error());
  }
  return work(std::make_unique<detail::all_work_state>(std::move(parts)));
}

}  // namespace ddp
