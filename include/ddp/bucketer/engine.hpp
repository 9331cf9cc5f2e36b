#pragma once
/// @file bucketer/engine.hpp
/// @brief The machinery behind a `Bucketer` (ddp/bucketer.hpp): `detail::bucketer_engine`, which
/// owns the buckets, chooses each bucket's `bucket_path` when a layout is installed, stages
/// gradients, launches buckets in layout order, drives them to completion and copies the average
/// back. Not for users.
///
/// The layout policy stays with the public class: the engine asks it for a rebuilt layout through
/// `rebuilt_layout`, so that nothing here is a template.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ddp/average.hpp>
#include <ddp/bucket_layout.hpp>
#include <ddp/bucketer/buckets.hpp>
#include <ddp/bucketer/layout_check.hpp>
#include <ddp/bucketer/observe.hpp>
#include <ddp/bucketer/options.hpp>
#include <ddp/bucketer/progress.hpp>
#include <ddp/comm_hook.hpp>
#include <ddp/communicator.hpp>
#include <ddp/detail/aligned_buffer.hpp>
#include <ddp/detail/device_buffer.hpp>
#include <ddp/device_runtime.hpp>
#include <ddp/error.hpp>
#include <ddp/hooks/allreduce_average.hpp>
#include <ddp/joinable.hpp>
#include <ddp/tensor.hpp>
#include <ddp/timeline.hpp>
#include <ddp/work.hpp>

namespace ddp::detail {

/// Buckets and the state of one iteration; the base of `Bucketer<Policy>`.
class bucketer_engine : protected bucketer_buckets {
 protected:
  bucketer_engine(communicator_ref comm, bucketer_options options, bool rebuilds)
      : bucketer_buckets(comm), opts_(options), rebuilds_(rebuilds), divisor_(comm.size()) {}
  virtual ~bucketer_engine() { progress_.stop(); }  // virtual: unique_ptr<Bucketer<>> deletes one

  // The policy's layout rebuilt from the ranks' agreed ready order (rebuilding policies only).
  [[nodiscard]] virtual bucket_layout rebuilt_layout(const std::vector<gradient_info>& grads,
                                                     const std::vector<std::size_t>& order) = 0;

  // Resets per-iteration state when finalize() leaves, normally or by exception, so that a
  // Bucketer whose step failed can be destroyed or used again.
  struct reset_on_exit {
    bucketer_engine* b;
    ~reset_on_exit() { b->reset_iteration_locked(); }
  };

  // ---- layout ------------------------------------------------------------------------------

  // build() with the policy's layout `l` (under the mutex).
  void install_built(bucket_layout l) {
    if (comm_.adopts_layout() && rebuilds_) {  // before anything is installed
      throw usage_error(comm_.rank(), "Bucketer::build",
                        "its communicator (a Manager or GroupManager) compares the gradient layout at every "
                        "quorum, and this Bucketer's layout policy rebuilds the layout once it has seen the "
                        "gradients' ready order: use a layout policy that never rebuilds (bucketing::fixed, "
                        "bucketing::size_capped)");
    }
    const auto grads = infos();
    if (auto problem = validate_layout(l, grads)) {
      throw usage_error(comm_.rank(), "Bucketer::build", "the layout policy returned an invalid layout: " + *problem);
    }
    if (dev_.on_device()) prepare_device();
    marked_ = std::make_unique<std::atomic<bool>[]>(entries_.size());
    accumulated_ = std::make_unique<std::atomic<bool>[]>(entries_.size());
    if (rebuilds_) {
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
    // A Manager before its first quorum takes the fingerprint and compares it at every quorum; once
    // a quorum exists, the check runs over its members here, as over any communicator.
    if (!comm_.adopt_layout(fingerprint_) && opts_.check_layout) {
      std::vector<layout_row> rows;
      rows.reserve(entries_.size());
      for (const auto& e : entries_) rows.push_back({e.gradient.count, e.gradient.type, e.bucket});
      check_layout_across_ranks(comm_, rows, fingerprint_, [this](std::size_t i) { return label(i); });
    }
    built_.store(true, std::memory_order_release);
    if (opts_.progress_interval.count() > 0) {
      progress_.start(opts_.progress_interval, [this] {
        std::unique_lock lk(mutex_, std::try_to_lock);
        if (!lk) return true;
        progress_locked();
        return !(next_complete_ >= next_launch_ && (next_launch_ == buckets_.size() || !started_.load()));
      });
    }
  }

  // At build(): the options device buckets support, and the events mark_ready records.
  void prepare_device() {
    const char* const op = "Bucketer::build";
    if (opts_.find_unused_parameters) {
      throw usage_error(comm_.rank(), op,
                        "find_unused_parameters is not supported for device gradients in this version (it zeroes "
                        "and copies unused gradients on the host): mark every gradient ready, with zeros if unused");
    }
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      if (const std::string why = dev_.problem(entries_[i].gradient); !why.empty()) {
        throw usage_error(comm_.rank(), op, label(i) + " " + why);
      }
    }
    dev_.prepare(entries_.size());
  }

