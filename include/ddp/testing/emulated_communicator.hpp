#pragma once
/// @file testing/emulated_communicator.hpp
/// @brief `ddp::emulated_device::communicator`: a device communicator over any host communicator,
/// its collectives run in stream order on an emulated device (ddp/testing/emulated.hpp).

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
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
#include <ddp/detail/host_staging.hpp>
#include <ddp/device.hpp>
#include <ddp/device_runtime.hpp>
#include <ddp/error.hpp>
#include <ddp/reduce_op.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>
#include <ddp/testing/emulated_runtime.hpp>

namespace ddp::emulated_device {

/// Settings of an emulated device communicator.
struct options {
  /// Deadline of the `wait()` of a collective over device tensors (and of a staged one). On it the
  /// communicator is aborted before `wait()` throws `timeout_error` (as the NCCL backend does: a
  /// collective whose peer never arrives would otherwise stay on the stream).
  std::chrono::milliseconds timeout = default_timeout;
  /// A stream of the runtime (owned by the caller) to run on instead of a stream of its own, as
  /// NCCL's `options::stream`: several communicators in turn on one stream (a Manager's quorums,
  /// `manager_options::device_queue`). Then an abort, or the destruction, drops this communicator's
  /// collectives still pending on the stream (their works fail) and the stream goes on, as after
  /// `ncclCommAbort`; with a stream of its own, the stream fails instead.
  std::optional<device_stream> stream{};
};

namespace detail {

/// What a communicator and its pending steps and works share.
struct comm_state {
  comm_state(communicator_ref c, runtime& r, int ordinal, options o)
      : inner(c), rt(&r), where(device::cuda(ordinal)), rank(c.rank()), size(c.size()), opts(o) {}
  communicator_ref inner;
  runtime* rt;
  device_stream stream;
  device where;
  int rank;
  int size;
  options opts;
  std::atomic<bool> aborted{false};
  bool owns_stream = true;
  std::atomic<bool> closed{false};  // destroyed: its steps still on a shared stream are dropped

  // Aborts the host communicator, never while a step is issuing or testing one of its collectives.
  void abort() noexcept {
    if (aborted.exchange(true)) return;
    try {
      rt->exclusive([this] { inner.abort(); });
    } catch (...) {  // could not lock: abort anyway
      inner.abort();
    }
  }
};

/// The work of a collective over device tensors: complete once the event recorded after it on
/// the communicator's stream completed ("completed on the device"); rethrows the stream's error.
class device_work final : public work_state {
 public:
  device_work(op_info info, std::shared_ptr<comm_state> state, device_event done,
              std::shared_ptr<std::exception_ptr> dropped)
      : work_state(info), state_(std::move(state)), done_(done), dropped_(std::move(dropped)) {}
  ~device_work() override { state_->rt->destroy_event(done_); }
  device_work(const device_work&) = delete;
  device_work& operator=(const device_work&) = delete;

  bool poll() override {
    if (!state_->rt->query(done_)) return false;
    if (*dropped_) std::rethrow_exception(*dropped_);  // on a shared stream: failed, the stream went on
    return true;
  }

  /// On the deadline the communicator is aborted (see `options::timeout`).
  bool wait_until(clock::time_point deadline) override {
    if (work_state::wait_until(deadline)) return true;
    state_->abort();
    return false;
  }

  /// Nothing to do: stream order, not this handle, protects the buffers (as with NCCL).
  void abandon() noexcept override {}

 private:
  std::shared_ptr<comm_state> state_;
  device_event done_;
  std::shared_ptr<std::exception_ptr> dropped_;
};

/// `v`, tagged as the host memory it is.
[[nodiscard]] inline tensor_view as_host(tensor_view v) noexcept {
  v.where = device::host();
  return v;
}
[[nodiscard]] inline std::vector<tensor_view> as_host(std::span<const tensor_view> vs) {
  std::vector<tensor_view> out(vs.begin(), vs.end());
  for (tensor_view& v : out) v.where = device::host();
  return out;
}

}  // namespace detail

/// A device communicator over any host communicator: its collectives over device tensors are
/// enqueued on its own stream of `rt` and run the host communicator's collective when the stream
/// reaches them (the views re-tagged as host memory, which they are). Models
/// `device_communicator` (device_runtime.hpp states the contract) and `premul_sum_communicator`.
///
/// - Device tensors (all on `cuda(device_ordinal)`): the call returns at once; its work completes
///   when the collective completed on the stream; work enqueued on the stream after the call sees
///   the result without any host wait.
/// - Host tensors (all of them): staged through device memory on the stream (detail/host_staging.hpp)
///   and complete when the call returns: one `synchronize`, a host synchronisation.
/// - A call that mixes host and device tensors, or names another device, is a `usage_error`.
///
/// The host communicator must outlive this one and be used by nothing else meanwhile (its calls
/// are issued from whichever thread pumps the runtime, one at a time, in stream order); `rt` must
/// outlive this communicator and every work it returned. Use it from one thread, like the host
/// communicator.
class communicator : public single_tensor_calls<communicator> {
 public:
  using single_tensor_calls<communicator>::allreduce;
  using single_tensor_calls<communicator>::broadcast;

