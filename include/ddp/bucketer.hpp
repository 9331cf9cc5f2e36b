#pragma once
/// @file bucketer.hpp
/// @brief `Bucketer<Policy>`: averages gradients across ranks while the backward pass still runs.
///
/// Per iteration a trainer calls `mark_ready(i)` as each gradient is computed (from any thread, or
/// through hooks attached to its own autograd with `attach()`), then `finalize()`, after which every
/// registered gradient holds the average over ranks. Gradients are grouped into buckets by the
/// layout `Policy`; a bucket's collective (the comm hook) starts as soon as its last gradient is
/// ready, buckets launch in layout order on every rank, and overlap works from the first iteration.
///
/// Progress: Open MPI does not advance a non-blocking collective between library calls, and ddp's
/// MPI ring advances an allreduce only when its own handle is tested, so every `mark_ready` tests
/// every in-flight bucket. That costs a few cheap calls per gradient and needs no extra thread,
/// which on small machines would compete with the backward pass for cores. `finalize()` then
/// drives all remaining buckets round-robin and copies each back as soon as it completes.
///
/// Averaging: with the default hook on the copy path, the division by the number of ranks is fused
/// into the copy into the bucket (as PyTorch's `mul_out`), which runs during the backward pass;
/// the bucket then needs only a sum. Zero-copy and integer buckets use the backend's `avg`.
///
/// Backends that stage their input (`stages_input()`: the shared-memory backend copies every
/// input into the node's segment anyway): with the default hook on the copy path, a bucket is one
/// coalesced call over the trainer's gradients themselves — no copy into the bucket, none back,
/// and the division is the backend's pre-multiplied sum, done in its copy in. The averaged values
/// are then written into the gradients when the bucket's collective completes (during the
/// backward pass for a synchronous backend), so a gradient must not be written after its
/// `mark_ready` (it is final, as in PyTorch). `bucketer_options::direct_when_staged` turns it off.
///
/// Contiguous gradients (all gradients in one allocation, as llm.c keeps them): when a bucket's
/// gradients lie back to back in memory in the bucket's order, the bucket *is* that memory. On
/// the copy path with the default hook, `mark_ready` then divides the gradient in place instead of
/// copying it into the bucket (the same bits as the copy's division), the bucket's sum runs on the
/// trainer's memory, and nothing is copied back. The collective is the one the copy path issues
/// (a sum of the same values at the same offsets), so ranks whose gradients are laid out
/// differently still agree, bit for bit. Adjacency is checked at `build()` and again at launch: if
/// a gradient moved since, the bucket's (already divided) gradients are copied in and it works as
/// usual. On the direct path adjacent gradients are merged into one tensor of the coalesced call.
/// `bucket_stats::in_place` tells which buckets ran on the trainer's memory.
///
/// Gradients that move: a gradient registered as an lvalue is re-read at every `mark_ready` of
/// the copy path (one compare when nothing moved), so a gradient that a framework replaced since
/// the last step (`zero_grad(set_to_none=true)`) is followed to its new memory, averaged and
/// written back there. Zero-copy gradients live in the Bucketer's storage and are not re-read.
///
/// Device gradients (over a device communicator: NCCL, or the emulated device of the tests): buckets
/// live in device memory, allocated on the communicator's stream. Every copy is stream-ordered on
/// that stream and nothing waits on the host. `mark_ready(i)` makes the stream wait for an event
/// recorded on the trainer's compute stream (`set_compute_stream`), or for the event the trainer
/// passes (`mark_ready(i, event)`), then enqueues the copy into the bucket; a bucket's collective
/// averages on the device (the backend's pre-multiplied sum or `avg`); its copy back is enqueued
/// right behind it. `finalize()` makes the compute stream wait for all of it, without blocking the
/// host; `finalize_blocking()` also waits on the host. A comm hook on device buckets must enqueue
/// its work on the communicator's stream (`communicator_ref::device_queue()`).
/// `find_unused_parameters` and contiguous in-place buckets are host-only in this version.
///
/// Collectives per synchronised iteration: one per bucket (through the hook), plus one `u8` max
/// allreduce of the used-gradient map when `find_unused_parameters` is on. Construction-time
/// checks cost one allgather (`check_layout`); a rebuilding policy costs one broadcast, once.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <ddp/average.hpp>
#include <ddp/bucket_layout.hpp>
#include <ddp/bucketing/size_capped.hpp>
#include <ddp/comm_hook.hpp>
#include <ddp/communicator.hpp>
#include <ddp/detail/aligned_buffer.hpp>
#include <ddp/detail/device_buffer.hpp>
#include <ddp/device_runtime.hpp>
#include <ddp/error.hpp>
#include <ddp/gradient_hooks.hpp>
#include <ddp/hooks/allreduce_average.hpp>
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

/// Knobs of a Bucketer that are not about the layout (the layout's knobs live in the policy).
struct bucketer_options {
  /// Gradients live inside bucket storage (PyTorch's gradient_as_bucket_view): no copy in or out.
  /// The trainer writes gradient i into `gradient_view(i)` (valid after `build()`), and is told
  /// through `on_rebind` if storage moves (a rebuilding policy moves it once).
  bool zero_copy = false;
  /// Gradients not marked ready by `finalize()` count as zeros instead of being an error. A gradient
  /// unused on every rank is left untouched (copy path) or zero (zero-copy path).
  bool find_unused_parameters = false;
  /// Compare a fingerprint of the gradients and the layout across ranks in `build()` (one allgather).
  bool check_layout = true;
  /// Test the in-flight buckets on every `mark_ready` (see the file comment). Turn off only
  /// for backends that progress on their own.
  bool progress_on_mark_ready = true;
  /// If non-zero, a helper thread tests the in-flight buckets every `progress_interval` while any
  /// are in flight, so that collectives advance during long gaps between `mark_ready` calls (a
  /// large layer's backward kernel). Costs a thread that wakes at this rate during the backward
  /// pass; needs a backend that accepts calls from several threads (MPI: THREAD_MULTIPLE or
  /// SERIALIZED). Off by default: measure it (bench/overlap_bench) on your machine.
  std::chrono::microseconds progress_interval{0};
  /// Every this many synchronised iterations, `finalize()` ends with one allgather of
  /// `timing_words` int64 per rank, after which every rank knows who was slowest
  /// (`step_stats::straggler`, see straggler.hpp). 0: never. Every rank must use the same value,
  /// and ranks must agree on the iteration count (with a Manager, where a replica may start
  /// later, use 0 or 1).
  std::uint32_t straggler_every = 0;
  /// On a backend that stages its input anyway (`communicator_ref::stages_input()`), hand it the
  /// gradients directly (see the file comment): taken with the default hook, the copy path, and
  /// without `find_unused_parameters`; `direct()` says whether it was. false: always copy.
  bool direct_when_staged = true;

  /// Memberwise.
  friend bool operator==(const bucketer_options&, const bucketer_options&) = default;
};

/// What one bucket did in the last synchronised iteration.
struct bucket_stats {
  std::size_t bytes = 0;      ///< size of the bucket's storage
  std::size_t gradients = 0;  ///< gradients grouped in the bucket
  double launched_ms = -1;    ///< since the iteration's first mark_ready (-1: never)
  double completed_ms = -1;   ///< when completion was first observed
  /// The collective ran on the trainer's memory: the bucket's gradients were one block
  /// (contiguous gradients) or were handed to the backend directly (`Bucketer::direct()`).
  bool in_place = false;
};

