#pragma once
/// @file staged/communicator.hpp
/// @brief `ddp::staged::communicator`: a device communicator over a host transport (gloo, MPI,
/// the local backend). Device tensors are copied to page-locked host memory on the stream, the
/// host communicator's collective runs on a thread of this communicator, and the results are
/// copied back on the stream behind a gate that thread opens: stream-ordered like NCCL, with no
/// host synchronisation on the caller's thread. For replicas that cannot share an NCCL clique
/// (two replicas on one GPU; hosts without a common NCCL network) and for fault-tolerant jobs
/// whose transport must survive a dead peer (docs/fault-tolerance.md, "On GPUs").

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/backend_contract.hpp>
#include <ddp/communicator.hpp>
#include <ddp/detail/host_reduce.hpp>
#include <ddp/device.hpp>
#include <ddp/device_runtime.hpp>
#include <ddp/error.hpp>
#include <ddp/staged/pinned_pool.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp::staged {

/// Settings of a staged communicator.
struct options {
  /// Deadline of a collective: of its wait for the device-to-host copies and of its host
  /// collective on the communicator's thread, and of a caller's `wait()`. On it the communicator
  /// is aborted and the collective fails with `timeout_error`.
  std::chrono::milliseconds timeout = default_timeout;
  /// A stream of the runtime (owned by the caller) to run on instead of a stream of its own: a
  /// Manager's quorums in turn on the replica's stream (`manager_options::device_queue`).
  std::optional<device_stream> stream{};
};

namespace detail {

/// One collective on its way through the communicator's thread. Its events and gate live as long
/// as it does (a work handle may poll from another thread until then); its buffer goes back to the
/// pool as soon as the stream passed the copies back.
struct job {
  explicit job(device_runtime& r) noexcept : rt(&r) {}
  job(const job&) = delete;
  job& operator=(const job&) = delete;
  ~job() {
    if (staged) rt->destroy_event(staged);
    if (done) rt->destroy_event(done);
    if (gate) rt->destroy_gate(gate);
  }
  device_runtime* rt;
  op_info info;
  std::function<work(communicator_ref)> issue;  // the host collective over host memory
  device_event staged{};                        // after the copies to the host; none for a host call
  device_gate gate{};                           // the stream waits for it before the copies back
  device_event done{};                          // after the copies back
  pinned_pool::buffer buffer;                   // the host copy of the tensors
  std::exception_ptr error;                     // set before `finished`
  std::atomic<bool> finished{false};
};

/// What the communicator, its thread and its works share.
struct state {
  state(communicator_ref h, device_runtime& r, device w, options o)
      : host(h), rt(&r), where(w), rank(h.rank()), size(h.size()), opts(o), pool(r) {}
  communicator_ref host;
  device_runtime* rt;
  device where;
  device_stream stream{};
  bool owns_stream = true;
  int rank;
  int size;
  options opts;
  pinned_pool pool;  // used by the calling thread only
  std::atomic<bool> aborted{false};
  std::exception_ptr first_error;  // of the first failed collective: later ones fail with it

  std::mutex m;
  std::condition_variable cv;
  std::deque<std::shared_ptr<job>> queue;
  bool stopping = false;

  void finish(job& j) {
    j.finished.store(true, std::memory_order_release);
    if (j.gate) rt->open_gate(j.gate);
    std::lock_guard lk(m);
    cv.notify_all();
  }