  // Bucket b's path, from the communicator, the options, the hook and where its gradients lie
  // (buckets_ and entries_ already installed). Device first, then the Bucketer-wide choices.
  [[nodiscard]] bucket_path choose_path(std::size_t b) const {
    if (dev_.on_device()) return opts_.zero_copy ? bucket_path::device_zero_copy : bucket_path::device;
    if (opts_.zero_copy) return bucket_path::zero_copy;
    if (direct_) return bucket_path::direct;
    if (!default_hook_) return bucket_path::copy_with_hook;
    // Contiguous gradients: the bucket's collective is a sum of divided values whichever memory
    // it runs on. Not with find_unused_parameters, whose unused gradients are zeroed in the bucket.
    if (!opts_.find_unused_parameters && bucket_gradients(b).size() == 1) return bucket_path::in_place;
    return bucket_path::copy_divided;
  }

  // Allocates bucket storage for `l`, points every entry at its slot and chooses the paths.
  void install_layout(bucket_layout l, bool keep_values) {
    allocate_buckets(l, keep_values);
    for (std::size_t b = 0; b < buckets_.size(); ++b) buckets_[b].path = choose_path(b);
    layout_ = std::move(l);
    fingerprint_ = layout_fingerprint(layout_, infos());
    pending_ = std::make_unique<std::atomic<std::size_t>[]>(buckets_.size());
    reset_iteration_locked();
    if (opts_.zero_copy && on_rebind_) {
      for (std::size_t i = 0; i < entries_.size(); ++i) on_rebind_(i, slot(entries_[i]));
    }
    // Device buckets were allocated (and zero-copy gradients carried over) on the comm stream:
    // the trainer's kernels on the compute stream may write into them only after that.
    if (dev_.on_device()) dev_.order_compute_after_comm();
  }

