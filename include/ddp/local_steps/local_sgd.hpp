#pragma once
/// @file local_steps/local_sgd.hpp
/// @brief `local_sgd`: replicas take local optimizer steps and average their parameters every
/// `sync_every` steps (LocalSGD, arXiv 1805.09767). docs/local-steps.md.

#include <cstdint>
#include <utility>
#include <vector>

#include <ddp/average.hpp>
#include <ddp/communicator.hpp>
#include <ddp/local_steps/fragment.hpp>
#include <ddp/tensor.hpp>
#include <ddp/timeline.hpp>

namespace ddp {

/// Knobs of `local_sgd`.
struct local_sgd_options {
  int sync_every = 100;           ///< H: inner steps between two averages of the parameters
  bool broadcast_initial = true;  ///< construction broadcasts the parameters from rank 0 (a collective)
};

/// Averages the registered parameters over the communicator's ranks every `sync_every` calls of
/// `step()`, with `allreduce_average` (ddp's one rule). The trainer calls `step()` after each of
/// its optimizer steps, on every rank.
class local_sgd {
 public:
  /// Registers `params` (host, floating point; they must outlive this object).
  /// @throws usage_error on a bad parameter or `sync_every` < 1
  local_sgd(communicator_ref comm, std::vector<tensor_view> params, local_sgd_options options = {})
      : comm_(comm), params_(std::move(params)), options_(options) {
    detail::check_local_steps(comm_, params_, options_.sync_every, "local_sgd");
    if (options_.broadcast_initial) comm_.broadcast(params_, 0).wait();
  }

  /// Counts one inner step; every `sync_every`-th averages the parameters (blocking).
  /// @return true if this call averaged
  bool step() {
    ++steps_;
    if (steps_ % options_.sync_every != 0) return false;
    timeline::scoped_span span(rec_, {"local_steps", 0}, "parameter average");
    allreduce_average(comm_, params_, comm_.size(), average_input::raw, "local_sgd").wait();
    return true;
  }

  /// Records each average of the parameters as a span in `rec` (track "local_steps 0"; null: stop).
  void set_recorder(timeline::recorder* rec) noexcept { rec_ = rec; }

  /// Inner steps counted so far.
  [[nodiscard]] std::int64_t inner_steps() const noexcept { return steps_; }

 private:
  communicator_ref comm_;
  std::vector<tensor_view> params_;
  local_sgd_options options_;
  std::int64_t steps_ = 0;
  timeline::recorder* rec_ = nullptr;  // optional (set_recorder)
};

}  // namespace ddp
