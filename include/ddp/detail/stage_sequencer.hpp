#pragma once
/// @file detail/stage_sequencer.hpp
/// @brief `stage_sequencer`: non-blocking operations each made of collectives that must run one
/// after another (a reduce-scatter, then an allreduce of its result, then an allgather), issued in
/// one order on every rank. Used by `group_communicator` (groups/group_communicator.hpp). Not for
/// users.
///
/// Why a sequencer: a stage after the first starts when some handle is tested, and ranks test
/// their handles at different moments (a Bucketer's progress, `work::wait_all`'s round-robin). Two
/// operations in flight would then issue their stages on the underlying communicators in a
/// different order on different ranks, and collectives would meet the wrong partners. So an
/// operation issues its first stage only after every earlier operation of the same sequencer has
/// issued all of its stages, and testing any handle drives the earlier operations first.

#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include <ddp/error.hpp>
#include <ddp/work.hpp>

namespace ddp::detail {

/// Operations of one communicator, in issue order (thread-safe: a progress thread may test them).
class stage_sequencer : public std::enable_shared_from_this<stage_sequencer> {
 public:
  using stage = std::function<work()>;

  /// A handle of `stages` run in order, then `finish` once (it unpacks results; what the stages
  /// and `finish` captured lives until the handle is destroyed and no stage is in flight). A
  /// stage's error is the operation's error; its later stages never start, and neither does any
  /// later operation of this sequencer (they fail: the ranks' sequences no longer match).
  [[nodiscard]] work start(op_info info, std::vector<stage> stages, std::function<void()> finish = {}) {
    auto o = std::make_shared<op>();
    o->stages = std::move(stages);
    o->finish = std::move(finish);
    {
      std::lock_guard lk(m_);
      ops_.push_back(o);
      drive_locked();
    }
    return work(std::make_unique<handle>(info, shared_from_this(), std::move(o)));
  }

 private:
  struct op {
    std::vector<stage> stages;
    std::function<void()> finish;
    std::size_t next = 0;  // stages issued
    work current;          // the stage in flight
    bool done = false;
    std::exception_ptr error;
  };

  class handle final : public work_state {
   public:
    handle(op_info info, std::shared_ptr<stage_sequencer> seq, std::shared_ptr<op> o)
        : work_state(info), seq_(std::move(seq)), op_(std::move(o)) {}
    bool poll() override { return seq_->poll(*op_); }
    void abandon() noexcept override { seq_->abandon(*op_); }

   private:
    std::shared_ptr<stage_sequencer> seq_;
    std::shared_ptr<op> op_;
  };

  bool poll(op& o) {
    std::lock_guard lk(m_);
    drive_locked();
    if (o.error) std::rethrow_exception(o.error);
    return o.done;
  }

  // The stage in flight is given up first (its backend stops touching the buffers the stages and
  // `finish` own), then they are released. Later stages never start.
  void abandon(op& o) noexcept {
    std::lock_guard lk(m_);
    if (o.done) return;
    if (o.next < o.stages.size()) broken_ = true;
    o.current = work();
    o.done = true;
    o.finish = nullptr;
    o.stages.clear();
    drive_locked();  // younger operations fail now rather than wait for stages that never come
  }

  // Advances the operations in order; stops at the first that still has stages to issue.
  void drive_locked() noexcept {
    for (const auto& p : ops_) {
      op& o = *p;
      if (o.done) continue;
      if (o.next == 0 && broken_) {
        o.error = std::make_exception_ptr(communication_error(
            -1, "group collective", "not run: an earlier collective of this communicator failed or was given up"));
        o.done = true;
        o.stages.clear();
        o.finish = nullptr;
        continue;
      }
      try {
        if (o.next == 0) o.current = o.stages[o.next++]();
        while (o.current.test()) {
          if (o.next == o.stages.size()) {
            o.done = true;
            if (o.finish) o.finish();
            break;
          }
          o.current = o.stages[o.next++]();
        }
      } catch (...) {
        if (o.next < o.stages.size()) broken_ = true;
        o.error = std::current_exception();
        o.done = true;
        o.current = work();
      }
      if (o.done) {
        o.stages.clear();  // release what they captured (the finish keeps the results' buffers alive until now)
        o.finish = nullptr;
        continue;
      }
      if (o.next < o.stages.size()) break;  // younger operations may not issue before o's stages
    }
    while (!ops_.empty() && ops_.front()->done) ops_.pop_front();
  }

  std::mutex m_;
  std::deque<std::shared_ptr<op>> ops_;
  bool broken_ = false;
};

}  // namespace ddp::detail
