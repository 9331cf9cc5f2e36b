#pragma once
/// @file bucketer.hpp
/// @brief `Bucketer<Policy>`: averages gradients across ranks while the backward pass still runs.
///
/// A trainer calls `mark_ready(i)` as each gradient is computed and `finalize()` at the end of
/// the backward pass; gradients are grouped into buckets by the layout `Policy`, and a bucket's
/// collective starts as soon as its last gradient is ready. This header is the public class; its
/// knobs, paths and statistics are in bucketer/options.hpp, the engine in bucketer/engine.hpp,
/// layout policies in ddp/bucketing/, comm hooks in ddp/hooks/. How it works, the per-bucket
/// paths, progress and no_sync: docs/bucketer.md; device gradients: docs/gpu-training.md.

#include <concepts>
#include <cstddef>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <ddp/bucket_layout.hpp>
#include <ddp/bucketer/engine.hpp>
#include <ddp/bucketer/options.hpp>
#include <ddp/bucketing/size_capped.hpp>
#include <ddp/comm_hook.hpp>
#include <ddp/communicator.hpp>
#include <ddp/device_runtime.hpp>
#include <ddp/error.hpp>
#include <ddp/gradient_hooks.hpp>
#include <ddp/joinable.hpp>
#include <ddp/straggler.hpp>
#include <ddp/tensor.hpp>
#include <ddp/timeline.hpp>
#include <ddp/work.hpp>

/// @cond DDP_INTERNAL
// static_assert needs a string literal, so the text shared by both add() overloads is a macro.
#define DDP_BUCKETER_GRADIENT_LVALUE_MESSAGE                                                                   \
  "Bucketer::add: pass the gradient as an lvalue (the object the trainer's autograd writes): the Bucketer "    \
  "keeps a reference to it and re-reads it at every mark_ready, so a temporary would dangle. Temporaries are " \
  "accepted for handle types (ddp::is_tensor_handle_v) and ddp::tensor_view"
/// @endcond

namespace ddp {

/// Averages a fixed set of registered gradients across the ranks of a communicator, bucket by
/// bucket, while the backward pass runs (see the file description). Neither copyable nor
/// movable: attached hooks and zero-copy gradient views point into it. Models `joinable`.
template <bucketing_policy Policy = bucketing::size_capped>
class Bucketer : private detail::bucketer_engine {
 public:
  using policy_type = Policy;  ///< the layout policy

  /// @param comm     communicator for all of this Bucketer's collectives (must outlive it)
  /// @param policy   layout policy (its knobs: `{.cap_bytes = 50 << 20}`)
  /// @param options  behaviour that is not about the layout
  explicit Bucketer(communicator_ref comm, Policy policy = {}, bucketer_options options = {})
      : detail::bucketer_engine(comm, options, rebuilding_policy<Policy>), policy_(std::move(policy)) {}
  /// The default-constructed layout policy with `options`:
  /// `Bucketer grads(comm, bucketer_options{.find_unused_parameters = true})` (or `{.find_unused_parameters = true}`).
  /// @param comm     communicator for all of this Bucketer's collectives (must outlive it)
  /// @param options  behaviour that is not about the layout
  Bucketer(communicator_ref comm, bucketer_options options) : Bucketer(comm, Policy{}, options) {}

  Bucketer(const Bucketer&) = delete;  // hooks and bucket views point into this object
  Bucketer& operator=(const Bucketer&) = delete;
  /// Removes every attached hook; in-flight collectives are abandoned (never waited on with a
  /// collective, never thrown from here).
  ~Bucketer() { progress_.stop(); }

  // ---- registration ------------------------------------------------------------------------