  /// Rank `inner.rank()` of a device communicator over `inner`, on device `device_ordinal` of
  /// `rt`, with a new stream of `rt`.
  /// @throws usage_error if `inner` is itself a device communicator, or the ordinal is negative
  communicator(communicator_ref inner, runtime& rt, int device_ordinal, options opts = {})
      : s_(std::make_shared<detail::comm_state>(inner, rt, device_ordinal, opts)) {
    if (inner.has_device_queue()) {
      throw usage_error(s_->rank, "emulated_device::communicator",
                        "the host communicator is itself a device communicator");
    }
    if (device_ordinal < 0) {
      throw usage_error(s_->rank, "emulated_device::communicator",
                        "device ordinal " + std::to_string(device_ordinal) + " is negative");
    }
    if (opts.stream) {
      s_->stream = *opts.stream;
      s_->owns_stream = false;
    } else {
      s_->stream = rt.create_stream(s_->where);
    }
  }
  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;
  /// Takes over the communicator (its stream and pending work); the source may only be destroyed.
  communicator(communicator&& o) noexcept : s_(std::move(o.s_)), seq_(o.seq_) {}
  communicator& operator=(communicator&&) = delete;

  /// Drops the collectives still pending on its stream (their works fail with
  /// communication_error; their host collectives are abandoned) and destroys the stream.
  ~communicator() {
    if (!s_) return;
    if (!s_->owns_stream) {  // the caller's stream goes on; this communicator's steps on it are dropped
      try {
        s_->rt->exclusive([this] { s_->closed = true; });
      } catch (...) {
        s_->closed = true;
      }
      return;
    }
    try {
      s_->rt->fail_stream(s_->stream, std::make_exception_ptr(communication_error(
                                          s_->rank, "emulated_device::communicator",
                                          "the communicator was destroyed with this work pending on its stream")));
    } catch (...) {
    }
    s_->rt->destroy_stream(s_->stream);
  }

  /// This rank (the host communicator's).
  [[nodiscard]] int rank() const { return s_->rank; }
  /// Ranks of the host communicator.
  [[nodiscard]] int size() const { return s_->size; }
  /// The runtime, the communicator's stream, and `cuda(device_ordinal)`.
  [[nodiscard]] ddp::device_queue device_queue() const { return {s_->rt, s_->stream, s_->where}; }
  /// The host communicator.
  [[nodiscard]] communicator_ref inner() const noexcept { return s_->inner; }
  /// Number of collectives issued (device and staged).
  [[nodiscard]] std::uint64_t issued() const noexcept { return seq_; }

  /// Collective as in the `communicator` contract (see the class comment for host tensors).
  /// @throws usage_error for a tensor on another device, host and device tensors in one call, a
  ///   contract violation (backend_contract.hpp), or use after `abort()`; a staged call also
  ///   throws its collective's error
  work allreduce(std::span<const tensor_view> ts, reduce_op op) {
    const bool host = host_call("allreduce", ts, op, -1);
    const op_info info = contract::check_allreduce(caller("allreduce", host), ts, op);
    auto issue = [op](communicator_ref c, std::span<const tensor_view> vs) { return c.allreduce(vs, op); };
    return host ? staged_list(info, ts, true, issue) : enqueue_list(info, ts, issue);
  }

