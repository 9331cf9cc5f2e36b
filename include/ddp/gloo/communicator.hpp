#pragma once
/// @file gloo/communicator.hpp
/// @brief `ddp::gloo::communicator`: a CPU communicator over gloo's TCP transport, built through
/// a rendezvous store, that survives the death of a peer.
///
/// What a failure looks like from a survivor: the pending and later collectives fail with
/// `communication_error` (a peer's connection ended) or `timeout_error` (a peer stopped
/// answering), within milliseconds of a death or at the configured timeout for a stopped
/// process; never a hang, never a crash, never SIGPIPE. The communicator stays broken; the
/// survivors build a new one in a fresh generation of the store (see gloo/enroll.hpp) and
/// destroy or leak the old one, which neither hangs nor crashes.
///
/// Threads: collectives may be issued from any thread (one at a time per call; ranks must agree
/// on the order). Work handles may be waited on from any thread.

#include <chrono>
#include <cstddef>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <gloo/config.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>
#if GLOO_HAVE_TRANSPORT_TCP_TLS
#include <gloo/transport/tcp/tls/device.h>
#endif

#include <ddp/backend_contract.hpp>
#include <ddp/communicator.hpp>
#include <ddp/error.hpp>
#include <ddp/gloo/authenticate.hpp>
#include <ddp/gloo/collectives.hpp>
#include <ddp/gloo/engine.hpp>
#include <ddp/gloo/errors.hpp>
#include <ddp/gloo/options.hpp>
#include <ddp/gloo/queued_work.hpp>
#include <ddp/gloo/rendezvous_store.hpp>
#include <ddp/reduce_op.hpp>
#include <ddp/store.hpp>
#include <ddp/stores/sigpipe.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp::gloo {

/// One rank's handle on a gloo communicator. Move-only.
class communicator {
 public:
  /// Connects rank `rank` of a `size`-member communicator. Every member calls this with the same
  /// store namespace (a fresh one per communicator: stores::generation_store), `size` and
  /// `opts.key_prefix`. The store is used only while connecting.
  /// @throws usage_error for a bad rank or size, or a namespace an earlier communicator used;
  ///         timeout_error if a member did not show up within `opts.connect_timeout`;
  ///         communication_error if connecting failed
  communicator(store_ref store, int rank, int size, options opts = {}) : rank_(rank), size_(size) {
    if (size < 1 || rank < 0 || rank >= size) {
      throw usage_error(
          rank, "gloo connect",
          "rank " + std::to_string(rank) + " is not a rank of a communicator of size " + std::to_string(size));
    }
    if (opts.timeout.count() <= 0 || opts.connect_timeout.count() <= 0) {
      throw usage_error(rank, "gloo connect", "timeouts must be positive");
    }
    const auto deadline = clock::now() + opts.connect_timeout;
    // gloo's I/O thread is created with the device and inherits this thread's signal mask, and
    // the worker thread below too: SIGPIPE stays blocked in them for good (stores/sigpipe.hpp).
    const sigpipe_guard no_sigpipe;
    std::shared_ptr<::gloo::transport::Device> device;
    try {
      ::gloo::transport::tcp::attr attr;
      if (!opts.interface.empty()) {
        attr.iface = opts.interface;
      } else {
        attr.hostname = opts.hostname;
      }
      device = create_device(attr, opts.tls, rank);
    } catch (const usage_error&) {
      throw;
    } catch (const std::exception& e) {
      throw communication_error(
          rank, "gloo connect",
          "cannot listen on '" + (opts.interface.empty() ? opts.hostname : opts.interface) + "': " + e.what());
    }
    auto ctx = std::make_shared<::gloo::rendezvous::Context>(rank, size);
    // Connecting waits on peers with the context's timeout: keep it within the connect budget.
    ctx->setTimeout(std::min(opts.timeout, opts.connect_timeout));
    detail::rendezvous_store rendezvous(store, opts.key_prefix, rank, deadline, size, &opts.progress);
    op_info connect_info;
    connect_info.rank = rank;
    connect_info.name = "connect";
    try {
      const auto records = detail::exchange_records(rendezvous, rank, size, opts);
      detail::check_secret_rule(records, rank);
      ctx->connectFullMesh(rendezvous, device);
      if (!opts.secret.empty() && size > 1) {
        detail::authenticate_pairs(*ctx, opts.secret,
                                   detail::binding_of(records, rendezvous.addresses(size), opts.key_prefix), deadline);
      }
      rendezvous.connected();
    } catch (...) {
      const auto e = detail::translate_current_exception(connect_info);
      try {
        std::rethrow_exception(e);
      } catch (const ddp::error& x) {
        rethrow_as_connect_error(x, rank, size);
      }
    }
    ctx->setTimeout(opts.timeout);
    engine_ = std::make_shared<detail::engine>(std::move(ctx), opts.timeout, opts.widen_half);
  }