  // Waits, on the communicator's thread, until the event completed (polling: no host sync is
  // counted against the caller's thread).
  void await(device_event e, const op_info& info) {
    const auto deadline = clock::now() + opts.timeout;
    for (unsigned idle = 0; !rt->query(e); ++idle) {
      if (aborted.load()) throw communication_error(rank, info.describe(), "the communicator was aborted");
      if (clock::now() >= deadline) {
        throw timeout_error(
            rank, info.describe(),
            "the copies to host memory did not complete within " + std::to_string(opts.timeout.count()) + " ms");
      }
      if (idle < 64) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
  }

  // The communicator's thread: one job at a time, in call order.
  void run() {
    for (;;) {
      std::shared_ptr<job> j;
      {
        std::unique_lock lk(m);
        cv.wait(lk, [this] { return stopping || !queue.empty(); });
        if (queue.empty()) return;
        j = std::move(queue.front());
        queue.pop_front();
      }
      try {
        if (first_error) std::rethrow_exception(first_error);
        if (aborted.load()) {
          throw communication_error(rank, j->info.describe(),
                                    "the communicator was aborted before this collective ran");
        }
        if (j->staged) await(j->staged, j->info);
        work w = j->issue(host);
        try {
          w.wait_for(opts.timeout);
        } catch (const timeout_error&) {
          aborted.store(true);
          host.abort();
          throw;
        }
      } catch (...) {
        j->error = std::current_exception();
        if (!first_error) first_error = j->error;
      }
      finish(*j);
    }
  }
};

/// The work of a collective over device tensors: complete once the copies back completed on the
/// stream (work enqueued after the call sees the result without a host wait); rethrows the host
/// collective's error.
class staged_work final : public work_state {
 public:
  staged_work(std::shared_ptr<state> s, std::shared_ptr<job> j)
      : work_state(j->info), s_(std::move(s)), j_(std::move(j)) {}

  // Complete, or failed, only once the stream passed the copies back: the caller may then reuse
  // the tensors (after a failure their contents are undefined, as with NCCL).
  bool poll() override {
    if (!j_->finished.load(std::memory_order_acquire)) return false;
    if (j_->done && !s_->rt->query(j_->done)) return false;
    if (j_->error) std::rethrow_exception(j_->error);
    return true;
  }
  /// On the deadline the communicator is aborted (its thread gives up on the collective).
  bool wait_until(clock::time_point deadline) override {
    if (work_state::wait_until(deadline)) return true;
    s_->aborted.store(true);
    s_->host.abort();
    return false;
  }

 private:
  std::shared_ptr<state> s_;
  std::shared_ptr<job> j_;
};

}  // namespace detail

/// A device communicator over a host communicator (see the file comment). Models
/// `device_communicator` (device_runtime.hpp states the contract) and `premul_sum_communicator`.
///
/// - Device tensors (all on `where`): the call enqueues the copies to host memory on the stream
///   and returns; the communicator's thread waits for them, runs the host collective, and opens
///   the gate behind which the copies back wait. The work completes when those completed.
/// - Host tensors (all of them): the host collective runs on the communicator's thread, in call
///   order with the device ones, and has completed when the call returns.
/// - A call that mixes host and device tensors, or names another device, is a `usage_error`.
///
/// The runtime must stage through host memory (`device_runtime::allocate_host`, gates: the CUDA
/// and the emulated runtime do). The host communicator must outlive this one and be used by
/// nothing else meanwhile; `rt` must outlive this communicator and every work it returned. Use it
/// from one thread, like the host communicator.
class communicator : public single_tensor_calls<communicator> {
 public:
  using single_tensor_calls<communicator>::allreduce;
  using single_tensor_calls<communicator>::broadcast;

  /// Rank `host.rank()` of a device communicator over `host`, on `where` (a CUDA device) of `rt`.
  /// @throws usage_error if `host` is itself a device communicator or `where` is not a device
  communicator(communicator_ref host, device_runtime& rt, device where, options opts = {})
      : s_(std::make_shared<detail::state>(host, rt, where, opts)) {
    if (host.has_device_queue()) {
      throw usage_error(s_->rank, "staged::communicator", "the host communicator is itself a device communicator");
    }
    if (!where.is_cuda()) {
      throw usage_error(s_->rank, "staged::communicator", "stages device tensors: " + where.str() + " is not a device");
    }
    s_->owns_stream = !opts.stream.has_value();
    s_->stream = opts.stream ? *opts.stream : rt.create_stream(where);
    try {
      worker_ = std::thread([s = s_] { s->run(); });
    } catch (...) {
      if (s_->owns_stream) rt.destroy_stream(s_->stream);
      throw;
    }
  }
  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;
  /// Takes over the communicator (its thread and pending work); the source may only be destroyed.
  communicator(communicator&& o) noexcept
      : s_(std::move(o.s_)), worker_(std::move(o.worker_)), in_flight_(std::move(o.in_flight_)), seq_(o.seq_) {}
  communicator& operator=(communicator&&) = delete;