  /// Registers a gradient (any `tensor`, or a `tensor_view`); returns its index. Before `build()` only.
  ///
  /// What the Bucketer keeps decides whether it can follow a gradient that moves:
  /// - an lvalue (`p.mutable_grad()`, `p.grad()`, a `std::vector` member): a reference to that
  ///   object, the gradient's *slot*, re-read at every `mark_ready` of the copy path. A gradient
  ///   the trainer (or its framework: `zero_grad(set_to_none=true)`) replaced since the last step
  ///   is followed: copied in from, and written back to, its new memory. The object must outlive
  ///   the Bucketer; its element count, dtype and device must not change.
  /// - a temporary of a handle type (`is_tensor_handle_v`, e.g. `std::span`): a copy of the
  ///   handle, re-read the same way (it cannot see a slot it is not).
  /// - a `tensor_view`: that view, fixed.
  /// - a temporary of any other type does not compile (it would dangle).
  /// @throws usage_error as `add(tensor_view)`
  ///
  /// `name` (optional, e.g. the parameter's name in its module) is used in every error about
  /// this gradient.
  template <class G>
  std::size_t add(G&& gradient, std::string_view name = {}) {
    if constexpr (!detail::viewable<G>) {
      detail::explain_not_a_tensor<G>();
      return 0;
    } else if constexpr (!kept_safely<G>) {
      static_assert(detail::not_a_tensor_v<G>, DDP_BUCKETER_GRADIENT_LVALUE_MESSAGE);
      return 0;
    } else {
      const tensor_view v = ddp::view(gradient);
      return add_entry(std::nullopt, v, {}, gradient_source(std::forward<G>(gradient)), name, built_, dev_.problem(v));
    }
  }
  /// Registers a gradient given as a view; returns its index. Before `build()` only. The view is
  /// fixed: a gradient that moves cannot be followed (register the tensor itself for that).
  /// @throws usage_error after `build()`, for non-host memory, a null data pointer, or memory
  ///   already registered
  std::size_t add(tensor_view gradient, std::string_view name = {}) {
    return add_entry(std::nullopt, gradient, {}, {}, name, built_, dev_.problem(gradient));
  }

  /// Registers a parameter with its gradient. The parameter is only used when joining ranks
  /// agree on the final model (broadcast from the last rank to join). The gradient is kept as by
  /// `add(gradient)`; the parameter as a copy if it is a handle (`is_tensor_handle_v`, e.g. the
  /// loop variable of `for (auto& p : model->parameters())`), else as its view (its memory must
  /// stay where it is).
  /// `name` as in `add(gradient, name)`.
  /// @throws usage_error if the two differ in element count or dtype, or as `add(tensor_view)`
  template <class P, class G>
  requires(!std::is_convertible_v<G, std::string_view>)  // add(gradient, name) is the other overload
      std::size_t add(P&& parameter, G&& gradient, std::string_view name = {}) {
    if constexpr (!detail::viewable<P>) {
      detail::explain_not_a_tensor<P>();
      return 0;
    } else if constexpr (!detail::viewable<G>) {
      detail::explain_not_a_tensor<G>();
      return 0;
    } else if constexpr (!kept_safely<P>) {
      static_assert(detail::not_a_tensor_v<P>,
                    "Bucketer::add: pass the parameter as an lvalue (a temporary would dangle); temporaries are "
                    "accepted for handle types (ddp::is_tensor_handle_v) and ddp::tensor_view");
      return 0;
    } else if constexpr (!kept_safely<G>) {
      static_assert(detail::not_a_tensor_v<G>, DDP_BUCKETER_GRADIENT_LVALUE_MESSAGE);
      return 0;
    } else {
      const tensor_view pv = ddp::view(parameter);
      const tensor_view gv = ddp::view(gradient);
      check_pair(pv, gv, name);
      detail::tensor_source ps;
      if constexpr (is_tensor_handle_v<P>)
        ps = detail::tensor_source::holding(std::remove_cvref_t<P>(std::forward<P>(parameter)));
      return add_entry(pv, gv, std::move(ps), gradient_source(std::forward<G>(gradient)), name, built_,
                       dev_.problem(gv));
    }
  }
  /// Registers a parameter with its gradient, given as views (both fixed); returns the gradient's index.
  /// @throws usage_error if the two differ in element count or dtype, or as `add(tensor_view)`
  std::size_t add(tensor_view parameter, tensor_view gradient, std::string_view name = {}) {
    check_pair(parameter, gradient, name);
    return add_entry(parameter, gradient, {}, {}, name, built_, dev_.problem(gradient));
  }

  /// Replaces the per-bucket collective (default: `hooks::allreduce_average`). Before `build()`.
  void register_comm_hook(comm_hook hook) {
    if (built_) throw usage_error(comm_.rank(), "Bucketer::register_comm_hook", "must be called before build()");
    if (!hook) throw usage_error(comm_.rank(), "Bucketer::register_comm_hook", "empty hook");
    hook_ = std::move(hook);
    default_hook_ = false;
  }

