#pragma once
/// @file work.hpp
/// @brief `work`: the move-only handle every non-blocking collective returns.
///
/// Semantics shared by all backends:
/// - `test()` drives the operation forward (Open MPI makes no progress between calls) and returns
///   true once it completed; `wait()` blocks up to the operation's timeout. Both rethrow the
///   operation's error, every time they are called after it failed. An operation that is only
///   ever tested still has a deadline: `test()` fails it with `timeout_error` once its timeout
///   has passed since it was issued (a loop of tests on a hung peer ends, as a wait does).
/// - Waits cost no core: an operation that completes by itself (a backend thread, a condition
///   variable) is waited on by blocking or by polls with growing pauses (detail/idle_backoff.hpp);
///   only an operation that moves solely while polled (`progress_mode::polled`: MPI's requests)
///   keeps being polled, and gently once a wait has lasted a second.
/// - Waiting on several operations is one call with one deadline: `work::wait_all` (and a
///   `work::all` handle's `wait()`) tests every pending part round-robin, so that backends which
///   advance an operation only while its own handle is tested (ddp's MPI ring) move all of them,
///   and gives up on all of them together when the deadline passes.
/// - A `timeout_error` names the operation that did not complete, the timeout, and how long the
///   wait really lasted.
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
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/detail/idle_backoff.hpp>
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
  int rank = -1;                                        ///< rank that issued the operation
  const char* name = "";                                ///< static string: "allreduce", "broadcast", ...
  std::uint64_t seq = 0;                                ///< position in the communicator's sequence of collectives
  ddp::dtype type = dtype::f32;                         ///< element type (of the call's first tensor)
  std::size_t count = 0;                                ///< total elements over all tensors of the call
  int root = -1;                                        ///< broadcast root, or -1
  reduce_op op = reduce_op::sum;                        ///< reduction of an allreduce / reduce_scatter
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
  /// @param info  the operation, as named in errors and by `work::describe()`; it is issued now
  explicit work_state(op_info info) : info_(info), issued_(clock::now()) {}
  work_state(const work_state&) = delete;
  work_state& operator=(const work_state&) = delete;
  virtual ~work_state() = default;

  /// Advances the operation; returns true once it completed. Throws `ddp::error` on failure.
  virtual bool poll() = 0;

  /// Blocks until completion (true) or `deadline` (false). Throws on failure. The default polls
  /// with `detail::idle_backoff` (spin, yield, then growing sleeps) for the operation's
  /// `progress()`. A deadline already past costs one poll (`work::wait_all` gives up on its
  /// pending parts that way).
  virtual bool wait_until(clock::time_point deadline) {
    detail::idle_backoff idle(progress());
    for (;;) {
      if (poll()) return true;
      if (clock::now() >= deadline) return false;
      idle.pause(deadline);
    }
  }

  /// Whether the operation moves only while it is polled (MPI's requests, ddp's MPI ring: a wait
  /// keeps polling) or by itself (a backend thread: a wait may sleep between polls).
  [[nodiscard]] virtual detail::progress_mode progress() const noexcept { return detail::progress_mode::background; }

  /// The owner gives up on a pending operation (timed out, or the handle is destroyed). After
  /// this returns, the backend must not touch the caller's buffers any more, or must have
  /// deliberately leaked whatever it may still write.
  virtual void abandon() noexcept {}

  /// The operation this state runs.
  [[nodiscard]] const op_info& info() const noexcept { return info_; }
  /// When it was issued: `work::test()` fails it once `info().timeout` has passed since.
  [[nodiscard]] clock::time_point issued() const noexcept { return issued_; }

 private:
  op_info info_;
  clock::time_point issued_;
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
  /// @throws timeout_error once the operation's timeout has passed since it was issued (its
  ///   backend is told, as by a timed-out `wait()`); the operation's own error
  bool test() { return advance(true); }

  /// Blocks until completion or the operation's timeout.
  /// @throws timeout_error naming the operation, the timeout and how long it waited; the
  ///   operation's own error
  void wait() { wait_for(timeout()); }

  /// Blocks until completion or `timeout`.
  /// @throws as `wait()`
  void wait_for(std::chrono::milliseconds timeout) {
    const auto since = clock::now();
    wait_from(since, since + timeout);
  }

  /// Blocks until completion or `deadline`.
  /// @throws as `wait()`
  void wait_until(clock::time_point deadline) { wait_from(clock::now(), deadline); }

  /// Waits for every handle of `parts` (null pointers and completed handles count as done), with
  /// one deadline for all of them:
  /// - the pending parts are tested round-robin (a backend that advances an operation only while
  ///   its handle is tested, like ddp's MPI ring, moves all of them), and when a single one is left
  ///   its backend's own blocking wait takes over;
  /// - `on_complete(i)` runs once for each part `i` as soon as it is seen complete (at once for a
  ///   part that already is), e.g. to copy a bucket back while the others are still in flight;
  /// - at `deadline` every part still pending fails with its own `timeout_error` (its backend is
  ///   told, as by a timed-out `wait()`), and the first one is thrown: it names that collective,
  ///   the timeout, how long this call really waited, and the other collectives still pending.
  ///
  /// Errors are not delayed: the first part that fails (or an exception from `on_complete`) is
  /// rethrown at once; the other parts stay in their handles, still pending, and destroying or
  /// waiting on them is the caller's business.
  /// @throws timeout_error, or the first part's error
  static void wait_all(std::span<work* const> parts, clock::time_point deadline,
                       const std::function<void(std::size_t)>& on_complete = {});

  /// `wait_all` with the deadline of the longest timeout among the pending parts (the
  /// communicator's timeout when they share one), counted from now.
  static void wait_all(std::span<work* const> parts, const std::function<void(std::size_t)>& on_complete = {});

  /// `wait_all` over a vector (or any contiguous run) of handles.
  static void wait_all(std::span<work> parts, const std::function<void(std::size_t)>& on_complete = {}) {
    std::vector<work*> pointers;
    pointers.reserve(parts.size());
    for (work& w : parts) pointers.push_back(&w);
    wait_all(std::span<work* const>(pointers), on_complete);
  }

  /// True once completed successfully. Does not drive progress.
  [[nodiscard]] bool done() const noexcept { return !state_ && !error_; }
  /// True if the operation failed (without throwing).
  [[nodiscard]] bool failed() const noexcept { return error_ != nullptr; }
  /// The stored error, or null.
  [[nodiscard]] std::exception_ptr error() const noexcept { return error_; }
  /// Timeout `wait()` uses (the backend's per-operation timeout; for `work::all`, the longest of
  /// its parts').
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept {
    return state_ ? state_->info().timeout : default_timeout;
  }
  /// Description of the operation ("" once completed).
  [[nodiscard]] std::string describe() const { return state_ ? state_->info().describe() : std::string(); }
  /// How the pending operation moves (`work_state::progress()`); `background` once completed.
  [[nodiscard]] detail::progress_mode progress() const noexcept {
    return state_ ? state_->progress() : detail::progress_mode::background;
  }

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

  /// One handle for many: completes when all have; fails with the first error. Its `wait()` is
  /// `wait_all` over the parts, with the longest of their timeouts.
  [[nodiscard]] static work all(std::vector<work> parts);

 private:
  // test(); `own_deadline` false: the caller's wait has a deadline of its own (wait_all), which
  // names every part still pending when it passes.
  bool advance(bool own_deadline) {
    if (error_) std::rethrow_exception(error_);
    if (!state_) return true;
    std::exception_ptr timed_out;
    try {
      if (!state_->poll()) {
        const auto expiry = state_->issued() + state_->info().timeout;
        if (!own_deadline || clock::now() < expiry) return false;
        // One last look, as a timed-out wait takes: the backend learns that its wait timed out.
        if (!state_->wait_until(expiry)) timed_out = timeout_of(state_->info(), state_->issued(), expiry, {});
      }
    } catch (...) {
      fail(std::current_exception());
    }
    if (timed_out) fail(std::move(timed_out));
    complete();
    return true;
  }

  void run_now(const std::function<void()>& fn) {
    try {
      fn();
    } catch (...) {
      error_ = std::current_exception();
    }
  }

  // A wait that began at `since`: the timeout error says how long it lasted.
  void wait_from(clock::time_point since, clock::time_point deadline) {
    if (drive_until(deadline)) return;
    fail(timeout_of(state_->info(), since, deadline, {}));
  }

  // Blocks in the backend until completion (true, continuations run) or `deadline` (false, the
  // operation still pending: the caller decides). Throws the operation's error.
  bool drive_until(clock::time_point deadline) {
    if (error_) std::rethrow_exception(error_);
    if (!state_) return true;
    bool ok = false;
    try {
      ok = state_->wait_until(deadline);
    } catch (...) {
      fail(std::current_exception());
    }
    if (!ok) return false;
    complete();
    return true;
  }

  // The timeout_error of `info` for a wait that began at `since` with deadline `deadline`;
  // `others` are the collectives of the same wait that were still pending too.
  static std::exception_ptr timeout_of(const op_info& info, clock::time_point since, clock::time_point deadline,
                                       const std::vector<std::string>& others) {
    using std::chrono::milliseconds;
    const auto limit = std::chrono::round<milliseconds>(deadline - since).count();
    const auto waited = std::chrono::round<milliseconds>(clock::now() - since).count();
    std::string text = "did not complete within the " + std::to_string(limit) + " ms timeout: waited " +
                       std::to_string(waited) + " ms";
    if (!others.empty()) {
      text += ", together with " + std::to_string(others.size()) + " other pending collective" +
              (others.size() > 1 ? "s" : "") + " (";
      for (std::size_t k = 0; k < others.size() && k < 4; ++k) text += (k ? ", " : "") + others[k];
      text += others.size() > 4 ? ", ...)" : ")";
    }
    text += " (a peer is slow, dead, or issued a different collective)";
    return std::make_exception_ptr(timeout_error(info.rank, info.describe(), text));
  }

  // Records `e` as the error: the backend is told to stop (abandon), continuations are dropped.
  void set_error(std::exception_ptr e) noexcept {
    if (state_) state_->abandon();
    state_.reset();
    then_.clear();
    error_ = std::move(e);
  }

  [[noreturn]] void fail(std::exception_ptr e) {
    set_error(std::move(e));
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

inline void work::wait_all(std::span<work* const> parts, clock::time_point deadline,
                           const std::function<void(std::size_t)>& on_complete) {
  const auto since = clock::now();
  const std::size_t n = parts.size();
  std::vector<bool> open(n, true);  // not yet seen complete
  std::size_t left = n;
  auto completed = [&](std::size_t i) {
    open[i] = false;
    --left;
    if (on_complete) on_complete(i);
  };
  // Spin first (small collectives complete within microseconds), then give the core away, then
  // sleep: a hung peer costs no core. Parts that move only while polled keep being polled longer.
  detail::progress_mode mode = detail::progress_mode::background;
  for (const work* w : parts) {
    if (w != nullptr && w->progress() == detail::progress_mode::polled) mode = detail::progress_mode::polled;
  }
  detail::idle_backoff idle(mode);
  while (left > 0) {
    bool advanced = false;
    for (std::size_t i = 0; i < n; ++i) {
      if (!open[i]) continue;
      if (parts[i] == nullptr || parts[i]->advance(false)) {  // rethrows the part's error
        completed(i);
        advanced = true;
      }
    }
    if (left == 0) return;
    if (advanced) {
      idle.reset();
      continue;
    }
    if (clock::now() >= deadline) break;
    if (left == 1) {  // one left: its backend's own wait blocks efficiently (a condition variable, MPI's spin)
      const auto i = static_cast<std::size_t>(std::find(open.begin(), open.end(), true) - open.begin());
      if (!parts[i]->drive_until(deadline)) break;
      completed(i);
      return;
    }
    idle.pause(deadline);
  }
  // The deadline passed: one last look at each part (its backend learns that its wait timed out),
  // then every part still pending fails with its own timeout_error.
  std::vector<std::size_t> pending;
  for (std::size_t i = 0; i < n; ++i) {
    if (!open[i]) continue;
    if (parts[i]->drive_until(deadline)) {
      completed(i);
    } else {
      pending.push_back(i);
    }
  }
  if (pending.empty()) return;
  std::vector<std::string> names;
  for (std::size_t i : pending) names.push_back(parts[i]->state_->info().describe());
  for (std::size_t k = pending.size(); k-- > 0;) {  // the first one last: its error is thrown
    std::vector<std::string> others = names;
    others.erase(others.begin() + static_cast<std::ptrdiff_t>(k));
    work& w = *parts[pending[k]];
    w.set_error(timeout_of(w.state_->info(), since, deadline, others));
  }
  std::rethrow_exception(parts[pending.front()]->error_);
}

inline void work::wait_all(std::span<work* const> parts, const std::function<void(std::size_t)>& on_complete) {
  std::chrono::milliseconds longest{0};
  for (const work* w : parts) {
    if (w != nullptr && w->state_) longest = std::max(longest, w->state_->info().timeout);
  }
  wait_all(parts, clock::now() + longest, on_complete);
}

namespace detail {
/// State of `work::all`: its parts, tested round-robin; waited on with `work::wait_all`.
class all_work_state final : public work_state {
 public:
  all_work_state(op_info info, std::vector<work> parts) : work_state(info), parts_(std::move(parts)) {}
  bool poll() override {
    bool all_done = true;
    for (auto& p : parts_) all_done = p.test() && all_done;
    return all_done;
  }
  detail::progress_mode progress() const noexcept override {
    for (const auto& p : parts_) {
      if (p.progress() == detail::progress_mode::polled) return detail::progress_mode::polled;
    }
    return detail::progress_mode::background;
  }
  // A timeout names the part that did not complete, not the group.
  bool wait_until(clock::time_point deadline) override {
    std::vector<work*> pointers;
    pointers.reserve(parts_.size());
    for (auto& p : parts_) pointers.push_back(&p);
    work::wait_all(pointers, deadline);
    return true;
  }

 private:
  std::vector<work> parts_;
};
}  // namespace detail

inline work work::all(std::vector<work> parts) {
  std::erase_if(parts, [](const work& w) { return w.done(); });
  if (parts.empty()) return work::ready();
  if (parts.size() == 1) return std::move(parts.front());
  op_info info;
  info.name = "group";
  info.timeout = std::chrono::milliseconds(0);
  for (auto& p : parts) {
    if (p.failed()) return work::failed(p.error());
    if (info.rank < 0) info.rank = p.state_->info().rank;
    info.timeout = std::max(info.timeout, p.state_->info().timeout);
    info.count += p.state_->info().count;
  }
  return work(std::make_unique<detail::all_work_state>(info, std::move(parts)));
}

}  // namespace ddp