/// What the last synchronised iteration did: read it to see whether communication is hidden.
struct step_stats {
  std::uint64_t iteration = 0;        ///< synchronised iterations so far (including this one)
  std::vector<bucket_stats> buckets;  ///< per bucket, in launch order
  double backward_ms = 0;             ///< first mark_ready to the finalize() call
  double finalize_wait_ms = 0;        ///< time finalize() spent waiting for collectives
  std::size_t collectives = 0;        ///< hook launches plus the Bucketer's own collectives
  bool shadowed = false;              ///< this rank had joined and mirrored the others' collectives
  bool rebuilt = false;               ///< the layout was rebuilt at the end of this iteration
  // ---- straggler attribution (straggler.hpp) ----
  double last_ready_ms = 0;    ///< first to last mark_ready: this rank's backward pass
  double arrival_wait_ms = 0;  ///< last mark_ready to the last bucket's completion (short: others waited for this rank)
  straggler_report straggler;  ///< every rank's timing, when exchanged (`bucketer_options::straggler_every`)
};

/// Averages a fixed set of registered gradients across the ranks of a communicator, bucket by
/// bucket, while the backward pass runs (see the file description). Neither copyable nor
/// movable: attached hooks and zero-copy gradient views point into it. Models `joinable`.
template <bucketing_policy Policy = bucketing::size_capped>
class Bucketer {
 public:
  using policy_type = Policy;  ///< the layout policy

  /// @param comm     communicator for all of this Bucketer's collectives (must outlive it)
  /// @param policy   layout policy (its knobs: `{.cap_bytes = 50 << 20}`)
  /// @param options  behaviour that is not about the layout
  explicit Bucketer(communicator_ref comm, Policy policy = {}, bucketer_options options = {})
      : comm_(comm), policy_(std::move(policy)), opts_(options), dq_(comm.device_queue()), divisor_(comm.size()) {}
  /// The default-constructed layout policy with `options`:
  /// `Bucketer grads(comm, bucketer_options{.find_unused_parameters = true})` (or `{.find_unused_parameters = true}`).
  /// @param comm     communicator for all of this Bucketer's collectives (must outlive it)
  /// @param options  behaviour that is not about the layout
  Bucketer(communicator_ref comm, bucketer_options options) : Bucketer(comm, Policy{}, options) {}