  /// Called with (index, new view) for every gradient whenever bucket storage is (re)allocated,
  /// in zero-copy mode: rebind the trainer's gradient tensors there.
  void on_rebind(std::function<void(std::size_t, tensor_view)> fn) { on_rebind_ = std::move(fn); }

  /// Attaches `mark_ready(i)` to the trainer's autograd for every registered gradient, keyed by
  /// its index. The hooks are removed when this Bucketer is destroyed (or by `detach()`); the
  /// registry must outlive the Bucketer.
  template <gradient_hook_registry R>
  void attach(R& registry) {
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      attached_.emplace_back(registry, i, [this, i] { mark_ready(i); });
    }
  }
  /// Removes every attached hook now.
  void detach() noexcept { attached_.clear(); }
  /// Number of hooks currently attached by `attach()`.
  [[nodiscard]] std::size_t attached_hooks() const noexcept { return attached_.size(); }

  /// Computes the layout, allocates buckets and (with `check_layout`) verifies that every rank
  /// registered the same gradients and built the same layout. Collective: call on every rank.
  /// Called implicitly by the first `mark_ready` / `finalize` if not called before.
  void build() {
    std::lock_guard lk(mutex_);
    build_locked();
  }

  // ---- per iteration -----------------------------------------------------------------------

  /// Device gradients: the stream the backward pass runs on. `mark_ready(i)` records an event on
  /// it (gradient i is produced by the work enqueued there so far), and `finalize()` makes it wait
  /// for the averaged gradients. Set it before an iteration; the stream must outlive its use.
  /// @throws usage_error if the communicator has no device stream
  void set_compute_stream(device_stream stream) {
    if (!dev_.on_device()) {
      throw usage_error(comm_.rank(), "Bucketer::set_compute_stream",
                        "the communicator runs its collectives on host memory: a compute stream is for device "
                        "gradients over a device communicator (ddp::nccl::communicator)");
    }
    std::lock_guard lk(mutex_);
    dev_.set_compute_stream(stream, built_.load());
  }

  /// Device gradient `i` was written by the work that `produced` captured (an event the trainer
  /// recorded after the gradient's kernel): the copy into the bucket waits for it on the device,
  /// the host does not. Otherwise as `mark_ready(i)`.
  /// @throws usage_error for a host gradient, or as `mark_ready(i)`
  void mark_ready(std::size_t i, device_event produced) {
    if (!dev_.on_device()) {
      throw usage_error(comm_.rank(), "Bucketer::mark_ready",
                        "an event was passed for gradient " + std::to_string(i) +
                            ", but this Bucketer's gradients are in host memory: call mark_ready(i)");
    }
    if (!produced) {
      throw usage_error(comm_.rank(), "Bucketer::mark_ready",
                        "an empty event was passed for gradient " + std::to_string(i));
    }
    mark_ready_impl(i, produced);
  }

  /// Gradient `i` is final for this iteration. Thread-safe: may be called concurrently for
  /// different gradients. Launches every bucket that became ready, in layout order. A device
  /// gradient is produced by the work enqueued on the compute stream so far (`set_compute_stream`).
  void mark_ready(std::size_t i) { mark_ready_impl(i, device_event{}); }

 private:
  void mark_ready_impl(std::size_t i, device_event produced) {
    if (i >= entries_.size()) {
      throw usage_error(comm_.rank(), "Bucketer::mark_ready",
                        "gradient index " + std::to_string(i) + " out of range: " + std::to_string(entries_.size()) +
                            " gradients registered");
    }
    if (!built_.load(std::memory_order_acquire)) build();
    mark(i, produced);
  }

 public:
  /// End of the backward pass: launches what is left (zeros for unused gradients if enabled),
  /// waits for every bucket and writes the averaged gradients back. After it returns, all
  /// registered gradients hold the same bits on every rank.
  ///
  /// Device gradients: the copies back are enqueued behind the collectives, and the compute
  /// stream (`set_compute_stream`) waits for them on the device; the host does not wait, so the
  /// gradients hold the average for work enqueued on the compute stream from now on. A collective
  /// that already failed is rethrown; one that fails later surfaces at the next wait (the
  /// backend's errors are sticky). Without a compute stream it is `finalize_blocking()`.
  /// @throws usage_error if gradients were never marked (and find_unused_parameters is off), naming them
  /// @throws communication_error / timeout_error from the collectives
  void finalize() { finalize_impl(false); }

