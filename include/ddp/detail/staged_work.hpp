#pragma once
/// @file detail/staged_work.hpp
/// @brief `staged_work`: one non-blocking operation made of collectives that must run one after
/// another (a reduce-scatter, then an allreduce of its result, then an allgather), each started
/// as soon as the previous one completed, while the caller's handle is tested or waited on. Used by
/// `group_communicator` (groups/group_communicator.hpp). Not for users.

#include <cstddef>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include <ddp/work.hpp>

namespace ddp::detail {

/// Runs `stages` in order: stage 0 at construction (so that communication starts at once),
/// stage k+1 when stage k's work completed (seen by a `poll`), then `finish` once. A stage's
/// error is the operation's error; later stages never start. What the stages and `finish` use
/// (staging buffers) lives in what they captured, owned here until the work is destroyed.
class staged_work final : public work_state {
 public:
  using stage = std::function<work()>;

  staged_work(op_info info, std::vector<stage> stages, std::function<void()> finish)
      : work_state(info), stages_(std::move(stages)), finish_(std::move(finish)) {
    if (!stages_.empty()) current_ = stages_[next_++]();
  }

  bool poll() override {
    for (;;) {
      if (!current_.test()) return false;
      if (next_ == stages_.size()) break;
      current_ = stages_[next_++]();
    }
    if (finish_) {
      auto f = std::move(finish_);
      finish_ = nullptr;
      f();
    }
    return true;
  }

  /// Blocks in each stage's own backend wait (an MPI transfer across hosts moves only while its
  /// backend waits or is tested; polling with back-off from here halved a link's rate), starting
  /// the next stage as each completes. A stage that passes `deadline` throws its own
  /// timeout_error, naming that collective.
  bool wait_until(clock::time_point deadline) override {
    while (!poll()) current_.wait_until(deadline);
    return true;
  }

  /// The stage in flight is given up (its backend stops touching its buffers); later stages never start.
  void abandon() noexcept override {
    next_ = stages_.size();
    finish_ = nullptr;
    current_ = work();
  }

  /// A handle of `stages` run in order, then `finish`.
  [[nodiscard]] static work start(op_info info, std::vector<stage> stages, std::function<void()> finish = {}) {
    return work(std::make_unique<staged_work>(info, std::move(stages), std::move(finish)));
  }

 private:
  std::vector<stage> stages_;
  std::function<void()> finish_;
  std::size_t next_ = 0;
  work current_;
};

}  // namespace ddp::detail