  /// In-place sum in which every rank's floating-point values are first multiplied by `factor`
  /// (ddp/average.hpp's rule; integers are summed as they are): the host communicator's
  /// pre-multiplied sum when it has one, else a scaling in place on the stream and a sum.
  /// @throws as `allreduce`; usage_error if `factor` is not finite
  work allreduce_premul_sum(std::span<const tensor_view> ts, double factor) {
    const bool host = host_call("allreduce", ts, reduce_op::sum, -1);
    const op_info info = contract::check_allreduce(caller("allreduce", host), ts, reduce_op::sum);
    if (!std::isfinite(factor)) {
      throw usage_error(rank(), info.describe(), "the pre-multiplication factor is not finite");
    }
    auto issue = [factor](communicator_ref c, std::span<const tensor_view> vs) {
      if (c.has_premul_sum()) return c.allreduce_premul_sum(vs, factor);
      for (const tensor_view& v : vs) ddp::detail::scale_in_place(v.type, v.data, v.count, factor);
      return c.allreduce(vs, reduce_op::sum);
    };
    return host ? staged_list(info, ts, true, issue) : enqueue_list(info, ts, issue);
  }

  /// @copydoc allreduce
  work broadcast(std::span<const tensor_view> ts, int root) {
    const bool host = host_call("broadcast", ts, reduce_op::sum, root);
    const op_info info = contract::check_broadcast(caller("broadcast", host), ts, root);
    auto issue = [root](communicator_ref c, std::span<const tensor_view> vs) { return c.broadcast(vs, root); };
    return host ? staged_list(info, ts, rank() == root, issue) : enqueue_list(info, ts, issue);
  }

  /// @copydoc allreduce
  work allgather(tensor_view in, tensor_view out) {
    const tensor_view both[] = {in, out};
    const bool host = host_call("allgather", both, reduce_op::sum, -1);
    const op_info info = contract::check_allgather(caller("allgather", host), in, out);
    auto issue = [](communicator_ref c, tensor_view i, tensor_view o) { return c.allgather(i, o); };
    if (!host) return enqueue_pair(info, in, out, issue);
    ddp::detail::host_staging staging(device_queue());
    tensor_view din;
    tensor_view dout;
    if (contract::is_in_place_allgather(rank(), in, out)) {
      dout = staging.stage(out, /*copy_in=*/false);
      din = staging.stage(in, /*copy_in=*/true);  // its block of the output's copy
    } else {
      din = staging.stage(in, /*copy_in=*/true, /*copy_out=*/false);
      dout = staging.stage(out, /*copy_in=*/false);
    }
    staging.finish(enqueue_pair(info, din, dout, issue), info);
    return work::ready();
  }

  /// @copydoc allreduce
  work reduce_scatter(tensor_view in, tensor_view out, reduce_op op) {
    const tensor_view both[] = {in, out};
    const bool host = host_call("reduce_scatter", both, op, -1);
    const op_info info = contract::check_reduce_scatter(caller("reduce_scatter", host), in, out, op);
    auto issue = [op](communicator_ref c, tensor_view i, tensor_view o) { return c.reduce_scatter(i, o, op); };
    if (!host) return enqueue_pair(info, in, out, issue);
    ddp::detail::host_staging staging(device_queue());
    const tensor_view din = staging.stage(in, /*copy_in=*/true, /*copy_out=*/false);
    const tensor_view dout = staging.stage(out, /*copy_in=*/false);
    staging.finish(enqueue_pair(info, din, dout, issue), info);
    return work::ready();
  }

  /// A barrier enqueued on the stream (its work completes when the stream passed it).
  /// @throws usage_error after `abort()`
  work barrier() {
    const op_info info = contract::check_barrier(caller("barrier", false));
    return enqueue(info, [](communicator_ref c) { return c.barrier(); });
  }

  /// Aborts the host communicator: pending collectives fail with communication_error (those not
  /// issued yet when the stream reaches them); later calls throw usage_error.
  void abort() noexcept {
    if (s_) s_->abort();
  }

 private:
  static constexpr std::string_view backend_name = "the emulated device communicator";

  // The calling rank for the contract checks: host memory for a staged call, this device otherwise.
  [[nodiscard]] contract::caller caller(const char* name, bool host) const {
    if (s_->aborted.load()) throw usage_error(rank(), name, "communicator used after abort()");
    return {rank(), size(), seq_, s_->opts.timeout,
            host ? contract::memory_rule::host(backend_name)
                 : contract::memory_rule{s_->where, backend_name, "or host memory for every tensor of a call"}};
  }

