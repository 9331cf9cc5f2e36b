#pragma once
/// @file gloo/engine.hpp
/// @brief The machinery behind a gloo communicator: a queue of collectives, the worker thread
/// that runs them in issue order as blocking gloo calls, and the monitor that wakes a
/// collective gloo would leave blocked.
///
/// gloo's collectives block the calling thread; the communicator concept wants non-blocking
/// calls returning work handles, and survivors of a dead peer should fail within milliseconds,
/// not at their timeout. Only the worker thread calls into gloo's collectives. The worker,
/// the broken state, the monitor and interrupts: docs/backends-gloo.md ("Collectives",
/// "Failure semantics").

#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gloo/context.h>

#include <ddp/detail/describe_exception.hpp>
#include <ddp/error.hpp>
#include <ddp/gloo/collectives.hpp>
#include <ddp/gloo/errors.hpp>
#include <ddp/gloo/interrupt.hpp>
#include <ddp/work.hpp>

namespace ddp::gloo::detail {

/// One collective, from issue to completion.
struct queued_op {
  enum class status : unsigned char { queued, running, done, failed };

  queued_op(op_info i, std::function<void(call_context&)> b) : info(i), body(std::move(b)) {}

  op_info info;
  std::function<void(call_context&)> body;  ///< the blocking gloo calls; captures the views
  std::chrono::milliseconds timeout{};      ///< gloo's deadline for each of its waits
  status state = status::queued;
  std::exception_ptr error;

  [[nodiscard]] bool finished() const noexcept { return state == status::done || state == status::failed; }
};

class engine {
 public:
  /// Takes a connected context and starts the worker and monitor threads.
  engine(std::shared_ptr<::gloo::Context> ctx, std::chrono::milliseconds timeout, bool widen_half)
      : rank_(ctx->rank), size_(ctx->size), timeout_(timeout), addresses_(connection_addresses(*ctx)) {
    calls_.ctx = std::move(ctx);
    calls_.timeout = timeout;
    calls_.widen_half = widen_half;
    calls_.buffers = &buffers_;
    worker_ = std::thread([this] { run(); });
    monitor_ = std::thread([this] { watch(); });
  }
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;
  ~engine() { shutdown(); }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }

  [[nodiscard]] std::chrono::milliseconds timeout() const {
    std::lock_guard lk(m_);
    return timeout_;
  }
  void set_timeout(std::chrono::milliseconds t) {
    std::lock_guard lk(m_);
    timeout_ = t;
  }

  /// Queues a collective. Fills in `info.seq` and `info.timeout`. If the communicator already
  /// failed, the operation is not queued and `failed_now` receives its error.
  /// @throws usage_error after abort()
  [[nodiscard]] std::shared_ptr<queued_op> submit(op_info info, std::function<void(call_context&)> body,
                                                  std::exception_ptr& failed_now) {
    std::lock_guard lk(m_);
    if (aborted_) throw usage_error(rank_, info.describe(), "communicator used after abort()");
    info.seq = seq_++;
    // A handle's wait covers the operations queued ahead of it, each bounded by the gloo
    // timeout, plus slack so that gloo's own, more precise error arrives first.
    const auto ahead = static_cast<long>(queue_.size() + (running_ ? 1 : 0));
    info.timeout = timeout_ * (ahead + 1) + std::max(std::chrono::milliseconds(100), timeout_ / 10);
    auto op = std::make_shared<queued_op>(info, std::move(body));
    op->timeout = timeout_;
    if (!failure_.empty()) {
      fail(*op, not_run_error(op->info));
      failed_now = op->error;
      return op;
    }
    queue_.push_back(op);
    work_cv_.notify_one();
    return op;
  }

  /// True once `op` completed. @throws its error
  bool poll(const queued_op& op) {
    std::lock_guard lk(m_);
    return check(op);
  }

  /// Waits until `op` finished or `deadline`. @throws its error
  bool wait_until(const queued_op& op, clock::time_point deadline) {
    std::unique_lock lk(m_);
    done_cv_.wait_until(lk, deadline, [&] { return op.finished(); });
    return check(op);
  }