  Bucketer(const Bucketer&) = delete;  // hooks and bucket views point into this object
  Bucketer& operator=(const Bucketer&) = delete;
  /// Removes every attached hook; in-flight collectives are abandoned (never waited on with a
  /// collective, never thrown from here).
  ~Bucketer() { stop_progress_thread(); }

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
      return add_entry(std::nullopt, v, {}, gradient_source(std::forward<G>(gradient)), name);
    }
  }
  /// Registers a gradient given as a view; returns its index. Before `build()` only. The view is
  /// fixed: a gradient that moves cannot be followed (register the tensor itself for that).
  /// @throws usage_error after `build()`, for non-host memory, a null data pointer, or memory
  ///   already registered
  std::size_t add(tensor_view gradient, std::string_view name = {}) {
    return add_entry(std::nullopt, gradient, {}, {}, name);
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
      return add_entry(pv, gv, std::move(ps), gradient_source(std::forward<G>(gradient)), name);
    }
  }
  /// Registers a parameter with its gradient, given as views (both fixed); returns the gradient's index.
  /// @throws usage_error if the two differ in element count or dtype, or as `add(tensor_view)`
  std::size_t add(tensor_view parameter, tensor_view gradient, std::string_view name = {}) {
    check_pair(parameter, gradient, name);
    return add_entry(parameter, gradient, {}, {}, name);
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
    if (dq_.runtime == nullptr) {
      throw usage_error(comm_.rank(), "Bucketer::set_compute_stream",
                        "the communicator runs its collectives on host memory: a compute stream is for device "
                        "gradients over a device communicator (ddp::nccl::communicator)");
    }
    std::lock_guard lk(mutex_);
    compute_ = stream;
    has_compute_ = true;
    if (built_.load()) order_compute_after_comm();
  }

  /// Device gradient `i` was written by the work that `produced` captured (an event the trainer
  /// recorded after the gradient's kernel): the copy into the bucket waits for it on the device,
  /// the host does not. Otherwise as `mark_ready(i)`.
  /// @throws usage_error for a host gradient, or as `mark_ready(i)`
  void mark_ready(std::size_t i, device_event produced) {
    if (dq_.runtime == nullptr) {
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
    if (no_sync_depth_ > 0) {
      // Accumulated locally: the next synchronised iteration averages it even if it is not marked
      // there (docs/bucketer.md, "no_sync").
      accumulated_[i].store(true, std::memory_order_relaxed);
      return;
    }
    if (!started_.load(std::memory_order_acquire)) note_iteration_start();
    if (marked_[i].exchange(true)) {
      throw usage_error(comm_.rank(), "Bucketer::mark_ready",
                        label(i) +
                            " was marked ready twice in one iteration. Typical causes: the parameter is used "
                            "more than once with reentrant checkpointing, two hooks call mark_ready for it, or "
                            "finalize() was not called after the previous backward pass");
    }
    if (recording_) ready_order_[ready_seen_.fetch_add(1)] = i;
    if (rec_) rec_->instant("backward", "ready", clock::now(), {{"gradient", static_cast<double>(i)}});
    stage_gradient(i, produced);
    const entry& e = entries_[i];
    if (pending_[e.bucket].fetch_sub(1) == 1) {
      std::lock_guard lk(mutex_);
      launch_ready_locked();
      progress_locked();
    } else if (opts_.progress_on_mark_ready) {
      std::unique_lock lk(mutex_, std::try_to_lock);  // never make a marking thread wait for progress
      if (lk) progress_locked();
    }
  }

  // Gradient i's contribution, made ready in its bucket's path (only this call touches entry i
  // during the iteration).
  void stage_gradient(std::size_t i, device_event produced) {
    entry& e = entries_[i];
    // Copy path: re-read the gradient's slot (one compare when nothing moved) and follow it to
    // new memory, so a gradient replaced since the last step (set_to_none) is the one averaged.
    // Zero-copy: gradient i is gradient_view(i); the registered tensor gave only its shape.
    if (!opts_.zero_copy && e.grad_source.rereads()) follow_gradient(i, e, "Bucketer::mark_ready");
    if (dq_.runtime != nullptr) {
      enqueue_copy_in(i, e, produced);
    } else if (buckets_[e.bucket].user_memory) {
      // Contiguous gradients: the division the copy would fold in, done in place (same bits).
      if (e.gradient.count > 0) average_divide_in_place(e.gradient.type, e.gradient.data, e.gradient.count, divisor_);
    } else if (!opts_.zero_copy && !direct_ && e.gradient.count > 0) {
      // With the default hook, averaging's division is folded into this copy (it runs during the
      // backward pass, off the critical path); the bucket then only needs a sum (ddp/average.hpp).
      if (divides_in_copy()) {
        average_copy(e.gradient.type, slot(e).data, e.gradient.data, e.gradient.count, divisor_);
      } else {
        std::memcpy(slot(e).data, e.gradient.data, e.gradient.bytes());
      }
    }
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
    if (no_sync_depth_ > 0) {
      reset_iteration();
      return;
    }
    const auto called = clock::now();
    std::unique_lock lk(mutex_);
    reset_on_exit guard{this};
    current_.backward_ms = started_ ? ms_between(iteration_start_, called) : 0.0;
    if (!started_) {  // nothing was marked (every gradient unused): the iteration starts here
      iteration_start_ = called;
      divisor_ = notified_divisor_ > 0 ? notified_divisor_ : comm_.size();
    }

    std::vector<std::size_t> unmarked;
    std::vector<std::size_t> accumulated_only;  // produced inside no_sync, not in this iteration
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      if (marked_[i].load()) continue;
      (accumulated_[i].load(std::memory_order_relaxed) ? accumulated_only : unmarked).push_back(i);
    }
    forget_accumulated();
    if (!unmarked.empty() && !opts_.find_unused_parameters) throw_unmarked(unmarked);
    for (std::size_t i : accumulated_only) {  // their memory holds this rank's contribution
      marked_[i].store(true);
      stage_gradient(i, device_event{});
      if (pending_[entries_[i].bucket].fetch_sub(1) == 1) launch_ready_locked();
    }
    for (std::size_t i : unmarked) {  // zero contributions for unused gradients
      const entry& e = entries_[i];
      if (e.gradient.count > 0) std::memset(slot(e).data, 0, e.gradient.bytes());
      if (pending_[e.bucket].fetch_sub(1) == 1) launch_ready_locked();
    }
    work used_map = launch_used_map(unmarked);
    if (dq_.runtime != nullptr) {
      finish_on_device_locked(called, blocking || !has_compute_);
    } else {
      const bool copy_each = !opts_.zero_copy && !opts_.find_unused_parameters && !direct_;
      wait_all_locked(called, copy_each, used_map);
    }
    std::vector<std::size_t> lost;  // used elsewhere, but without memory here: thrown after the collectives
    if (opts_.find_unused_parameters) lost = copy_back();
    if (rebuild_pending_) rebuild_locked();
    current_.iteration = ++iterations_;
    observe_step_locked(called);
    stats_ = current_;
    if (!lost.empty()) throw_lost(lost);
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
    void main_hook(const join_round& round) { b_->shadow_iteration(round); }
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
  void broadcast_parameters(int root) {
    std::vector<tensor_view> params;
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      entry& e = entries_[i];
      if (!e.parameter) continue;
      if (e.param_source.rereads()) {
        const tensor_view now = e.param_source.read();
        if (!same_shape(now, *e.parameter)) {
          throw usage_error(comm_.rank(), "Bucketer::broadcast_parameters",
                            "parameter " + label_of(i, e.name) + " was registered as " +
                                std::string(name_of(e.parameter->type)) + " x " + std::to_string(e.parameter->count) +
                                " and is now " + std::string(name_of(now.type)) + " x " + std::to_string(now.count));
        }
        e.parameter = now;
      }
      params.push_back(*e.parameter);
    }
    if (params.empty()) return;
    comm_.broadcast(params, root).wait();
  }

 private:
  struct entry {
    std::optional<tensor_view> parameter;
    tensor_view gradient;  // as last read: the copy path follows a gradient that moved
    std::size_t bucket = 0;
    std::size_t offset = 0;              // elements into the bucket
    detail::tensor_source param_source;  // a held handle, re-read by broadcast_parameters
    detail::tensor_source grad_source;   // the trainer's slot (or a held handle), re-read by mark_ready
    std::string name;                    // for errors (optional)
  };
  struct bucket {
    detail::aligned_buffer storage;
    detail::device_buffer device_storage;  // device gradients: the bucket on their device
    tensor_view data;
    std::vector<std::size_t> members;  // its gradients in slot order (ascending index)
    std::vector<tensor_view> direct;   // direct mode: the gradients of this bucket, for one launch
    bool user_memory = false;          // its gradients were adjacent at build(): no copies in
    bool launched_in_place = false;    // this iteration's collective ran on the trainer's memory
    std::size_t gradients = 0;
    work inflight;
    bool launched = false;
    bool completed = false;
  };

  // Resets per-iteration state when finalize() leaves, normally or by exception, so that a
  // Bucketer whose step failed can be destroyed or used again.
  struct reset_on_exit {
    Bucketer* b;
    ~reset_on_exit() { b->reset_iteration_locked(); }
  };

  // A registered argument of type T&& can be kept without dangling: an lvalue (referred to), a
  // handle (copied) or a view.
  template <class T>
  static constexpr bool kept_safely =
      std::is_lvalue_reference_v<T> || is_tensor_handle_v<T> || std::same_as<std::remove_cvref_t<T>, tensor_view>;

  // How gradient `g` (passed as G&&) is re-read: see add(G&&).
  template <class G>
  static detail::tensor_source gradient_source(G&& g) {
    using D = std::remove_cvref_t<G>;
    if constexpr (std::same_as<D, tensor_view>) {
      return {};
    } else if constexpr (std::is_lvalue_reference_v<G>) {
      return detail::tensor_source::referring_to(g);  // the slot: sees a replaced gradient
    } else {
      return detail::tensor_source::holding(D(std::forward<G>(g)));
    }
  }

  void check_pair(tensor_view parameter, tensor_view gradient, std::string_view name) const {
    if (parameter.count != gradient.count || parameter.type != gradient.type) {
      throw usage_error(comm_.rank(), "Bucketer::add",
                        "parameter " + label_of(entries_.size(), name) + " has " + std::to_string(parameter.count) +
                            " " + std::string(name_of(parameter.type)) + " elements but its gradient has " +
                            std::to_string(gradient.count) + " " + std::string(name_of(gradient.type)));
    }
  }

  // Gradient `i`'s current view from its source; follows it if it moved (copy path).
  // @throws usage_error if its element count, dtype or device changed
  void follow_gradient(std::size_t i, entry& e, const char* op) const {
    const tensor_view now = read_gradient(i, e, op);
    if (now.data == e.gradient.data && now.count == e.gradient.count && now.type == e.gradient.type &&
        now.where == e.gradient.where) {
      return;  // the usual case: nothing moved
    }
    if (!same_shape(now, e.gradient)) throw_reshaped(i, e.gradient, now, op);
    e.gradient.data = now.data;
  }

  static bool same_shape(const tensor_view& a, const tensor_view& b) noexcept {
    return a.count == b.count && a.type == b.type && a.where == b.where && (a.count == 0 || a.data != nullptr);
  }

  [[noreturn]] void throw_reshaped(std::size_t i, const tensor_view& was, const tensor_view& now,
                                   const char* op) const {
    throw usage_error(comm_.rank(), op,
                      label(i) + " was registered as " + std::string(name_of(was.type)) + " x " +
                          std::to_string(was.count) + " on " + was.where.str() + " and is now " +
                          std::string(name_of(now.type)) + " x " + std::to_string(now.count) + " on " +
                          now.where.str() + (now.count > 0 && now.data == nullptr ? " without memory" : "") +
                          ": a gradient may move to new memory (the Bucketer follows it), but its element count, "
                          "dtype and device must stay; a gradient set to None (zero_grad(set_to_none=true)) must be "
                          "computed again, or zeroed, before it is marked ready");
  }

  std::size_t add_entry(std::optional<tensor_view> param, tensor_view grad, detail::tensor_source param_source,
                        detail::tensor_source grad_source, std::string_view name) {
    const std::size_t i = entries_.size();
    const std::string who = "gradient " + label_of(i, name);
    if (built_) throw usage_error(comm_.rank(), "Bucketer::add", who + " added after build()");
    if (const std::string why = device_problem(grad); !why.empty()) {
      throw usage_error(comm_.rank(), "Bucketer::add", who + " " + why);
    }
    if (grad.count > 0 && grad.data == nullptr) {
      throw usage_error(comm_.rank(), "Bucketer::add", who + " has no data pointer");
    }
    for (std::size_t j = 0; j < entries_.size(); ++j) {  // empty gradients own no memory: they may share an address
      const tensor_view& other = entries_[j].gradient;
      if (grad.count > 0 && other.count > 0 && grad.byte_data() < other.byte_data() + other.bytes() &&
          other.byte_data() < grad.byte_data() + grad.bytes()) {
        throw usage_error(
            comm_.rank(), "Bucketer::add",
            who + (grad.data == other.data ? " is the same memory as" : " overlaps the memory of") + " " + label(j));
      }
    }
    entries_.push_back({param, grad, 0, 0, std::move(param_source), std::move(grad_source), std::string(name)});
    return i;
  }

  // Why a gradient on `g.where` cannot be averaged over this communicator ("" if it can): host
  // gradients need a host communicator, device gradients a device communicator on their device.
  [[nodiscard]] std::string device_problem(const tensor_view& g) const {
    if (dq_.runtime == nullptr) {
      if (g.where.is_host()) return {};
      return "is on " + g.where.str() +
             ", but the communicator runs its collectives on host memory: device gradients need a device communicator "
             "(ddp::nccl::communicator)";
    }
    if (g.where == dq_.where) return {};
    return "is on " + g.where.str() + ", but the communicator's collectives run on " + dq_.where.str() +
           ": a Bucketer's gradients are all on its communicator's device";
  }

  // "3" or "3 ('fc.bias')": how errors name a gradient.
  [[nodiscard]] static std::string label_of(std::size_t i, std::string_view name) {
    std::string out = std::to_string(i);
    if (!name.empty()) out.append(" ('").append(name).append("')");
    return out;
  }
  [[nodiscard]] std::string label(std::size_t i) const {
    return "gradient " + label_of(i, i < entries_.size() ? std::string_view(entries_[i].name) : std::string_view());
  }
  // The first ten of `indices`, labelled.
  [[nodiscard]] std::string labels(const std::vector<std::size_t>& indices) const {
    std::string list;
    for (std::size_t k = 0; k < indices.size() && k < 10; ++k) {
      list += (k ? ", " : "") + label_of(indices[k], entries_[indices[k]].name);
    }
    if (indices.size() > 10) list += ", ...";
    return list;
  }
  // Gradient i's current view from its source, with this rank and its name in an error the
  // tensor type raised (which knows neither).
  [[nodiscard]] tensor_view read_gradient(std::size_t i, const entry& e, const char* op) const {
    try {
      return e.grad_source.read();
    } catch (const error& x) {
      if (x.rank() >= 0) throw;
      throw usage_error(comm_.rank(), op, label(i) + ": " + x.message());
    }
  }

  [[nodiscard]] std::vector<gradient_info> infos() const {
    std::vector<gradient_info> out;
    out.reserve(entries_.size());
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      out.push_back({i, entries_[i].gradient.count, entries_[i].gradient.type, entries_[i].gradient.where});
    }
    return out;
  }

  [[nodiscard]] tensor_view slot(const entry& e) const {
    return buckets_[e.bucket].data.slice(e.offset, e.gradient.count);
  }

  void build_locked() {
    if (built_.load()) return;
    const auto grads = infos();
    bucket_layout l = policy_.layout(grads);
    if (auto problem = detail::validate_layout(l, grads)) {
      throw usage_error(comm_.rank(), "Bucketer::build", "the layout policy returned an invalid layout: " + *problem);
    }
    if (dq_.runtime != nullptr) prepare_device();
    marked_ = std::make_unique<std::atomic<bool>[]>(entries_.size());
    accumulated_ = std::make_unique<std::atomic<bool>[]>(entries_.size());
    if constexpr (rebuilding_policy<Policy>) {
      rebuild_pending_ = true;
      recording_ = true;
      ready_order_.assign(entries_.size(), 0);
    }
    // A lazy build (at the first mark_ready) runs after notify() told this iteration's divisor:
    // installing the layout resets the iteration, but not what the join bookkeeping said.
    const int notified = notified_divisor_;
    direct_ = opts_.direct_when_staged && default_hook_ && !opts_.zero_copy && !opts_.find_unused_parameters &&
              comm_.stages_input();
    install_layout(std::move(l), false);
    notified_divisor_ = notified;
    if (opts_.check_layout) check_layout_across_ranks();
    built_.store(true, std::memory_order_release);
    if (opts_.progress_interval.count() > 0 && !progress_thread_.joinable()) {
      progress_thread_ = std::thread([this] { progress_loop(); });
    }
  }

  // Allocates bucket storage for `l` and points every entry at its slot.
  void install_layout(bucket_layout l, bool keep_values) {
    std::vector<bucket> fresh(l.buckets.size());
    std::vector<entry> moved = entries_;
    for (std::size_t b = 0; b < l.buckets.size(); ++b) {
      // Slots in registration order within the bucket (as PyTorch lays out its bucket views), so a
      // trainer that allocates its gradients in one block in that order gets contiguous buckets.
      fresh[b].members = l.buckets[b];
      std::sort(fresh[b].members.begin(), fresh[b].members.end());
      std::size_t elems = 0;
      for (std::size_t i : fresh[b].members) {
        moved[i].bucket = b;
        moved[i].offset = elems;
        elems += entries_[i].gradient.count;
      }
      const gradient_info first{0, elems, entries_[l.buckets[b].front()].gradient.type, device::host()};
      if (dq_.runtime != nullptr) {  // device gradients: the bucket on their device, ordered on the comm stream
        fresh[b].device_storage = detail::device_buffer(*dq_.runtime, dq_.where, first.bytes(), dq_.stream);
        fresh[b].data = {fresh[b].device_storage.data(), elems, first.type, dq_.where};
      } else {
        fresh[b].storage = detail::aligned_buffer(first.bytes());
        fresh[b].data = {fresh[b].storage.data(), elems, first.type, device::host()};
      }
      fresh[b].gradients = l.buckets[b].size();
    }
    if (keep_values) {  // zero-copy gradients live in the old storage: carry them over
      std::vector<copy_region> carried;
      for (std::size_t i = 0; i < entries_.size(); ++i) {
        const tensor_view from = slot(entries_[i]);
        const tensor_view to = fresh[moved[i].bucket].data.slice(moved[i].offset, entries_[i].gradient.count);
        if (from.count) carried.push_back({to.data, from.data, from.bytes()});
      }
      copy_regions(carried);  // before the old storage goes: its release is ordered after these copies
    }
    buckets_ = std::move(fresh);
    entries_ = std::move(moved);
    // Contiguous gradients need no copies (file comment): the default hook on the copy path, where
    // the bucket's collective is a sum of divided values whichever memory it runs on.
    const bool in_place_ok = divides_in_copy() && !direct_ && !opts_.find_unused_parameters;
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      buckets_[b].user_memory = in_place_ok && bucket_gradients(b).size() == 1;
    }
    layout_ = std::move(l);
    fingerprint_ = detail::layout_fingerprint(layout_, infos());
    pending_ = std::make_unique<std::atomic<std::size_t>[]>(buckets_.size());
    reset_iteration_locked();
    if (opts_.zero_copy && on_rebind_) {
      for (std::size_t i = 0; i < entries_.size(); ++i) on_rebind_(i, slot(entries_[i]));
    }
    // Device buckets were allocated (and zero-copy gradients carried over) on the comm stream:
    // the trainer's kernels on the compute stream may write into them only after that.
    if (dq_.runtime != nullptr && done_event_.get()) order_compute_after_comm();
  }

  // One allgather of (gradient count, total elements, fingerprint) per rank. Only if the ranks
  // differ, a second one of every gradient's (count, dtype, bucket) names the first gradient
  // that differs; every rank sees the same data, so every rank throws the same message.
  void check_layout_across_ranks() {
    std::size_t elems = 0;
    for (const auto& e : entries_) elems += e.gradient.count;
    const auto n = static_cast<std::size_t>(comm_.size());
    std::vector<std::int64_t> mine{static_cast<std::int64_t>(entries_.size()), static_cast<std::int64_t>(elems),
                                   static_cast<std::int64_t>(fingerprint_)};
    std::vector<std::int64_t> all(3 * n);
    comm_.allgather(view(mine), view(all)).wait();
    bool same = true;
    std::size_t most = 0;  // gradients on the rank with the most
    for (std::size_t r = 0; r < n; ++r) {
      same = same && std::equal(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(3 * r));
      most = std::max(most, static_cast<std::size_t>(std::max<std::int64_t>(all[3 * r], 0)));
    }
    if (same) return;

    std::string totals;
    for (std::size_t r = 0; r < n; ++r) {
      totals += (r ? ", " : "") + std::string("rank ") + std::to_string(r) + ": " + std::to_string(all[3 * r]) +
                " gradients / " + std::to_string(all[3 * r + 1]) + " elements";
    }
    throw usage_error(comm_.rank(), "Bucketer::build",
                      "gradients or bucket layout differ across ranks: " + first_difference(most) + " (" + totals +
                          "). Every rank must register the same gradients, in the same order, with the same policy");
  }

  // The second exchange of check_layout_across_ranks: per gradient (count, dtype, bucket), padded
  // to `most` gradients with -1 (no such gradient). Names the first gradient that differs from
  // rank 0's.
  [[nodiscard]] std::string first_difference(std::size_t most) {
    constexpr std::size_t words = 3;
    const auto n = static_cast<std::size_t>(comm_.size());
    std::vector<std::int64_t> mine(words * most, -1);
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      mine[words * i] = static_cast<std::int64_t>(entries_[i].gradient.count);
      mine[words * i + 1] = static_cast<std::int64_t>(entries_[i].gradient.type);
      mine[words * i + 2] = static_cast<std::int64_t>(entries_[i].bucket);
    }
    std::vector<std::int64_t> all(words * most * n);
    if (most > 0) comm_.allgather(view(mine), view(all)).wait();
    const auto at = [&](std::size_t r, std::size_t i, std::size_t k) { return all[(r * most + i) * words + k]; };
    const auto describe = [&](std::size_t r, std::size_t i) {
      if (at(r, i, 0) < 0) return std::string("none (it registered fewer)");
      return std::string(name_of(static_cast<dtype>(at(r, i, 1)))) + " x " + std::to_string(at(r, i, 0));
    };
    for (std::size_t i = 0; i < most; ++i) {  // the gradients first: a different one moves the buckets too
      for (std::size_t r = 1; r < n; ++r) {
        if (at(r, i, 0) != at(0, i, 0) || at(r, i, 1) != at(0, i, 1)) {
          return label(i) + " is the first that differs: rank 0 has " + describe(0, i) + ", rank " + std::to_string(r) +
                 " has " + describe(r, i);
        }
      }
    }
    for (std::size_t i = 0; i < most; ++i) {
      for (std::size_t r = 1; r < n; ++r) {
        if (at(r, i, 2) != at(0, i, 2)) {
          return "the gradients agree, but " + label(i) + " is in bucket " + std::to_string(at(0, i, 2)) +
                 " on rank 0 and in bucket " + std::to_string(at(r, i, 2)) + " on rank " + std::to_string(r) +
                 ": the layout policies (or their knobs) differ";
        }
      }
    }
    return "the gradients and their buckets agree, but the layouts differ (the order of gradients within a bucket?)";
  }

  void note_iteration_start() {
    std::lock_guard lk(mutex_);
    if (started_.load()) return;
    iteration_start_ = clock::now();  // read under the mutex only
    // The divisor is fixed when the iteration starts: the communicator's size now (a Manager's
    // quorum may have changed since the last step), or what the join bookkeeping said.
    divisor_ = notified_divisor_ > 0 ? notified_divisor_ : comm_.size();
    started_.store(true, std::memory_order_release);
  }

  void launch_ready_locked() {
    while (next_launch_ < buckets_.size() && pending_[next_launch_].load() == 0) launch_locked(next_launch_++);
  }

  void launch_locked(std::size_t b) {
    order_token_.collective_issued();  // the JoinContext learns the order of the joinables' collectives
    bucket& bk = buckets_[b];
    grad_bucket gb{b, buckets_.size(), bk.data, comm_, divisor_, shadowing_};
    if (direct_) {  // the gradients themselves, scaled by the backend on the way in
      bk.direct.clear();
      if (shadowing_) {
        bk.direct.push_back(bk.data);  // zeros, through the same collective as the training ranks'
      } else {
        bk.direct = bucket_gradients(b);
      }
      bk.inflight = allreduce_average(comm_, bk.direct, divisor_, average_input::raw, "Bucketer");
      current_.buckets[b].in_place = !shadowing_;
    } else if (bk.user_memory && !shadowing_) {
      // Contiguous gradients, divided in place by mark_ready: sum them where they are if they are
      // still one block, else copy them in (a gradient moved since build()). Either way the same
      // collective as the copy path's, over the same values.
      bk.direct = bucket_gradients(b);
      if (bk.direct.size() == 1 && bk.direct.front().count == bk.data.count) {
        bk.launched_in_place = true;
        current_.buckets[b].in_place = true;
      } else {
        for (const std::size_t i : layout_.buckets[b]) {
          const entry& e = entries_[i];
          if (e.gradient.count) std::memcpy(slot(e).data, e.gradient.data, e.gradient.bytes());
        }
        bk.direct.assign(1, bk.data);
      }
      bk.inflight = allreduce_average(comm_, bk.direct, divisor_, average_input::divided, "Bucketer");
    } else if (divides_in_copy()) {
      bk.inflight = allreduce_average(comm_, bk.data, divisor_, average_input::divided, "Bucketer");
    } else {
      bk.inflight = hook_(gb);
    }
    // Device buckets: the average goes back to the gradients right behind the collective, in
    // stream order; nothing waits for it here.
    if (dq_.runtime != nullptr && !opts_.zero_copy && !shadowing_) copy_regions(copy_back_regions(b));
    bk.launched = true;
    if (progress_thread_.joinable()) {
      {
        std::lock_guard wake(progress_mutex_);  // set under the mutex: no lost wake-up
        progress_wanted_.store(true, std::memory_order_release);
      }
      progress_cv_.notify_one();
    }
    ++current_.collectives;
    current_.buckets[b].launched_ms = ms_between(iteration_start_, clock::now());
  }

  // Tests every launched, incomplete bucket. Backends whose collectives are ddp state machines
  // (the MPI ring) advance an operation only when its own handle is tested, so testing the
  // oldest one alone would leave the others idle.
  void progress_locked() {
    for (std::size_t b = next_complete_; b < next_launch_; ++b) {
      bucket& bk = buckets_[b];
      if (bk.completed) continue;
      bool done = false;
      try {
        done = bk.inflight.test();
      } catch (...) {  // the error stays in the work; finalize() rethrows it
        continue;
      }
      if (done) note_completed(b);
    }
    while (next_complete_ < next_launch_ && buckets_[next_complete_].completed) ++next_complete_;
  }

  // The optional progress thread: sleeps until a bucket is launched, then tests the in-flight
  // buckets every progress_interval until none is left (finalize() holds the mutex while it
  // drives the buckets itself, so the two never test at the same time).
  void progress_loop() {
    std::unique_lock wait_lock(progress_mutex_);
    while (!stop_progress_.load()) {
      progress_cv_.wait(wait_lock, [&] { return stop_progress_.load() || progress_wanted_.load(); });
      if (stop_progress_.load()) break;
      wait_lock.unlock();
      while (!stop_progress_.load()) {
        std::this_thread::sleep_for(opts_.progress_interval);
        std::unique_lock lk(mutex_, std::try_to_lock);
        if (!lk) continue;
        progress_locked();
        if (next_complete_ >= next_launch_ && (next_launch_ == buckets_.size() || !started_.load())) {
          progress_wanted_.store(false);
          break;
        }
      }
      wait_lock.lock();
    }
  }

  void stop_progress_thread() noexcept {
    if (!progress_thread_.joinable()) return;
    {
      std::lock_guard lk(progress_mutex_);
      stop_progress_.store(true);
    }
    progress_cv_.notify_one();
    progress_thread_.join();
  }

  void note_completed(std::size_t b) {
    if (buckets_[b].completed) return;
    buckets_[b].completed = true;
    const auto now = clock::now();
    current_.buckets[b].completed_ms = ms_between(iteration_start_, now);
    if (rec_) record_bucket(b, now);
  }

  // ---- observation hooks (straggler.hpp, timeline.hpp) ---------------------------------------

  // End of a synchronised or shadowed iteration: local timings, the straggler exchange when due,
  // the timeline's finalize and step spans.
  void observe_step_locked(clock::time_point finalize_called) {
    double last_launch = 0, last_complete = 0;
    for (const auto& b : current_.buckets) {
      last_launch = std::max(last_launch, b.launched_ms);
      last_complete = std::max(last_complete, b.completed_ms);
    }
    current_.last_ready_ms = current_.shadowed ? 0.0 : last_launch;
    current_.arrival_wait_ms = std::max(0.0, last_complete - last_launch);
    const auto end = clock::now();
    if (opts_.straggler_every > 0 && current_.iteration % opts_.straggler_every == 0) exchange_timings_locked();
    if (rec_) {
      const char* what = current_.shadowed ? "shadow iteration" : "finalize";
      rec_->span("finalize", what, finalize_called, end, {{"wait_ms", current_.finalize_wait_ms}});
      const auto& s = current_.straggler;
      rec_->span("step", "step", iteration_start_, clock::now(),
                 {{"iteration", static_cast<double>(current_.iteration)},
                  {"slowest_rank", s.valid ? static_cast<double>(s.slowest_rank) : -1.0},
                  {"arrival_wait_ms", current_.arrival_wait_ms}});
    }
  }

  // One allgather of timing_words int64 per rank; every rank computes the same report.
  void exchange_timings_locked() {
    const timeline::scoped_span span(rec_, "finalize", "straggler exchange");
    rank_timing mine;
    mine.ready_span_ms = current_.last_ready_ms;
    mine.finalize_wait_ms = current_.finalize_wait_ms;
    mine.arrival_wait_ms = current_.arrival_wait_ms;
    mine.shadowed = current_.shadowed;
    std::vector<std::int64_t> words = timing_to_words(current_.iteration, mine);
    std::vector<std::int64_t> all(timing_words * static_cast<std::size_t>(comm_.size()), timing_unset);
    comm_.allgather(view(words), view(all)).wait();
    ++current_.collectives;
    current_.straggler = attribute_straggler(all);
  }

  void record_bucket(std::size_t b, clock::time_point completed) {
    const bucket_stats& s = current_.buckets[b];
    const auto launched = iteration_start_ + std::chrono::duration_cast<clock::duration>(
                                                 std::chrono::duration<double, std::milli>(s.launched_ms));
    rec_->span({"bucket", static_cast<int>(b)}, shadowing_ ? "allreduce (shadow)" : "allreduce", launched, completed,
               {{"bytes", static_cast<double>(s.bytes)}, {"gradients", static_cast<double>(s.gradients)}});
  }

  // Waits for every bucket and `extra` (the used-gradient map) with one deadline (work::wait_all:
  // round-robin, the buckets' timeout counted from here, an error naming the first bucket still
  // pending and how long this waited), copying each bucket back as soon as it is done
  // (`copy_each`), so copies overlap the buckets still in flight.
  void wait_all_locked(clock::time_point since, bool copy_each, work& extra) {
    std::vector<work*> parts;
    parts.reserve(buckets_.size() + 1);
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      if (!buckets_[b].launched) {
        throw usage_error(comm_.rank(), "Bucketer::finalize",
                          "bucket " + std::to_string(b) + " could not launch: " + std::to_string(pending_[b].load()) +
                              " of its gradients were never marked ready");
      }
      parts.push_back(&buckets_[b].inflight);
    }
    parts.push_back(&extra);
    work::wait_all(parts, [&](std::size_t b) {
      if (b >= buckets_.size()) return;  // the used-gradient map
      note_completed(b);
      if (copy_each) copy_back_bucket(b);
    });
    next_complete_ = buckets_.size();
    current_.finalize_wait_ms = ms_between(since, clock::now());
  }

  void copy_back_bucket(std::size_t b) {
    if (buckets_[b].launched_in_place) return;  // the average is where the gradients are
    for (const std::size_t i : layout_.buckets[b]) {
      const entry& e = entries_[i];
      if (e.gradient.count) std::memcpy(e.gradient.data, slot(e).data, e.gradient.bytes());
    }
  }

  // ---- device gradients ----------------------------------------------------------------------

  // At build(): the options device buckets support, and the events mark_ready records.
  void prepare_device() {
    const char* const op = "Bucketer::build";
    if (opts_.find_unused_parameters) {
      throw usage_error(comm_.rank(), op,
                        "find_unused_parameters is not supported for device gradients in this version (it zeroes "
                        "and copies unused gradients on the host): mark every gradient ready, with zeros if unused");
    }
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      if (const std::string why = device_problem(entries_[i].gradient); !why.empty()) {
        throw usage_error(comm_.rank(), op, label(i) + " " + why);
      }
    }
    ready_events_.clear();
    for (std::size_t i = 0; i < entries_.size(); ++i) ready_events_.emplace_back(*dq_.runtime, dq_.where);
    done_event_ = detail::device_event_owner(*dq_.runtime, dq_.where);
  }

  // Work enqueued on the compute stream from now on runs after the work on the comm stream so far.
  void order_compute_after_comm() {
    if (!has_compute_) return;
    dq_.runtime->record(done_event_.get(), dq_.stream);
    dq_.runtime->wait(compute_, done_event_.get());
  }

  // mark_ready of device gradient i: the comm stream waits for the gradient's producer (the event
  // passed, or one recorded now on the compute stream), then copies it into its slot.
  void enqueue_copy_in(std::size_t i, const entry& e, device_event produced) {
    device_runtime& rt = *dq_.runtime;
    if (!produced) {
      if (!has_compute_) {
        throw usage_error(comm_.rank(), "Bucketer::mark_ready",
                          label(i) + " is on " + e.gradient.where.str() +
                              ": say which stream produced it, with set_compute_stream() or mark_ready(i, event)");
      }
      produced = ready_events_[i].get();
      rt.record(produced, compute_);
    }
    rt.wait(dq_.stream, produced);
    if (opts_.zero_copy || e.gradient.count == 0) return;  // zero-copy: the gradient is in the bucket already
    const tensor_view to = slot(e);
    const copy_region region{to.data, e.gradient.data, e.gradient.bytes()};
    rt.copy(std::span<const copy_region>(&region, 1), dq_.stream);
  }

  // Bucket b's slots back into its gradients.
  [[nodiscard]] std::vector<copy_region> copy_back_regions(std::size_t b) const {
    std::vector<copy_region> out;
    for (const std::size_t i : buckets_[b].members) {
      const entry& e = entries_[i];
      if (e.gradient.count) out.push_back({e.gradient.data, slot(e).data, e.gradient.bytes()});
    }
    return out;
  }

  // Copies between buckets and gradients: one batch on the comm stream for device buckets,
  // memcpy for host ones.
  void copy_regions(const std::vector<copy_region>& regions) {
    if (regions.empty()) return;
    if (dq_.runtime != nullptr) {
      dq_.runtime->copy(regions, dq_.stream);
      return;
    }
    for (const copy_region& r : regions) std::memcpy(r.dst, r.src, r.bytes);
  }

  // finalize() of device buckets: the compute stream waits for every collective and copy back;
  // the host waits only when `blocking`. Buckets whose work already completed (or failed) are
  // noted either way, so a failure seen now is thrown now.
  void finish_on_device_locked(clock::time_point since, bool blocking) {
    device_runtime& rt = *dq_.runtime;
    rt.record(done_event_.get(), dq_.stream);
    if (has_compute_) rt.wait(compute_, done_event_.get());
    if (blocking) {
      work none = work::ready();
      wait_all_locked(since, false, none);
      rt.synchronize(done_event_.get());  // the copies back, behind the collectives
    } else {
      for (std::size_t b = 0; b < buckets_.size(); ++b) {
        if (!buckets_[b].launched) {
          throw usage_error(comm_.rank(), "Bucketer::finalize",
                            "bucket " + std::to_string(b) + " could not launch: " + std::to_string(pending_[b].load()) +
                                " of its gradients were never marked ready");
        }
        if (buckets_[b].inflight.test()) note_completed(b);  // throws a failure already known
      }
    }
    current_.finalize_wait_ms = ms_between(since, clock::now());
  }

  // Bucket b's non-empty gradients in slot order, adjacent ones merged into one tensor.
  [[nodiscard]] std::vector<tensor_view> bucket_gradients(std::size_t b) const {
    std::vector<tensor_view> out;
    for (const std::size_t i : buckets_[b].members) {
      const tensor_view& g = entries_[i].gradient;
      if (g.count == 0) continue;
      if (!out.empty() && out.back().type == g.type && out.back().where == g.where &&
          out.back().byte_data() + out.back().bytes() == g.byte_data()) {
        out.back().count += g.count;
      } else {
        out.push_back(g);
      }
    }
    return out;
  }

  // True if the copy into the bucket divides by the divisor (default hook, copy path): the
  // bucket is then `allreduce_average`d as `average_input::divided`, without the hook.
  // Device buckets are averaged by the backend instead (allreduce_average's device rule).
  [[nodiscard]] bool divides_in_copy() const noexcept {
    return default_hook_ && !opts_.zero_copy && dq_.runtime == nullptr;
  }

  work launch_used_map(const std::vector<std::size_t>& unmarked) {
    if (!opts_.find_unused_parameters) return work::ready();
    used_.assign(entries_.size(), 1);
    for (std::size_t i : unmarked) used_[i] = 0;
    if (shadowing_) std::fill(used_.begin(), used_.end(), std::uint8_t{0});
    order_token_.collective_issued();  // first only with no buckets at all
    ++current_.collectives;
    return comm_.allreduce(used_, reduce_op::max);
  }

  // After the used-gradient map arrived: copies back all but the globally unused gradients.
  // After the used-gradient map arrived: copies back all but the globally unused gradients. A
  // gradient unused on this rank was not re-read by mark_ready: re-read it here, so that the
  // average lands where the gradient is now. Returns the gradients used elsewhere that lost
  // their memory here (set to None and not computed): they cannot receive the average.
  [[nodiscard]] std::vector<std::size_t> copy_back() {
    std::vector<std::size_t> lost;
    if (opts_.zero_copy) return lost;
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      entry& e = entries_[i];
      if (opts_.find_unused_parameters && used_[i] == 0) continue;  // unused everywhere: leave it alone
      if (!marked_[i].load() && e.grad_source.rereads()) {
        const tensor_view now = read_gradient(i, e, "Bucketer::finalize");
        if (!same_shape(now, e.gradient)) {
          lost.push_back(i);
          continue;
        }
        e.gradient.data = now.data;
      }
      if (e.gradient.count) std::memcpy(e.gradient.data, slot(e).data, e.gradient.bytes());
    }
    return lost;
  }

  [[noreturn]] void throw_lost(const std::vector<std::size_t>& lost) const {
    throw usage_error(comm_.rank(), "Bucketer::finalize",
                      "gradients " + labels(lost) +
                          " were not computed on this rank and no longer have their registered element count, dtype "
                          "and memory (set to None?), but other ranks used them, so this rank cannot receive their "
                          "average; zero such gradients instead of setting them to None");
  }

  // Every rank broadcasts rank 0's observed ready order (completed with the registration order
  // reversed for gradients rank 0 never saw), then builds the policy's layout from it.
  void rebuild_locked() {
    if constexpr (rebuilding_policy<Policy>) {
      const std::size_t n = entries_.size();
      std::vector<std::int64_t> order(n, -1);
      if (comm_.rank() == 0) {
        std::vector<bool> seen(n, false);
        std::size_t k = 0;
        const std::size_t recorded = std::min(ready_seen_.load(), n);
        for (std::size_t p = 0; p < recorded; ++p) {
          order[k++] = static_cast<std::int64_t>(ready_order_[p]);
          seen[ready_order_[p]] = true;
        }
        for (std::size_t i = n; i-- > 0;) {
          if (!seen[i]) order[k++] = static_cast<std::int64_t>(i);
        }
      }
      comm_.broadcast(order, 0).wait();
      ++current_.collectives;
      std::vector<std::size_t> agreed(n);
      std::vector<bool> seen(n, false);
      for (std::size_t p = 0; p < n; ++p) {
        const auto v = order[p];
        if (v < 0 || static_cast<std::size_t>(v) >= n || seen[static_cast<std::size_t>(v)]) {
          throw mismatch_error(comm_.rank(), "Bucketer rebuild",
                               "the ready order broadcast by rank 0 is not a permutation of this rank's " +
                                   std::to_string(n) + " gradients");
        }
        seen[static_cast<std::size_t>(v)] = true;
        agreed[p] = static_cast<std::size_t>(v);
      }
      const auto grads = infos();
      bucket_layout l = policy_.rebuild(grads, agreed);
      if (auto problem = detail::validate_layout(l, grads)) {
        throw usage_error(comm_.rank(), "Bucketer rebuild",
                          "the layout policy returned an invalid layout: " + *problem);
      }
      rebuild_pending_ = false;
      recording_ = false;
      current_.rebuilt = true;
      if (!(l == layout_)) {
        const step_stats finished = current_;  // the iteration that just ran keeps its statistics
        install_layout(std::move(l), opts_.zero_copy);
        current_ = finished;
      }
    }
  }

  // A joined rank's half of one synchronised iteration.
  void shadow_iteration(const join_round& round) {
    if (!built_.load()) build();
    std::unique_lock lk(mutex_);
    reset_on_exit guard{this};
    divisor_ = round.divisor();
    shadowing_ = true;
    forget_accumulated();  // a rank that joined contributes zeros (docs/join.md)
    iteration_start_ = clock::now();
    current_.shadowed = true;
    for (auto& b : buckets_) {
      if (b.data.count == 0) continue;
      if (dq_.runtime != nullptr) {
        dq_.runtime->zero(b.data.data, b.data.bytes(), dq_.stream);
      } else {
        std::memset(b.data.data, 0, b.data.bytes());
      }
    }
    for (std::size_t b = 0; b < buckets_.size(); ++b) pending_[b].store(0);
    launch_ready_locked();
    work used_map = launch_used_map({});
    wait_all_locked(iteration_start_, false, used_map);
    if (rebuild_pending_) rebuild_locked();
    current_.iteration = ++iterations_;
    observe_step_locked(iteration_start_);
    stats_ = current_;
  }

  [[noreturn]] void throw_unmarked(const std::vector<std::size_t>& unmarked) const {
    throw usage_error(comm_.rank(), "Bucketer::finalize",
                      std::to_string(unmarked.size()) + " of " + std::to_string(entries_.size()) +
                          " gradients were never marked ready (indices " + labels(unmarked) +
                          "); if some parameters go unused in some iterations, set find_unused_parameters");
  }

  void forget_accumulated() noexcept {
    for (std::size_t i = 0; i < entries_.size(); ++i) accumulated_[i].store(false, std::memory_order_relaxed);
  }

  void reset_iteration() {
    std::lock_guard lk(mutex_);
    reset_iteration_locked();
  }

  void reset_iteration_locked() noexcept {
    for (std::size_t i = 0; i < entries_.size() && marked_; ++i) marked_[i].store(false);
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      pending_[b].store(buckets_[b].gradients);
      buckets_[b].inflight = work();
      buckets_[b].launched = false;
      buckets_[b].completed = false;
      buckets_[b].launched_in_place = false;
    }
    next_launch_ = 0;
    next_complete_ = 0;
    started_ = false;
    shadowing_ = false;
    divisor_ = comm_.size();
    notified_divisor_ = 0;
    ready_seen_ = 0;
    current_ = step_stats{};
    current_.buckets.resize(buckets_.size());
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      current_.buckets[b].bytes = buckets_[b].data.bytes();
      current_.buckets[b].gradients = buckets_[b].gradients;
    }
  }

  static double ms_between(clock::time_point a, clock::time_point b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
  }

  communicator_ref comm_;
  Policy policy_;
  bucketer_options opts_;
  ddp::device_queue dq_;  // the communicator's device stream (runtime null: host gradients)
  comm_hook hook_ = hooks::allreduce_average{};
  bool default_hook_ = true;  // lets the copy path fold the averaging into the copy in
  bool direct_ = false;       // buckets are coalesced calls over the gradients (set by build())
  std::function<void(std::size_t, tensor_view)> on_rebind_;

  std::vector<entry> entries_;
  bucket_layout layout_;
  std::vector<bucket> buckets_;
  std::uint64_t fingerprint_ = 0;
  std::unique_ptr<std::atomic<std::size_t>[]> pending_;  // gradients still to come, per bucket
  std::unique_ptr<std::atomic<bool>[]> marked_;          // per gradient, this iteration
  std::unique_ptr<std::atomic<bool>[]> accumulated_;     // per gradient, marked inside no_sync since the last sync
  std::vector<std::uint8_t> used_;                       // used-gradient map (find_unused_parameters)

  std::mutex mutex_;  // guards launching, progress and the in-flight work handles
  std::atomic<bool> built_{false};
  std::atomic<bool> started_{false};
  int no_sync_depth_ = 0;  // open no_sync scopes
  bool shadowing_ = false;
  int divisor_;                   // of the running iteration
  int notified_divisor_ = 0;      // from join_notified() for the next iteration (0: none)
  join_order_token order_token_;  // from join_notified(): records when this Bucketer first launches
  std::size_t next_launch_ = 0;
  std::size_t next_complete_ = 0;
  clock::time_point iteration_start_{};
  std::uint64_t iterations_ = 0;

  bool rebuild_pending_ = false;
  bool recording_ = false;
  std::vector<std::size_t> ready_order_;
  std::atomic<std::size_t> ready_seen_{0};

  std::mutex progress_mutex_;  // guards stop_progress_ and the progress thread's sleep
  std::condition_variable progress_cv_;
  std::atomic<bool> progress_wanted_{false};
  std::atomic<bool> stop_progress_{false};
  std::thread progress_thread_;  // optional (progress_interval); joined in the destructor

  device_stream compute_{};  // device gradients: the backward pass's stream (set_compute_stream)
  bool has_compute_ = false;
  std::vector<detail::device_event_owner> ready_events_;  // per gradient, recorded by mark_ready(i)
  detail::device_event_owner done_event_;                 // the comm stream at finalize()

  timeline::recorder* rec_ = nullptr;    // optional (set_recorder)
  std::vector<attached_hook> attached_;  // destroyed before the state its hooks use
  step_stats current_;
  step_stats stats_;
};

}  // namespace ddp

#undef DDP_BUCKETER_GRADIENT_LVALUE_MESSAGE