  /// `finalize()`, then the host waits until the averaged gradients are in place (for host
  /// gradients, what `finalize()` does anyway).
  /// @throws as `finalize()`
  void finalize_blocking() { finalize_impl(true); }

 private:
  void finalize_impl(bool blocking) {
    if (!built_.load(std::memory_order_acquire)) build();
    finish(blocking);
  }

 public:
  /// RAII scope in which iterations only accumulate locally (no communication). The next
  /// synchronised iteration averages every gradient accumulated meanwhile, also one that it does
  /// not mark itself. Scopes nest: ending one restores the state it found. Movable (e.g. into a
  /// `std::optional`); a moved-from scope does nothing when it ends.
  class [[nodiscard]] no_sync_scope {
   public:
    /// Enters the scope on `b` if `enabled`; prefer `Bucketer::no_sync()`, which also checks the iteration.
    explicit no_sync_scope(Bucketer& b, bool enabled = true) : b_(enabled ? &b : nullptr) {
      if (b_ != nullptr) ++b_->no_sync_depth_;
    }
    /// Takes over `other`'s scope; `other` then ends nothing.
    no_sync_scope(no_sync_scope&& other) noexcept : b_(std::exchange(other.b_, nullptr)) {}
    /// Ends this scope, then takes over `other`'s.
    no_sync_scope& operator=(no_sync_scope&& other) noexcept {
      if (this != &other) {
        end();
        b_ = std::exchange(other.b_, nullptr);
      }
      return *this;
    }
    no_sync_scope(const no_sync_scope&) = delete;
    no_sync_scope& operator=(const no_sync_scope&) = delete;
    ~no_sync_scope() { end(); }
    /// True if this scope turned syncing off (false: disabled, moved from, or ended).
    [[nodiscard]] bool active() const noexcept { return b_ != nullptr; }
    /// Ends the scope now (restores the state it found); the destructor then does nothing.
    void end() noexcept {
      if (b_ != nullptr) --b_->no_sync_depth_;  // a count: scopes may even end out of order
      b_ = nullptr;
    }

   private:
    Bucketer* b_;
  };
  /// Enters a no-sync scope: until it ends, `mark_ready` and `finalize` communicate nothing.
  /// `no_sync(false)` returns a scope that changes nothing (PyTorch's `nullcontext`), for a
  /// conditional `auto scope = grads.no_sync(micro + 1 < micro_batches);`.
  /// @throws usage_error in the middle of an iteration (after a `mark_ready`)
  no_sync_scope no_sync(bool enabled = true) {
    if (enabled && started_) {
      throw usage_error(comm_.rank(), "Bucketer::no_sync",
                        "entered in the middle of an iteration (gradients were already marked ready)");
    }
    return no_sync_scope(*this, enabled);
  }
  /// False inside a no-sync scope.
  [[nodiscard]] bool syncing() const noexcept { return no_sync_depth_ == 0; }
  /// True once `build()` chose the direct path: buckets are coalesced calls over the gradients
  /// themselves, on a backend that stages its input (see the file comment).
  [[nodiscard]] bool direct() const noexcept { return direct_; }

  // ---- zero-copy access ----------------------------------------------------------------------

  /// Gradient `i`'s place in bucket storage (valid after `build()` until the next rebind).
  [[nodiscard]] tensor_view gradient_view(std::size_t i) {
    if (!built_) build();
    return slot(entries_.at(i));
  }
  /// Typed `gradient_view(i)`.
  /// @throws usage_error if gradient `i` is not of dtype `dtype_v<T>`
  template <element T>
  [[nodiscard]] std::span<T> gradient(std::size_t i) {
    const tensor_view v = gradient_view(i);
    if (!v.where.is_host()) {
      throw usage_error(comm_.rank(), "Bucketer::gradient",
                        label(i) + " is on " + v.where.str() +
                            ": a span would let the host touch device memory; use gradient_view(i)");
    }
    if (v.type != dtype_v<T>) {
      throw usage_error(comm_.rank(), "Bucketer::gradient",
                        label(i) + " is " + std::string(name_of(v.type)) + ", not " + std::string(name_of(dtype_v<T>)));
    }
    return v.as<T>();
  }

  // ---- introspection -------------------------------------------------------------------------