  /// The owner of an unfinished operation gave up on it (its wait timed out, or its handle was
  /// dropped). Skipping it would put this rank out of step with its peers, so the communicator
  /// is aborted; returns once the worker no longer touches the operation's buffers.
  void abandon(const std::shared_ptr<queued_op>& op) noexcept {
    {
      std::lock_guard lk(m_);
      if (op->finished()) return;
    }
    abort("rank " + std::to_string(rank_) + " gave up on " + op->info.describe() +
          " before it completed (its wait timed out or its handle was dropped)");
    std::unique_lock lk(m_);
    // Prompt after the interrupt; bounded by gloo's own timeout if the interrupt found nothing.
    done_cv_.wait_for(lk, op->timeout + std::chrono::seconds(1), [&] { return op->finished(); });
  }

  /// Fails queued operations, wakes a running one, and makes later calls throw usage_error.
  void abort(const std::string& why) noexcept {
    {
      std::lock_guard lk(m_);
      if (aborted_) return;
      aborted_ = true;
      if (failure_.empty()) failure_ = why;
      for (auto& op : queue_) fail(*op, std::make_exception_ptr(communication_error(rank_, op->info.describe(), why)));
      queue_.clear();
      work_cv_.notify_all();
      done_cv_.notify_all();
    }
    // Even with nothing running: peers blocked on this rank learn at once that it is gone.
    interrupt(why);
  }

  [[nodiscard]] bool aborted() const {
    std::lock_guard lk(m_);
    return aborted_;
  }
  /// Why the communicator stopped working ("" while healthy).
  [[nodiscard]] std::string failure() const {
    std::lock_guard lk(m_);
    return failure_;
  }
  [[nodiscard]] std::uint64_t issued() const {
    std::lock_guard lk(m_);
    return seq_;
  }

  /// Stops the threads and releases the gloo context. Pending operations are aborted first;
  /// without any, the context is closed gracefully (no reset connections). Blocks at most for
  /// an interrupted collective to return: promptly, or at its timeout if no socket was found.
  void shutdown() noexcept {
    bool pending = false;
    {
      std::lock_guard lk(m_);
      pending = running_ != nullptr || !queue_.empty();
    }
    if (pending) abort("rank " + std::to_string(rank_) + " destroyed its communicator with operations pending");
    {
      std::lock_guard lk(m_);
      stop_ = true;
      work_cv_.notify_all();
      monitor_cv_.notify_all();
    }
    if (worker_.joinable()) worker_.join();
    if (monitor_.joinable()) monitor_.join();
    std::lock_guard lk(m_);
    calls_.ctx.reset();  // gloo closes its sockets and joins its I/O thread here
  }

 private:
  std::exception_ptr not_run_error(const op_info& info) const {
    return std::make_exception_ptr(communication_error(
        rank_, info.describe(), "not run: the communicator failed earlier (" + failure_ + "); build a new one"));
  }

  static void fail(queued_op& op, std::exception_ptr e) {
    op.state = queued_op::status::failed;
    op.error = std::move(e);
    op.body = nullptr;  // drop the captured views now
  }

  static bool check(const queued_op& op) {
    if (op.state == queued_op::status::failed) std::rethrow_exception(op.error);
    return op.state == queued_op::status::done;
  }

  // Marks the running collective (if any) interrupted and wakes it; the monitor keeps aborting
  // its buffers' waits until it returns.
  void interrupt(const std::string& why) noexcept {
    std::shared_ptr<::gloo::Context> ctx;
    {
      std::lock_guard lk(m_);
      if (running_ && !interrupted_) {
        interrupted_ = true;
        interrupt_reason_ = why;
      }
      ctx = calls_.ctx;  // keeps the context alive while its sockets are touched
      monitor_cv_.notify_all();
    }
    if (!ctx) return;
    for_each_socket_of(addresses_, [](int fd, std::size_t) { ::shutdown(fd, SHUT_RDWR); });
    buffers_.abort_waits();
  }

