#pragma once
/// @file local_steps/fragment.hpp
/// @brief What DiLoCo and Streaming DiLoCo share: the checks on the parameters a trainer
/// registers, and `detail::outer_fragment`, the outer step of one group of parameters (its
/// anchor, its outer gradients, their exchange, the outer optimizer, the merge).

#include <cstddef>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ddp/communicator.hpp>
#include <ddp/detail/host_reduce.hpp>
#include <ddp/error.hpp>
#include <ddp/local_steps/outer_exchange.hpp>
#include <ddp/local_steps/outer_sgd.hpp>
#include <ddp/tensor.hpp>
#include <ddp/timeline.hpp>

namespace ddp::detail {

/// Checks what `caller` was given: at least one parameter, each in host memory, floating point,
/// with data behind a non-zero count; and `sync_every` >= 1.
/// @throws usage_error naming the first bad parameter or knob
inline void check_local_steps(communicator_ref comm, std::span<const tensor_view> params, int sync_every,
                              const char* caller) {
  if (params.empty()) throw usage_error(comm.rank(), caller, "no parameters registered");
  if (sync_every < 1) {
    throw usage_error(comm.rank(), caller, "sync_every is " + std::to_string(sync_every) + "; it must be at least 1");
  }
  for (std::size_t i = 0; i < params.size(); ++i) {
    const tensor_view& p = params[i];
    const std::string which = "parameter " + std::to_string(i);
    if (!p.where.is_host()) {
      throw usage_error(comm.rank(), caller, which + " is on " + p.where.str() + "; local steps need host tensors");
    }
    if (!is_floating(p.type)) {
      throw usage_error(comm.rank(), caller,
                        which + " is " + std::string(name_of(p.type)) + "; local steps need floating-point tensors");
    }
    if (p.data == nullptr && p.count > 0) throw usage_error(comm.rank(), caller, which + " has no data");
  }
}

/// One group of parameters under an outer optimizer. `start()` takes the outer gradient
/// (anchor - parameters) and launches its average; `finish(alpha)` completes it (`wait()`), moves
/// the anchor by one outer step (the anchor becomes the new global parameters) and merges them
/// into the parameters (`apply(alpha)`); a fault-tolerant trainer calls those two apart, with the
/// commit vote between, and `reset()` to drop the inner steps of a step that did not commit.
template <outer_optimizer O>
class outer_fragment {
 public:
  /// Anchors `params` at their current values; `outer` is prepared for them.
  outer_fragment(communicator_ref comm, std::vector<tensor_view> params, O outer, outer_wire wire, const char* caller)
      : params_(std::move(params)), outer_(std::move(outer)) {
    std::vector<tensor_view> grads;
    for (const tensor_view& p : params_) {
      anchor_bytes_.emplace_back(p.data == nullptr ? nullptr : p.byte_data(), p.byte_data() + p.bytes());
      grad_bytes_.emplace_back(p.bytes());
      anchor_.push_back({anchor_bytes_.back().data(), p.count, p.type, device::host()});
      grads.push_back({grad_bytes_.back().data(), p.count, p.type, device::host()});
    }
    try {
      outer_.prepare(anchor_);
    } catch (const usage_error& e) {  // the policy knows no rank: say which rank and component
      throw usage_error(comm.rank(), std::string(caller) + " outer optimizer " + e.operation(), e.message());
    }
    grads_ = grads;
    for (const tensor_view& g : grads_) bytes_ += g.bytes();
    exchange_.emplace(comm, std::move(grads), wire, caller);
  }
  outer_fragment(const outer_fragment&) = delete;  // its views point into its own buffers
  outer_fragment& operator=(const outer_fragment&) = delete;
  /// Moves keep the buffers, so the views stay valid.
  outer_fragment(outer_fragment&&) noexcept = default;
  /// @copydoc outer_fragment(outer_fragment&&)
  outer_fragment& operator=(outer_fragment&&) noexcept = default;
  ~outer_fragment() = default;

  /// True while an outer gradient is on its way.
  [[nodiscard]] bool in_flight() const noexcept { return exchange_->in_flight(); }