  /// Fails the collectives not run yet (their gates open: the stream goes on), waits for the one
  /// running (bounded by the abort of the host communicator), and for the stream to finish the
  /// copies back before the host memory goes: a host synchronisation.
  ~communicator() {
    if (!s_) return;
    bool pending = false;
    for (const auto& j : in_flight_) pending = pending || !j->finished.load(std::memory_order_acquire);
    if (pending) abort();  // their host collectives fail at once; their gates open
    {
      std::lock_guard lk(s_->m);
      s_->stopping = true;
    }
    s_->cv.notify_all();
    worker_.join();
    for (const auto& j : in_flight_) {
      try {
        s_->rt->synchronize(j->done);
      } catch (...) {  // the stream failed: its copies will not run
      }
      release(*j);
    }
    s_->pool.clear();
    if (s_->owns_stream) s_->rt->destroy_stream(s_->stream);
  }

  /// This rank (the host communicator's).
  [[nodiscard]] int rank() const { return s_->rank; }
  /// Ranks of the host communicator.
  [[nodiscard]] int size() const { return s_->size; }
  /// The runtime, the communicator's stream, and its device.
  [[nodiscard]] ddp::device_queue device_queue() const { return {s_->rt, s_->stream, s_->where}; }
  /// The host communicator.
  [[nodiscard]] communicator_ref host() const noexcept { return s_->host; }
  /// Bytes of page-locked host memory held for staging (kept for reuse until destruction).
  [[nodiscard]] std::size_t staging_bytes() const noexcept { return s_->pool.held_bytes(); }

  /// Collective as in the `communicator` contract (see the class comment).
  /// @throws usage_error for a tensor on another device, host and device tensors in one call, a
  ///   contract violation (backend_contract.hpp), or use after `abort()`; a host call also
  ///   throws its collective's error
  work allreduce(std::span<const tensor_view> ts, reduce_op op) {
    const bool host = on_host("allreduce", ts, op, -1);
    const op_info info = contract::check_allreduce(caller("allreduce", host), ts, op);
    return submit_list(info, ts, host, true,
                       [op](communicator_ref c, std::span<const tensor_view> vs) { return c.allreduce(vs, op); });
  }

  /// In-place sum of every rank's floating-point values first multiplied by `factor`
  /// (ddp/average.hpp's rule): the host communicator's pre-multiplied sum when it has one, else a
  /// scaling of the host copy and a sum.
  /// @throws as `allreduce`; usage_error if `factor` is not finite
  work allreduce_premul_sum(std::span<const tensor_view> ts, double factor) {
    const bool host = on_host("allreduce", ts, reduce_op::sum, -1);
    const op_info info = contract::check_allreduce(caller("allreduce", host), ts, reduce_op::sum);
    if (!std::isfinite(factor))
      throw usage_error(rank(), info.describe(), "the pre-multiplication factor is not finite");
    return submit_list(info, ts, host, true, [factor](communicator_ref c, std::span<const tensor_view> vs) {
      if (c.has_premul_sum()) return c.allreduce_premul_sum(vs, factor);
      for (const tensor_view& v : vs) ddp::detail::scale_in_place(v.type, v.data, v.count, factor);
      return c.allreduce(vs, reduce_op::sum);
    });
  }

  /// @copydoc allreduce
  work broadcast(std::span<const tensor_view> ts, int root) {
    const bool host = on_host("broadcast", ts, reduce_op::sum, root);
    const op_info info = contract::check_broadcast(caller("broadcast", host), ts, root);
    return submit_list(info, ts, host, rank() == root,
                       [root](communicator_ref c, std::span<const tensor_view> vs) { return c.broadcast(vs, root); });
  }

