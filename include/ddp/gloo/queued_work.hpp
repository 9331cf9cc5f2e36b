#pragma once
/// @file gloo/queued_work.hpp
/// @brief The work-handle state of a gloo collective: a view of an operation in the engine's
/// queue. Keeps the engine alive, so a handle may outlive its communicator (it then reports the
/// abort that destroying a communicator with pending work implies).

#include <memory>
#include <utility>

#include <ddp/gloo/engine.hpp>
#include <ddp/work.hpp>

namespace ddp::gloo::detail {

class queued_work final : public work_state {
 public:
  queued_work(std::shared_ptr<engine> e, std::shared_ptr<queued_op> op)
      : work_state(op->info), engine_(std::move(e)), op_(std::move(op)) {}

  bool poll() override { return engine_->poll(*op_); }
  bool wait_until(clock::time_point deadline) override { return engine_->wait_until(*op_, deadline); }
  void abandon() noexcept override { engine_->abandon(op_); }

 private:
  std::shared_ptr<engine> engine_;
  std::shared_ptr<queued_op> op_;
};

}  // namespace ddp::gloo::detail