  // Every rank agrees on rank 0's ready order, then installs the policy's layout for it.
  void rebuild_locked() {
    const std::size_t n = entries_.size();
    const std::vector<std::size_t> agreed = agree_ready_order(comm_, ready_order_, ready_seen_.load(), n);
    ++current_.collectives;
    const auto grads = infos();
    bucket_layout l = rebuilt_layout(grads, agreed);
    if (auto problem = validate_layout(l, grads)) {
      throw usage_error(comm_.rank(), "Bucketer rebuild", "the layout policy returned an invalid layout: " + *problem);
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

  // ---- per iteration -----------------------------------------------------------------------

  // mark_ready(i) once built (i in range).
  void mark(std::size_t i, device_event produced) {
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
    if (pending_[entries_[i].bucket].fetch_sub(1) == 1) {
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
    bucketer_entry& e = entries_[i];
    const bucket_path path = buckets_[e.bucket].path;
    // Every path but zero-copy re-reads the gradient's slot (one compare when nothing moved) and
    // follows it to new memory, so a gradient replaced since the last step (set_to_none) is the
    // one averaged. Zero-copy: gradient i is gradient_view(i); the registered tensor gave its shape.
    if (path != bucket_path::zero_copy && path != bucket_path::device_zero_copy && e.grad_source.rereads()) {
      follow_gradient(i, e, "Bucketer::mark_ready");
    }
    switch (path) {
      case bucket_path::copy_divided:  // the averaging's division folded into the copy (ddp/average.hpp)
        if (e.gradient.count > 0)
          average_copy(e.gradient.type, slot(e).data, e.gradient.data, e.gradient.count, divisor_);
        break;
      case bucket_path::copy_with_hook:
        if (e.gradient.count > 0) std::memcpy(slot(e).data, e.gradient.data, e.gradient.bytes());
        break;
      case bucket_path::in_place:  // the division the copy would fold in, done in place (same bits)
        if (e.gradient.count > 0) average_divide_in_place(e.gradient.type, e.gradient.data, e.gradient.count, divisor_);
        break;
      case bucket_path::zero_copy:
      case bucket_path::direct: break;
      case bucket_path::device:
      case bucket_path::device_zero_copy: enqueue_copy_in(i, e, produced, path == bucket_path::device); break;
    }
  }

  // Device gradient i: the comm stream waits for its producer (the event passed, or one recorded
  // now on the compute stream), then copies it into its slot (`copy`).
  void enqueue_copy_in(std::size_t i, const bucketer_entry& e, device_event produced, bool copy) {
    if (!dev_.wait_for_producer(i, produced)) {
      throw usage_error(comm_.rank(), "Bucketer::mark_ready",
                        label(i) + " is on " + e.gradient.where.str() +
                            ": say which stream produced it, with set_compute_stream() or mark_ready(i, event)");
    }
    if (!copy || e.gradient.count == 0) return;
    const tensor_view to = slot(e);
    const copy_region region{to.data, e.gradient.data, e.gradient.bytes()};
    dev_.copy(std::span<const copy_region>(&region, 1));
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
    switch (bk.path) {
      case bucket_path::direct:  // the gradients themselves, scaled by the backend on the way in
        bk.direct.clear();
        if (shadowing_) {
          bk.direct.push_back(bk.data);  // zeros, through the same collective as the training ranks'
        } else {
          bk.direct = bucket_gradients(b);
        }
        bk.inflight = allreduce_average(comm_, bk.direct, divisor_, average_input::raw, "Bucketer");
        current_.buckets[b].in_place = !shadowing_;
        break;
      case bucket_path::in_place:
        if (!shadowing_) {
          launch_in_place(b);
          break;
        }
        [[fallthrough]];  // a shadowed bucket holds zeros in its storage: the copy path's collective
      case bucket_path::copy_divided:
        bk.inflight = allreduce_average(comm_, bk.data, divisor_, average_input::divided, "Bucketer");
        break;
      case bucket_path::copy_with_hook:
      case bucket_path::zero_copy:
      case bucket_path::device_zero_copy: bk.inflight = hook_(gb); break;
      case bucket_path::device:
        bk.inflight = hook_(gb);
        // The average goes back to the gradients right behind the collective, in stream order;
        // nothing waits for it here.
        if (!shadowing_) copy_regions(copy_back_regions(b));
        break;
    }
    bk.launched = true;
    progress_.wake();
    ++current_.collectives;
    current_.buckets[b].launched_ms = ms_between(iteration_start_, clock::now());
  }

  // Contiguous gradients, divided in place by mark_ready: sum them where they are if they are
  // still one block, else copy them in (a gradient moved since build()). Either way the same
  // collective as the copy path's, over the same values.
  void launch_in_place(std::size_t b) {
    bucket& bk = buckets_[b];
    bk.direct = bucket_gradients(b);
    if (bk.direct.size() == 1 && bk.direct.front().count == bk.data.count) {
      bk.launched_in_place = true;
      current_.buckets[b].in_place = true;
    } else {
      for (const std::size_t i : layout_.buckets[b]) {
        const bucketer_entry& e = entries_[i];
        if (e.gradient.count) std::memcpy(slot(e).data, e.gradient.data, e.gradient.bytes());
      }
      bk.direct.assign(1, bk.data);
    }
    bk.inflight = allreduce_average(comm_, bk.direct, divisor_, average_input::divided, "Bucketer");
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

  void note_completed(std::size_t b) {
    if (buckets_[b].completed) return;
    buckets_[b].completed = true;
    const auto now = clock::now();
    current_.buckets[b].completed_ms = ms_between(iteration_start_, now);
    if (rec_) record_bucket(*rec_, b, current_.buckets[b], iteration_start_, now, shadowing_);
  }

  // ---- end of an iteration -----------------------------------------------------------------

  // finalize() once built.
  void finish(bool blocking) {
    if (no_sync_depth_ > 0) {
      std::lock_guard lk(mutex_);
      reset_iteration_locked();
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
    for (std::size_t i : unmarked) {  // zero contributions for unused gradients (host buckets only)
      const bucketer_entry& e = entries_[i];
      if (e.gradient.count > 0) std::memset(slot(e).data, 0, e.gradient.bytes());
      if (pending_[e.bucket].fetch_sub(1) == 1) launch_ready_locked();
    }
    work used_map = launch_used_map(unmarked);
    if (dev_.on_device()) {
      finish_on_device_locked(called, blocking || !dev_.has_compute());
    } else {  // with find_unused_parameters the copies back wait for the used-gradient map
      wait_all_locked(called, !opts_.find_unused_parameters, used_map);
    }
    std::vector<std::size_t> lost;  // used elsewhere, but without memory here: thrown after the collectives
    if (opts_.find_unused_parameters) lost = copy_back();
    end_iteration_locked(called);
    if (!lost.empty()) throw_lost(lost);
  }

  // A joined rank's half of one synchronised iteration (built).
  void shadow_iteration(const join_round& round) {
    std::unique_lock lk(mutex_);
    reset_on_exit guard{this};
    divisor_ = round.divisor();
    shadowing_ = true;
    forget_accumulated();  // a rank that joined contributes zeros (docs/join.md)
    iteration_start_ = clock::now();
    current_.shadowed = true;
    for (auto& b : buckets_) {
      if (b.data.count == 0) continue;
      if (dev_.on_device()) {
        dev_.zero(b.data.data, b.data.bytes());
      } else {
        std::memset(b.data.data, 0, b.data.bytes());
      }
    }
    for (std::size_t b = 0; b < buckets_.size(); ++b) pending_[b].store(0);
    launch_ready_locked();
    work used_map = launch_used_map({});
    wait_all_locked(iteration_start_, false, used_map);
    end_iteration_locked(iteration_start_);
  }

  // The rebuild when due, the iteration's number, its observation and statistics.
  void end_iteration_locked(clock::time_point finalize_called) {
    if (rebuild_pending_) rebuild_locked();
    current_.iteration = ++iterations_;
    observe_step(current_, opts_.straggler_every, comm_, rec_, iteration_start_, finalize_called);
    stats_ = current_;
  }

  // Waits for every bucket and `extra` (the used-gradient map) with one deadline (work::wait_all:
  // round-robin, the buckets' timeout counted from here, an error naming the first bucket still
  // pending and how long this waited), copying each bucket back as soon as it is done
  // (`copy_each`), so copies overlap the buckets still in flight.
  void wait_all_locked(clock::time_point since, bool copy_each, work& extra) {
    std::vector<work*> parts;
    parts.reserve(buckets_.size() + 1);
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      throw_if_not_launched(b);
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

  void throw_if_not_launched(std::size_t b) const {
    if (buckets_[b].launched) return;
    throw usage_error(comm_.rank(), "Bucketer::finalize",
                      "bucket " + std::to_string(b) + " could not launch: " + std::to_string(pending_[b].load()) +
                          " of its gradients were never marked ready");
  }

  // Host bucket b's average into its gradients, where its path needs a copy back.
  void copy_back_bucket(std::size_t b) {
    switch (buckets_[b].path) {
      case bucket_path::in_place:
        if (buckets_[b].launched_in_place) return;  // the average is where the gradients are
        [[fallthrough]];
      case bucket_path::copy_divided:
      case bucket_path::copy_with_hook:
        for (const std::size_t i : layout_.buckets[b]) {
          const bucketer_entry& e = entries_[i];
          if (e.gradient.count) std::memcpy(e.gradient.data, slot(e).data, e.gradient.bytes());
        }
        return;
      case bucket_path::zero_copy:  // the gradients are the bucket
      case bucket_path::direct:     // the backend wrote the average into the gradients
      case bucket_path::device:     // copied back on the stream at launch
      case bucket_path::device_zero_copy: return;
    }
  }

  // finalize() of device buckets: the compute stream waits for every collective and copy back;
  // the host waits only when `blocking`. Buckets whose work already completed (or failed) are
  // noted either way, so a failure seen now is thrown now.
  void finish_on_device_locked(clock::time_point since, bool blocking) {
    dev_.order_finalize();
    if (blocking) {
      work none = work::ready();
      wait_all_locked(since, false, none);
      dev_.synchronize();  // the copies back, behind the collectives
    } else {
      for (std::size_t b = 0; b < buckets_.size(); ++b) {
        throw_if_not_launched(b);
        if (buckets_[b].inflight.test()) note_completed(b);  // throws a failure already known
      }
    }
    current_.finalize_wait_ms = ms_between(since, clock::now());
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

  // After the used-gradient map arrived: copies back all but the globally unused gradients. A
  // gradient unused on this rank was not re-read by mark_ready: re-read it here, so that the
  // average lands where the gradient is now. Returns the gradients used elsewhere that lost
  // their memory here (set to None and not computed): they cannot receive the average.
  [[nodiscard]] std::vector<std::size_t> copy_back() {
    std::vector<std::size_t> lost;
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      bucketer_entry& e = entries_[i];
      if (buckets_[e.bucket].path == bucket_path::zero_copy) continue;  // the gradients are the buckets
      if (used_[i] == 0) continue;                                      // unused everywhere: leave it alone
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

  void forget_accumulated() noexcept {
    for (std::size_t i = 0; i < entries_.size(); ++i) accumulated_[i].store(false, std::memory_order_relaxed);
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
      current_.buckets[b].path = buckets_[b].path;
    }
  }

  // ---- state -------------------------------------------------------------------------------

  bucketer_options opts_;
  comm_hook hook_ = hooks::allreduce_average{};
  bool default_hook_ = true;  // lets the host copy path fold the averaging into the copy in
  bool direct_ = false;       // buckets are coalesced calls over the gradients (set by build())
  const bool rebuilds_;       // the policy rebuilds the layout once, from the observed ready order
  std::function<void(std::size_t, tensor_view)> on_rebind_;

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

  progress_thread progress_;           // optional (progress_interval); stopped in the destructor
  timeline::recorder* rec_ = nullptr;  // optional (set_recorder)
  step_stats current_;
  step_stats stats_;
};

}  // namespace ddp::detail