  /// @copydoc allreduce
  work allgather(tensor_view in, tensor_view out) {
    const tensor_view both[] = {in, out};
    const bool host = on_host("allgather", both, reduce_op::sum, -1);
    const op_info info = contract::check_allgather(caller("allgather", host), in, out);
    // In place, the input is this rank's block of the output: only the output is staged.
    const bool in_place = contract::is_in_place_allgather(rank(), in, out);
    return submit_pair(info, in, out, host, in_place,
                       [](communicator_ref c, tensor_view i, tensor_view o) { return c.allgather(i, o); });
  }

  /// @copydoc allreduce
  work reduce_scatter(tensor_view in, tensor_view out, reduce_op op) {
    const tensor_view both[] = {in, out};
    const bool host = on_host("reduce_scatter", both, op, -1);
    const op_info info = contract::check_reduce_scatter(caller("reduce_scatter", host), in, out, op);
    return submit_pair(info, in, out, host, false,
                       [op](communicator_ref c, tensor_view i, tensor_view o) { return c.reduce_scatter(i, o, op); });
  }

  /// The host communicator's barrier, in call order; its work completes when the stream passed it.
  /// @throws usage_error after `abort()`
  work barrier() {
    const op_info info = contract::check_barrier(caller("barrier", false));
    return submit_list(info, {}, false, false,
                       [](communicator_ref c, std::span<const tensor_view>) { return c.barrier(); });
  }

  /// Aborts the host communicator: the collective running fails, and every later one; gates open,
  /// so the stream goes on. Later calls throw usage_error.
  void abort() noexcept {
    if (!s_ || s_->aborted.exchange(true)) return;
    s_->host.abort();
  }

 private:
  static constexpr std::string_view backend_name = "the staged communicator";

  [[nodiscard]] contract::caller caller(const char* name, bool host) const {
    if (s_->aborted.load()) throw usage_error(rank(), name, "communicator used after abort()");
    return {rank(), size(), seq_, s_->opts.timeout,
            host ? contract::memory_rule::host(backend_name)
                 : contract::memory_rule{s_->where, backend_name, "or host memory for every tensor of a call"}};
  }

  // True if every tensor is host memory, false if none is; a mix is a usage_error.
  [[nodiscard]] bool on_host(const char* name, std::span<const tensor_view> ts, reduce_op op, int root) const {
    std::size_t hosts = 0;
    for (const tensor_view& t : ts) hosts += t.where.is_host() ? 1 : 0;
    if (hosts == 0 || hosts == ts.size()) return hosts > 0;
    op_info info = contract::detail::start_info(caller(name, true), name, op, root);
    info.type = ts.front().type;
    throw usage_error(rank(), info.describe(),
                      "mixes host and device memory: " + std::string(backend_name) +
                          " takes every tensor of a call on " + s_->where.str() + ", or every one in host memory");
  }

  // Returns the buffers of collectives whose copies back completed to the pool.
  void recycle() {
    while (!in_flight_.empty()) {
      detail::job& j = *in_flight_.front();
      if (!j.finished.load(std::memory_order_acquire) || !s_->rt->query(j.done)) break;
      release(j);
      in_flight_.pop_front();
    }
  }
  void release(detail::job& j) { s_->pool.give_back(std::move(j.buffer)); }

  // A host call: run on the thread in order, complete on return.
  work run_host(const std::shared_ptr<detail::job>& j) {
    push(j);
    std::unique_lock lk(s_->m);
    s_->cv.wait(lk, [&] { return j->finished.load(std::memory_order_acquire); });
    lk.unlock();
    if (j->error) std::rethrow_exception(j->error);
    return work::ready();
  }

  void push(std::shared_ptr<detail::job> j) {
    ++seq_;
    {
      std::lock_guard lk(s_->m);
      s_->queue.push_back(std::move(j));
    }
    s_->cv.notify_all();
  }