  /// Outer gradient = anchor - parameters (in the compute type, rounded once to the parameter's
  /// dtype), then its average over `divisor` ranks (0: every rank) launched. A rank that does
  /// not `contribute` (it has no inner steps since the anchor) sends zeros.
  void start(int divisor = 0, bool contribute = true) {
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const tensor_view& p = params_[i];
      if (!contribute) {
        if (p.count > 0) std::memset(grads_[i].data, 0, p.bytes());
        continue;
      }
      visit_dtype(p.type, [&]<class T>(T) {
        if constexpr (std::is_floating_point_v<compute_t<T>>) {
          const T* a = static_cast<const T*>(anchor_[i].data);
          const T* x = static_cast<const T*>(p.data);
          T* g = static_cast<T*>(grads_[i].data);
          for (std::size_t k = 0; k < p.count; ++k) g[k] = store<T>(load(a[k]) - load(x[k]));
        }
      });
    }
    exchange_->start(divisor);
    if (rec_ && rec_->enabled()) sent_at_ = clock::now();
  }

  /// Drives the exchange forward.
  void poll() {
    if (in_flight()) exchange_->test();
  }

  /// Completes the exchange, steps the anchor, merges it into the parameters with weight `alpha`.
  void finish(double alpha) {
    wait();
    apply(alpha);
  }

  /// Completes the exchange: the outer gradients hold their average. Recorded as an "outer
  /// exchange" span on track "local_steps <index>" (from `start()` to now) when a recorder is set.
  void wait() {
    exchange_->finish();
    if (rec_ && rec_->enabled()) {
      rec_->span({"local_steps", index_}, "outer exchange", sent_at_, clock::now(),
                 {{"bytes", static_cast<double>(bytes_)}});
    }
  }

  /// Records the exchanges in `rec` (null: stop), on track "local_steps <index>".
  void set_recorder(timeline::recorder* rec, int index) noexcept {
    rec_ = rec;
    index_ = index;
  }

  /// Steps the anchor by the averaged outer gradient and merges it into the parameters with
  /// weight `alpha`: `(1 - alpha) * local + alpha * global` (alpha 1: a copy of the global ones).
  void apply(double alpha) {
    outer_.step(anchor_, grads_);
    if (alpha == 1.0) {
      reset();
      return;
    }
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const tensor_view& p = params_[i];
      if (alpha == 0.0) continue;
      visit_dtype(p.type, [&]<class T>(T) {
        if constexpr (std::is_floating_point_v<compute_t<T>>) {
          const T* a = static_cast<const T*>(anchor_[i].data);
          T* x = static_cast<T*>(p.data);
          for (std::size_t k = 0; k < p.count; ++k) {
            const double mixed =
                (1.0 - alpha) * static_cast<double>(load(x[k])) + alpha * static_cast<double>(load(a[k]));
            x[k] = store<T>(static_cast<compute_t<T>>(mixed));
          }
        }
      });
    }
  }

  /// The parameters become exactly the anchor (the global parameters), whatever they were.
  void reset() {
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (params_[i].count > 0) std::memcpy(params_[i].data, anchor_[i].data, params_[i].bytes());
    }
  }

  /// The anchor (the global parameters of the last outer step), then the outer optimizer's state.
  [[nodiscard]] std::vector<tensor_view> state() {
    std::vector<tensor_view> s = anchor_;
    for (const tensor_view& t : outer_.state()) s.push_back(t);
    return s;
  }

  /// The outer optimizer.
  [[nodiscard]] const O& outer() const noexcept { return outer_; }

 private:
  std::vector<tensor_view> params_;
  O outer_;
  std::vector<std::vector<std::byte>> anchor_bytes_;
  std::vector<std::vector<std::byte>> grad_bytes_;
  std::vector<tensor_view> anchor_;
  std::vector<tensor_view> grads_;
  std::optional<outer_exchange> exchange_;
  timeline::recorder* rec_ = nullptr;  // optional (set_recorder)
  int index_ = 0;
  std::size_t bytes_ = 0;  // of the outer gradients, as a span's argument
  clock::time_point sent_at_{};
};

}  // namespace ddp::detail
