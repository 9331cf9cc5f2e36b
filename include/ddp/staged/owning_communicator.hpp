#pragma once
/// @file staged/owning_communicator.hpp
/// @brief `ddp::staged::owning_communicator<Host>`: a staged communicator together with the host
/// communicator it runs over, as one movable value: what a Manager's communicator factory
/// returns for device replicas over gloo (docs/fault-tolerance.md, "On GPUs").

#include <memory>
#include <span>
#include <utility>

#include <ddp/communicator.hpp>
#include <ddp/staged/communicator.hpp>

namespace ddp::staged {

/// Owns a host communicator and the staged communicator over it (destroyed first); every call
/// goes to the staged one. Models `device_communicator` and `premul_sum_communicator`.
template <ddp::communicator Host>
class owning_communicator {
 public:
  /// The staged communicator over `host` on `where` of `rt` (see `communicator`).
  owning_communicator(Host host, device_runtime& rt, device where, options opts = {})
      : host_(std::make_unique<Host>(std::move(host))),
        staged_(std::make_unique<communicator>(*host_, rt, where, std::move(opts))) {}
  /// Takes over both; the source may only be destroyed.
  owning_communicator(owning_communicator&&) noexcept = default;
  /// Not assignable: the old host communicator must outlive the old staged one.
  owning_communicator& operator=(owning_communicator&&) = delete;
  /// The staged communicator goes first (its thread uses the host one).
  ~owning_communicator() = default;

  /// This rank.
  [[nodiscard]] int rank() const { return staged_->rank(); }
  /// Ranks.
  [[nodiscard]] int size() const { return staged_->size(); }
  /// The staged communicator's runtime, stream and device.
  [[nodiscard]] ddp::device_queue device_queue() const { return staged_->device_queue(); }
  /// The host communicator.
  [[nodiscard]] Host& host() noexcept { return *host_; }
  /// The staged communicator.
  [[nodiscard]] communicator& staged() noexcept { return *staged_; }

  /// As `communicator::allreduce`.
  work allreduce(std::span<const tensor_view> ts, reduce_op op) { return staged_->allreduce(ts, op); }
  /// As `communicator::allreduce_premul_sum`.
  work allreduce_premul_sum(std::span<const tensor_view> ts, double factor) {
    return staged_->allreduce_premul_sum(ts, factor);
  }
  /// As `communicator::broadcast`.
  work broadcast(std::span<const tensor_view> ts, int root) { return staged_->broadcast(ts, root); }
  /// As `communicator::allgather`.
  work allgather(tensor_view in, tensor_view out) { return staged_->allgather(in, out); }
  /// As `communicator::reduce_scatter`.
  work reduce_scatter(tensor_view in, tensor_view out, reduce_op op) { return staged_->reduce_scatter(in, out, op); }
  /// As `communicator::barrier`.
  work barrier() { return staged_->barrier(); }
  /// As `communicator::abort`.
  void abort() noexcept { staged_->abort(); }

 private:
  std::unique_ptr<Host> host_;
  std::unique_ptr<communicator> staged_;  // declared last: destroyed first
};

}  // namespace ddp::staged