  // A device call: `in` copied to the host buffer, the host collective over its views, `out`
  // copied back behind the gate. Whatever fails, no gate stays closed on the stream: what can fail
  // is created before anything is enqueued, and once the gate is enqueued a failure opens it.
  work run_device(const std::shared_ptr<detail::job>& j, std::span<const copy_region> in,
                  std::span<const copy_region> out) {
    device_runtime& rt = *s_->rt;
    in_flight_.emplace_back();  // its buffer stays taken until the stream passed the copies back
    try {
      j->staged = rt.create_event(s_->where);
      j->done = rt.create_event(s_->where);
      j->gate = rt.create_gate();
    } catch (...) {
      in_flight_.pop_back();
      release(*j);
      throw;
    }
    in_flight_.back() = j;
    bool gated = false;
    try {
      rt.copy(in, s_->stream);
      rt.record(j->staged, s_->stream);
      rt.wait_gate(s_->stream, j->gate);
      gated = true;
      rt.copy(out, s_->stream);
      rt.record(j->done, s_->stream);
      push(j);
    } catch (...) {
      j->error = std::current_exception();
      if (!gated) {  // nothing waits for the gate; mark where the stream is, for the buffer's release
        try {
          rt.record(j->done, s_->stream);
        } catch (...) {  // never recorded: counts as complete
        }
      }
      s_->finish(*j);  // opens the gate
      throw;
    }
    return work(std::make_unique<detail::staged_work>(s_, j));
  }

  template <class Issue>
  work submit_list(const op_info& info, std::span<const tensor_view> ts, bool host, bool copy_in, Issue issue) {
    auto j = std::make_shared<detail::job>(*s_->rt);
    j->info = info;
    if (host) {
      j->issue = [views = std::vector<tensor_view>(ts.begin(), ts.end()), issue](communicator_ref c) {
        return issue(c, std::span<const tensor_view>(views));
      };
      return run_host(j);
    }
    recycle();
    std::size_t bytes = 0;
    for (const tensor_view& t : ts) bytes += detail::pinned_pool::aligned(t.bytes());
    j->buffer = s_->pool.take(bytes);
    std::vector<tensor_view> views;
    std::vector<copy_region> to_host, back;
    std::size_t at = 0;
    for (const tensor_view& t : ts) {
      std::byte* h = j->buffer.data + at;
      views.push_back({h, t.count, t.type, device::host()});
      if (copy_in) to_host.push_back({h, t.data, t.bytes()});
      back.push_back({t.data, h, t.bytes()});
      at += detail::pinned_pool::aligned(t.bytes());
    }
    j->issue = [views = std::move(views), issue](communicator_ref c) {
      return issue(c, std::span<const tensor_view>(views));
    };
    return run_device(j, to_host, back);
  }

  template <class Issue>
  work submit_pair(const op_info& info, tensor_view in, tensor_view out, bool host, bool in_place, Issue issue) {
    auto j = std::make_shared<detail::job>(*s_->rt);
    j->info = info;
    if (host) {
      j->issue = [in, out, issue](communicator_ref c) { return issue(c, in, out); };
      return run_host(j);
    }
    recycle();
    const std::size_t out_at = in_place ? 0 : detail::pinned_pool::aligned(in.bytes());
    j->buffer = s_->pool.take(out_at + out.bytes());
    std::byte* hout = j->buffer.data + out_at;
    // In place: the input is a block of the output; its host copy is that block of the host output.
    std::byte* hin = in_place
                         ? hout + (static_cast<const std::byte*>(in.data) - static_cast<const std::byte*>(out.data))
                         : j->buffer.data;
    const copy_region to_host[] = {{hin, in.data, in.bytes()}};
    const copy_region back[] = {{out.data, hout, out.bytes()}};
    j->issue = [hin = tensor_view{hin, in.count, in.type, device::host()},
                hout = tensor_view{hout, out.count, out.type, device::host()},
                issue](communicator_ref c) { return issue(c, hin, hout); };
    return run_device(j, to_host, back);
  }

  std::shared_ptr<detail::state> s_;
  std::thread worker_;
  std::deque<std::shared_ptr<detail::job>> in_flight_;  // device calls whose buffers are not back
  std::uint64_t seq_ = 0;
};

static_assert(ddp::communicator<communicator>);
static_assert(ddp::device_communicator<communicator>);
static_assert(ddp::premul_sum_communicator<communicator>);

}  // namespace ddp::staged
