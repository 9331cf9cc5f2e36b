#pragma once
/// @file shm/job_queue.hpp
/// @brief `detail::job_queue`: one thread of a shm::communicator's that runs its multi-node
/// allreduces in call order, so that the network time of the inter-node step passes while the
/// caller computes (the Bucketer's backward pass); and `detail::queued_job`, the work handle of
/// one of them. See docs/shm-allreduce.md ("Synchronisation").

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#include <ddp/work.hpp>

namespace ddp::shm::detail {

/// Completion of one queued job: set once by the queue's thread.
struct job_status {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;

  void finish(std::exception_ptr e) {
    std::lock_guard lock(m);
    error = std::move(e);
    done = true;
    cv.notify_all();
  }
};

/// The work handle of a queued job. Abandoning it waits for the job: the job reads and writes the
/// caller's tensors, and ends by its own deadline (the communicator's timeout) at the latest.
class queued_job final : public work_state {
 public:
  queued_job(op_info info, std::shared_ptr<job_status> status) : work_state(info), status_(std::move(status)) {}

  bool poll() override {
    std::lock_guard lock(status_->m);
    return finished();
  }
  bool wait_until(clock::time_point deadline) override {
    std::unique_lock lock(status_->m);
    status_->cv.wait_until(lock, deadline, [&] { return status_->done; });
    return finished();
  }
  void abandon() noexcept override {
    std::unique_lock lock(status_->m);
    status_->cv.wait(lock, [&] { return status_->done; });
  }

 private:
  bool finished() const {  // caller holds the lock
    if (!status_->done) return false;
    if (status_->error) std::rethrow_exception(status_->error);
    return true;
  }

  std::shared_ptr<job_status> status_;
};

/// Runs jobs one at a time, in the order they were pushed, on a thread of its own. Destroying it
/// runs what is queued first (jobs end by their own deadlines), then joins the thread.
class job_queue {
 public:
  job_queue() : thread_([this] { loop(); }) {}
  job_queue(const job_queue&) = delete;
  job_queue& operator=(const job_queue&) = delete;
  ~job_queue() {
    {
      std::lock_guard lock(m_);
      stopping_ = true;
      cv_.notify_all();
    }
    thread_.join();
  }

  /// Queues `job`; the returned status completes when it ran (with its exception, if it threw).
  std::shared_ptr<job_status> push(std::function<void()> job) {
    auto status = std::make_shared<job_status>();
    std::lock_guard lock(m_);
    jobs_.emplace_back(std::move(job), status);
    cv_.notify_all();
    return status;
  }

  /// True if no job is queued or running.
  [[nodiscard]] bool idle() {
    std::lock_guard lock(m_);
    return jobs_.empty() && !running_;
  }

  /// Waits until every job pushed so far ran.
  void drain() {
    std::unique_lock lock(m_);
    idle_.wait(lock, [&] { return jobs_.empty() && !running_; });
  }

 private:
  void loop() {
    std::unique_lock lock(m_);
    for (;;) {
      cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, and nothing left
      auto [job, status] = std::move(jobs_.front());
      jobs_.pop_front();
      running_ = true;
      lock.unlock();
      std::exception_ptr error;
      try {
        job();
      } catch (...) {
        error = std::current_exception();
      }
      status->finish(error);
      lock.lock();
      running_ = false;
      idle_.notify_all();
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::condition_variable idle_;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<job_status>>> jobs_;
  bool running_ = false;
  bool stopping_ = false;
  std::thread thread_;  // last: starts after the members it uses exist
};

}  // namespace ddp::shm::detail