  /// Takes over `other`'s connections; `other` may only be destroyed or assigned to.
  communicator(communicator&&) noexcept = default;
  /// Shuts this communicator down (as the destructor does), then takes over `other`'s.
  communicator& operator=(communicator&& other) noexcept {
    if (this != &other) {
      if (engine_) engine_->shutdown();
      engine_ = std::move(other.engine_);
      rank_ = other.rank_;
      size_ = other.size_;
    }
    return *this;
  }
  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;

  /// Stops the worker and closes the connections. Pending work is aborted first (it fails with
  /// communication_error); returns promptly either way.
  ~communicator() {
    if (engine_) engine_->shutdown();
  }

  /// This member's rank in [0, size()).
  [[nodiscard]] int rank() const { return rank_; }
  /// Number of members.
  [[nodiscard]] int size() const { return size_; }

  /// Deadline of each collective issued from now on.
  [[nodiscard]] std::chrono::milliseconds timeout() const { return live("timeout").timeout(); }
  /// Sets the deadline of each collective issued from now on.
  void set_timeout(std::chrono::milliseconds t) {
    if (t.count() <= 0) throw usage_error(rank_, "set_timeout", "timeout must be positive");
    live("set_timeout").set_timeout(t);
  }

  /// In-place allreduce of `ts` (one call; dtypes may differ; one gloo call per dtype).
  work allreduce(std::span<const tensor_view> ts, reduce_op op) {
    const op_info info = contract::check_allreduce(caller("allreduce"), ts, op);
    std::vector<tensor_view> views(ts.begin(), ts.end());
    return issue(info,
                 [views = std::move(views), op](detail::call_context& c) { detail::run_allreduce(c, views, op); });
  }

  /// In-place broadcast of `ts` from `root` (one byte-wise gloo call for all of them).
  work broadcast(std::span<const tensor_view> ts, int root) {
    const op_info info = contract::check_broadcast(caller("broadcast"), ts, root);
    std::vector<tensor_view> views(ts.begin(), ts.end());
    return issue(info,
                 [views = std::move(views), root](detail::call_context& c) { detail::run_broadcast(c, views, root); });
  }

  /// Rank r's `in` lands at `out[r * in.count]`; `out.count == in.count * size()`.
  work allgather(tensor_view in, tensor_view out) {
    const op_info info = contract::check_allgather(caller("allgather"), in, out);
    return issue(info, [in, out](detail::call_context& c) { detail::run_allgather(c, in, out); });
  }

  /// Rank r gets block r of the reduction of `in`; `in.count == out.count * size()`. `in` is
  /// left untouched (the reduction runs on a copy).
  work reduce_scatter(tensor_view in, tensor_view out, reduce_op op) {
    const op_info info = contract::check_reduce_scatter(caller("reduce_scatter"), in, out, op);
    return issue(info, [in, out, op](detail::call_context& c) { detail::run_reduce_scatter(c, in, out, op); });
  }