  void run() noexcept {
    // gloo writes with plain write(2): a dead peer must turn into EPIPE, not a fatal SIGPIPE.
    // Blocked for this thread's whole life; the signal disposition is left alone.
    block_sigpipe();
    std::unique_lock lk(m_);
    for (;;) {
      work_cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      auto op = std::move(queue_.front());
      queue_.pop_front();
      if (!failure_.empty()) {
        fail(*op, not_run_error(op->info));
        done_cv_.notify_all();
        continue;
      }
      op->state = queued_op::status::running;
      running_ = op;
      interrupted_ = false;
      calls_.timeout = op->timeout;
      monitor_cv_.notify_all();
      lk.unlock();

      std::exception_ptr error;
      try {
        op->body(calls_);
      } catch (...) {
        error = translate_current_exception(op->info);
      }

      lk.lock();
      if (interrupted_ && !is_timeout(error)) {
        // Whatever gloo returned: its waits were cut short, the buffers may hold anything. (A
        // timeout stays one: gloo closes a pair that timed out, which the monitor may see first.)
        std::string why = interrupt_reason_;
        if (error) why += "; then: " + bare_message(error);
        error = std::make_exception_ptr(communication_error(rank_, op->info.describe(), why));
      }
      if (error) {
        lk.unlock();
        // Tell the peers now (they see their connection to us end) instead of letting them
        // wait out their timeout on a rank that will not answer.
        try {
          calls_.ctx->closeConnections();
        } catch (...) {
        }
        lk.lock();
        if (failure_.empty()) failure_ = ddp::detail::describe_exception(error);
        fail(*op, error);
      } else {
        op->state = queued_op::status::done;
        op->body = nullptr;
      }
      running_.reset();
      monitor_cv_.notify_all();
      done_cv_.notify_all();
    }
  }

  void watch() noexcept {
    block_sigpipe();
    std::unique_lock lk(m_);
    for (;;) {
      monitor_cv_.wait(lk, [&] { return stop_ || running_ != nullptr; });
      if (stop_) return;
      const auto op = running_;
      // Most collectives finish before the first look; an interrupted one is nudged often.
      const auto pause = interrupted_ ? std::chrono::milliseconds(10) : std::chrono::milliseconds(50);
      if (monitor_cv_.wait_for(lk, pause, [&] { return stop_ || running_ != op; })) continue;
      if (interrupted_) {
        lk.unlock();
        buffers_.abort_waits();
        lk.lock();
        continue;
      }
      lk.unlock();
      const bool broken = connections_broken(addresses_);
      lk.lock();
      if (broken && running_ == op) {
        lk.unlock();
        interrupt("a connection of this communicator broke while " + op->info.describe() +
                  " ran (a peer died, failed or aborted)");
        lk.lock();
      }
    }
  }

  static bool is_timeout(const std::exception_ptr& e) noexcept {
    if (!e) return false;
    try {
      std::rethrow_exception(e);
    } catch (const timeout_error&) {
      return true;
    } catch (...) {
      return false;
    }
  }

  static void block_sigpipe() noexcept {
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
  }

  const int rank_;
  const int size_;
  mutable std::mutex m_;
  std::condition_variable work_cv_;     // worker: something queued, or stop
  std::condition_variable done_cv_;     // waiters: some operation finished
  std::condition_variable monitor_cv_;  // monitor: an operation started, ended or was interrupted
  std::deque<std::shared_ptr<queued_op>> queue_;
  std::shared_ptr<queued_op> running_;
  std::chrono::milliseconds timeout_;
  std::uint64_t seq_ = 0;
  bool aborted_ = false;
  bool stop_ = false;
  bool interrupted_ = false;
  std::string interrupt_reason_;
  std::string failure_;
  const std::vector<sockaddr_storage> addresses_;  // local ends of the context's connections
  buffer_registry buffers_;
  call_context calls_;  // the worker's, except ctx, which others read under m_
  std::thread worker_;
  std::thread monitor_;
};

}  // namespace ddp::gloo::detail