  // True if every tensor of the call is host memory (staged), false if none is; a mix throws.
  [[nodiscard]] bool host_call(const char* name, std::span<const tensor_view> ts, reduce_op op, int root) const {
    std::size_t first_host = ts.size();
    std::size_t first_device = ts.size();
    for (std::size_t i = 0; i < ts.size(); ++i) {
      std::size_t& slot = ts[i].where.is_host() ? first_host : first_device;
      if (slot == ts.size()) slot = i;
    }
    if (first_host == ts.size()) return false;
    if (first_device == ts.size()) return true;
    if (s_->aborted.load()) throw usage_error(rank(), name, "communicator used after abort()");
    op_info info = contract::detail::start_info(caller(name, true), name, op, root);
    info.type = ts.front().type;
    for (const tensor_view& t : ts) info.count += t.count;
    const bool pair = std::string_view(name) == "allgather" || std::string_view(name) == "reduce_scatter";
    auto label = [&](std::size_t i) {
      return pair ? std::string(i == 0 ? "input" : "output") : "tensor #" + std::to_string(i);
    };
    throw usage_error(rank(), info.describe(),
                      "mixes host and device memory (" + label(first_host) + " on host, " + label(first_device) +
                          " on " + ts[first_device].where.str() + "): " + std::string(backend_name) +
                          " takes every tensor of a call on " + s_->where.str() +
                          ", or every one in host memory (staged through the device)");
  }

  // Enqueues the step that issues `issue(inner)` when the stream reaches it and is done when that
  // work completed; records an event after it. Returns at once.
  template <class Issue>
  work enqueue(const op_info& info, Issue issue) {
    struct pending {
      work inner;
      bool issued = false;
    };
    auto p = std::make_shared<pending>();
    // On a shared stream (options::stream) a failure is this collective's alone: it is kept here
    // for its work, and the stream goes on; on the communicator's own stream it fails the stream.
    auto dropped = std::make_shared<std::exception_ptr>();
    s_->rt->enqueue(s_->stream, [s = s_, p, dropped, info, issue = std::move(issue)]() -> bool {
      try {
        if (!p->issued) {
          if (s->aborted.load() || s->closed.load()) {
            throw communication_error(info.rank, info.describe(),
                                      std::string("the communicator was ") +
                                          (s->closed.load() ? "destroyed" : "aborted") +
                                          " before this collective ran on its stream");
          }
          p->issued = true;
          p->inner = issue(s->inner);
        }
        if (s->closed.load()) {
          throw communication_error(info.rank, info.describe(),
                                    "the communicator was destroyed with this collective pending on its stream");
        }
        return p->inner.test();
      } catch (...) {
        if (s->owns_stream) throw;
        *dropped = std::current_exception();
        return true;
      }
    });
    ++seq_;
    const device_event done = s_->rt->create_event(s_->where);
    s_->rt->record(done, s_->stream);
    return work(std::make_unique<detail::device_work>(info, s_, done, std::move(dropped)));
  }

  template <class Issue>
  work enqueue_list(const op_info& info, std::span<const tensor_view> ts, Issue issue) {
    return enqueue(info, [views = detail::as_host(ts), issue](communicator_ref c) {
      return issue(c, std::span<const tensor_view>(views));
    });
  }

  template <class Issue>
  work enqueue_pair(const op_info& info, tensor_view in, tensor_view out, Issue issue) {
    return enqueue(info, [in = detail::as_host(in), out = detail::as_host(out), issue](communicator_ref c) {
      return issue(c, in, out);
    });
  }

  // A call over host tensors: staged through device memory, complete on return.
  template <class Issue>
  work staged_list(const op_info& info, std::span<const tensor_view> ts, bool copy_in, Issue issue) {
    ddp::detail::host_staging staging(device_queue());
    std::vector<tensor_view> dev;
    dev.reserve(ts.size());
    for (const tensor_view& t : ts) dev.push_back(staging.stage(t, copy_in));
    staging.finish(enqueue_list(info, dev, issue), info);
    return work::ready();
  }

  std::shared_ptr<detail::comm_state> s_;
  std::uint64_t seq_ = 0;
};

static_assert(ddp::communicator<communicator>);
static_assert(ddp::device_communicator<communicator>);
static_assert(ddp::premul_sum_communicator<communicator>);

}  // namespace ddp::emulated_device