  /// Completes once every member issued it.
  work barrier() {
    const op_info info = contract::check_barrier(caller("barrier"));
    return issue(info, [](detail::call_context& c) { detail::run_barrier(c); });
  }

  /// Pending work of this rank fails with communication_error; a running collective is woken
  /// (its connections are shut down, so peers' pending work fails promptly too). Later calls
  /// throw usage_error. Never blocks on the network.
  void abort() noexcept {
    if (engine_) engine_->abort("rank " + std::to_string(rank_) + " aborted its communicator");
  }

  /// True after abort() (or after a work handle gave up on a pending operation).
  [[nodiscard]] bool aborted() const { return engine_ && engine_->aborted(); }
  /// Why the communicator stopped working: the first failure, or the abort ("" while healthy).
  [[nodiscard]] std::string failure() const { return engine_ ? engine_->failure() : std::string("moved from"); }
  /// Number of collectives issued so far.
  [[nodiscard]] std::uint64_t issued() const { return engine_ ? engine_->issued() : 0; }

 private:
  static std::shared_ptr<::gloo::transport::Device> create_device(const ::gloo::transport::tcp::attr& attr,
                                                                  const std::optional<tls_files>& tls,
                                                                  [[maybe_unused]] int rank) {
    if (!tls) return ::gloo::transport::tcp::CreateDevice(attr);
#if GLOO_HAVE_TRANSPORT_TCP_TLS
    return ::gloo::transport::tcp::tls::CreateDevice(attr, tls->private_key, tls->certificate, tls->ca_file,
                                                     tls->ca_path);
#else
    throw usage_error(rank, "gloo connect",
                      "TLS was asked for (options::tls), but this gloo was built without its TLS transport "
                      "(GLOO_HAVE_TRANSPORT_TCP_TLS is 0, as in Debian's libgloo): use a gloo built with "
                      "USE_TCP_OPENSSL_LINK or USE_TCP_OPENSSL_LOAD, or leave tls unset and rely on the job "
                      "secret, which authenticates peers but does not encrypt (docs/security.md)");
#endif
  }

  [[noreturn]] static void rethrow_as_connect_error(const ddp::error& e, int rank, int size) {
    const std::string op = "gloo connect (rank " + std::to_string(rank) + " of " + std::to_string(size) + ")";
    // Keep the type and the message; say who we are once.
    std::string what = e.message();
    if (what.find("Connection refused") != std::string::npos) {
      // gloo's pair listener accepts one connection: whoever came first holds it.
      what += "; the peer is gone, or a process outside the job connected to its port first (docs/security.md)";
    }
    if (dynamic_cast<const timeout_error*>(&e)) throw timeout_error(rank, op, what);
    if (dynamic_cast<const usage_error*>(&e)) throw usage_error(rank, op, what);
    throw communication_error(rank, op, what);
  }

  detail::engine& live(const char* what) const {
    if (!engine_) throw usage_error(rank_, what, "communicator was moved from");
    return *engine_;
  }

  // The calling rank, for the contract checks (backend_contract.hpp); the engine sets the call's
  // sequence number and timeout again when it queues the call.
  contract::caller caller(const char* name) const {
    const detail::engine& e = live(name);
    return {rank_, size_, e.issued(), e.timeout(), contract::memory_rule::host("the gloo backend")};
  }

  work issue(const op_info& info, std::function<void(detail::call_context&)> body) {
    auto& e = live(info.name);
    std::exception_ptr failed_now;
    auto op = e.submit(info, std::move(body), failed_now);
    if (failed_now) return work::failed(std::move(failed_now));
    return work(std::make_unique<detail::queued_work>(engine_, std::move(op)));
  }

  std::shared_ptr<detail::engine> engine_;
  int rank_ = 0;
  int size_ = 0;
};

static_assert(ddp::communicator<communicator>);

}  // namespace ddp::gloo