  /// Number of registered gradients.
  [[nodiscard]] std::size_t size() const noexcept { return entries_.size(); }
  /// Layout in use (empty before `build()`; a rebuilding policy may change it once).
  [[nodiscard]] const bucket_layout& layout() const noexcept { return layout_; }
  /// Fingerprint of the registered gradients and the layout, the value `check_layout` compares
  /// across ranks (0 before `build()`).
  [[nodiscard]] std::uint64_t layout_fingerprint() const noexcept { return fingerprint_; }
  /// Statistics of the last completed iteration (synchronised or shadowed).
  [[nodiscard]] const step_stats& last_step() const noexcept { return stats_; }
  /// The layout policy.
  [[nodiscard]] const Policy& policy() const noexcept { return policy_; }
  /// The options.
  [[nodiscard]] const bucketer_options& options() const noexcept { return opts_; }
  /// Communicator of every collective of this Bucketer.
  [[nodiscard]] communicator_ref communicator() const noexcept { return comm_; }

  /// Records this Bucketer's events in `rec` (null: stop): a `backward` mark per `mark_ready`,
  /// each bucket's collective on its own track, the finalize wait, the step. Set it between
  /// iterations; `rec` must outlive the Bucketer or be unset first.
  void set_recorder(timeline::recorder* rec) noexcept { rec_ = rec; }
  /// The recorder set with `set_recorder` (null if none).
  [[nodiscard]] timeline::recorder* recorder() const noexcept { return rec_; }

  // ---- joinable (see joinable.hpp) -----------------------------------------------------------

  /// Same as `communicator()`: the join bookkeeping runs there.
  [[nodiscard]] communicator_ref join_communicator() const noexcept { return comm_; }
  /// False inside a no-sync scope: this iteration launches no bucket collectives.
  [[nodiscard]] bool join_will_communicate() const noexcept { return no_sync_depth_ == 0; }
  /// Records the round's divisor (`join_round::divisor()`) for the iteration about to start
  /// (`notify()` precedes its collectives), so averages stay correct once some ranks have joined,
  /// and its order token, told when the first bucket launches.
  void join_notified(const join_round& round) noexcept {
    notified_divisor_ = round.divisor();
    order_token_ = round.order_token;
  }
  /// Buckets launch during the backward pass (the context's first guess at the issue order).
  [[nodiscard]] static constexpr join_phase join_issue_phase() noexcept { return join_phase::backward; }

  /// Join hook: the main hook mirrors one synchronised iteration with zero gradients (same hook,
  /// same buckets, same order); the post hook broadcasts the registered parameters from the
  /// authoritative rank so that every rank ends with the same model.
  class join_hook_type {
   public:
    /// Hook of Bucketer `b`, which must outlive it.
    explicit join_hook_type(Bucketer& b) : b_(&b) {}
    /// Runs one shadow iteration: every bucket zeroed and passed to the comm hook with
    /// `shadow = true`, plus the used-gradient map and a pending rebuild, so this rank issues
    /// the same collectives as the training ranks.
    void main_hook(const join_round& round) {
      if (!b_->built_.load()) b_->build();
      b_->shadow_iteration(round);
    }
    /// `broadcast_parameters(summary.authoritative_rank)`.
    void post_hook(const join_summary& summary) { b_->broadcast_parameters(summary.authoritative_rank); }

   private:
    Bucketer* b_;
  };
  /// The join hook of this Bucketer (the options are read from each `join_round` instead).
  [[nodiscard]] join_hook_type join_hook(const join_hook_options&) { return join_hook_type(*this); }

  /// Broadcasts every registered parameter from `root` (one coalesced collective). Collective.
  /// A parameter held as a handle is re-read first.
  /// @throws usage_error if a held parameter changed its element count, dtype or device
  void broadcast_parameters(int root) { broadcast_parameters_from(root); }

 private:
  void build_locked() {
    if (built_.load()) return;
    install_built(policy_.layout(infos()));
  }

  bucket_layout rebuilt_layout(const std::vector<gradient_info>& grads,
                               const std::vector<std::size_t>& order) override {
    if constexpr (rebuilding_policy<Policy>) {
      return policy_.rebuild(grads, order);
    } else {
      return layout_;  // never asked: only a rebuilding policy schedules a rebuild
    }
  }

  Policy policy_;
  std::vector<attached_hook> attached_;  // destroyed first: its hooks call into this object
};

}  // namespace ddp

#undef DDP_BUCKETER_GRADIENT_LVALUE_MESSAGE
