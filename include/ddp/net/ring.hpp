#pragma once
/// @file net/ring.hpp
/// @brief `net::ring`: ddp's own TCP ring among node leaders, for the inter-node step of the
/// node-aware allreduce (shm::options::across_nodes). Each member connects to its right
/// neighbour and accepts its left one; an allreduce is a reduce-scatter then an allgather around
/// the ring, each step sending on a thread of its own while the caller receives and reduces, so
/// both directions of every link carry data at once. Open MPI 4.1's TCP transport moves one
/// direction at a time in this pattern (about half the link across test hosts). Every member
/// ends with the same bits (each block is reduced along one path, then copied around). See
/// docs/backends-sockets.md.
///
/// Who may join: each member listens only on the addresses it publishes, and every connection
/// starts with the handshake of net/ring_handshake.hpp. With the job's secret on every member,
/// both ends prove it, bound to this ring instance and to the acceptor's address and port as
/// dialled (a relay at another address is refused). Without one, a ring whose members are all on
/// one host greets with a token agreed over the members' allgather (a stranger cannot join by
/// mistake); a ring that spans hosts refuses to start unless every member allows it
/// (`insecure_no_secret`). A ring that spans hosts neither listens on nor dials loopback, and a
/// member never dials an address of its own host there: a process of that host could answer.

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/detail/host_reduce.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/job_secret.hpp>
#include <ddp/net/ring_handshake.hpp>
#include <ddp/net/socket.hpp>
#include <ddp/reduce_op.hpp>
#include <ddp/tensor.hpp>

namespace ddp::net {

/// A TCP ring among node leaders (see the file comment). Move-only; a default-constructed or
/// one-member ring has nothing to do.
class ring {
 public:
  /// Connects member `index` of `count` into the ring. `allgather(record)` must return every
  /// member's `ring_record` in index order (the shm communicator passes the leaders'
  /// communicator's allgather). `interface`: publish, and listen on, only that interface's
  /// addresses (empty: every interface that is up). `secret`: the job's secret, which every
  /// connection proves (see the file comment); empty: none. `insecure_no_secret`: without a
  /// secret, let a ring that spans hosts start unauthenticated (any host that reaches its ports
  /// can join it and read or inject data). Collective over the members; every member takes the
  /// same decision from the records.
  /// @throws usage_error (on every member) if some members have a secret and others not, or if
  ///         the ring spans hosts without a secret and not every member set `insecure_no_secret`
  /// @throws communication_error or timeout_error naming the neighbour that could not be reached
  ///         or did not prove the secret
  template <class Allgather>
  [[nodiscard]] static ring connect(int index, int count, Allgather&& allgather, const std::string& interface,
                                    clock::time_point deadline, const context& ctx, const job_secret& secret,
                                    bool insecure_no_secret = false) {
    ring r;
    r.s_->index = index;
    r.s_->count = count;
    if (count < 2) return r;
    const auto found = local_addresses(interface);
    if (found.empty()) {
      detail::fail(ctx, "no IPv4 address to publish" +
                            (interface.empty() ? std::string() : " on interface '" + interface + "'"));
    }
    // Listen on exactly the addresses the record publishes (the named interface's, else those
    // local_addresses picks, at most 8): a neighbour only ever dials those, so listening on every
    // interface would only open the port to networks the ring does not use.
    const std::vector<ipv4> addrs(
        found.begin(), found.begin() + static_cast<std::ptrdiff_t>(std::min(found.size(), ring_record::max_addresses)));
    std::uint16_t port = 0;
    std::vector<socket_fd> listeners = listen_on(addrs, port, ctx);
    const ring_record mine = detail::make_record(index, port, addrs, secret, insecure_no_secret);
    const std::vector<ring_record> all = allgather(mine);
    const detail::ring_plan plan = detail::plan_ring(all, index, count, secret, ctx);
    // Loopback is published (the records decide whether every member is on one host only once
    // they are read) but listened on, and dialled, only if every member is on one host.
    detail::drop_loopback_listeners(listeners, plan);
    r.s_->token = plan.token;
    const int right = (index + 1) % count;
    // Accept the left neighbour while dialling the right one: each handshake waits for an
    // answer, so doing one after the other would wait around the ring.
    const wakeup_pipe cancel(ctx);
    std::exception_ptr accept_error;
    std::thread acceptor([&] {
      try {
        r.s_->left = detail::answer(listeners, cancel, plan, deadline, ctx);
      } catch (...) {
        accept_error = std::current_exception();
      }
    });
    try {
      // Every address of this host, not only the published ones: none is dialled across hosts.
      r.s_->right = detail::dial(all[static_cast<std::size_t>(right)], plan, local_addresses({}, true), deadline, ctx);
    } catch (...) {
      cancel.notify();  // ends the acceptor's wait (after a short grace: detail::answer)
      acceptor.join();
      throw;
    }
    acceptor.join();
    if (accept_error) std::rethrow_exception(accept_error);
    r.s_->sender = std::thread([s = r.s_.get()] { s->send_loop(); });
    return r;
  }

  /// A ring of one member (no connections).
  ring() : s_(std::make_unique<state>()) {}
  /// Takes over the connections and the sending thread.
  ring(ring&&) noexcept = default;
  /// Takes over the connections and the sending thread.
  ring& operator=(ring&&) noexcept = default;
  ~ring() {
    if (s_) s_->stop();
  }

  /// This member's index.
  [[nodiscard]] int index() const noexcept { return s_->index; }
  /// The member count.
  [[nodiscard]] int count() const noexcept { return s_->count; }

  /// Allreduces `region` (host memory) in place among the members, before `deadline`. Every
  /// member calls it with the same count, dtype and op. Throws communication_error (a neighbour
  /// closed, the ring was aborted) or timeout_error; the ring is unusable after an error.
  void allreduce(tensor_view region, reduce_op op, clock::time_point deadline, const context& ctx) {
    state& s = *s_;
    if (s.count < 2 || region.count == 0) return;
    if (s.broken) detail::fail(ctx, "the sockets ring among node leaders failed earlier or was aborted");
    const std::size_t elem = size_of(region.type);
    auto* data = region.byte_data();
    const std::size_t seg_elems = std::max<std::size_t>(1, segment_bytes / elem);
    s.scratch.resize(seg_elems * elem);
    const int n = s.count;
    const auto wrap = [n](int i) { return ((i % n) + n) % n; };
    const auto block = [&](int b) {
      const auto parts = static_cast<std::size_t>(n);
      const auto i = static_cast<std::size_t>(b);
      const std::size_t base = region.count / parts, extra = region.count % parts;
      return std::pair<std::size_t, std::size_t>{i * base + std::min(i, extra), base + (i < extra ? 1 : 0)};
    };
    const std::string left = "node leader " + std::to_string(wrap(s.index - 1)) + " (left in the ring)";
    try {
      // Reduce-scatter: step k sends block me-k right and reduces block me-k-1 from the left.
      for (int k = 0; k < n - 1; ++k) {
        const auto [send_off, send_count] = block(wrap(s.index - k));
        const auto [recv_off, recv_count] = block(wrap(s.index - k - 1));
        s.post_send(data + send_off * elem, send_count * elem, deadline, ctx);
        for (std::size_t done = 0; done < recv_count; done += seg_elems) {
          const std::size_t m = std::min(seg_elems, recv_count - done);
          recv_all(s.left, s.scratch.data(), m * elem, deadline, ctx, left);
          ddp::detail::reduce_into(region.type, op, data + (recv_off + done) * elem, s.scratch.data(), m);
        }
        s.wait_send();
      }
      if (op == reduce_op::avg) {  // this member owns block me+1 now: divide 1/n of the data
        const auto [off, cnt] = block(wrap(s.index + 1));
        ddp::detail::divide_in_place(region.type, data + off * elem, cnt, n);
      }
      // Allgather: step k sends block me+1-k right and receives block me-k into place.
      for (int k = 0; k < n - 1; ++k) {
        const auto [send_off, send_count] = block(wrap(s.index + 1 - k));
        const auto [recv_off, recv_count] = block(wrap(s.index - k));
        s.post_send(data + send_off * elem, send_count * elem, deadline, ctx);
        recv_all(s.left, data + recv_off * elem, recv_count * elem, deadline, ctx, left);
        s.wait_send();
      }
    } catch (...) {
      s.broken = true;
      s.right.shutdown();
      s.left.shutdown();
      s.drain_send();
      throw;
    }
  }

  /// Ends both connections: a blocked allreduce here fails at once, the neighbours' soon.
  void abort() noexcept {
    s_->broken = true;
    s_->right.shutdown();
    s_->left.shutdown();
  }

  /// Bytes a reduce-scatter step receives before reducing them (the scratch size).
  static constexpr std::size_t segment_bytes = std::size_t{1} << 20;

 private:
  // The sender thread: sends one buffer at a time to the right neighbour.
  struct state {
    int index = 0;
    int count = 1;
    std::uint64_t token = 0;
    socket_fd right, left;
    std::vector<std::byte> scratch;
    std::atomic<bool> broken{false};

    std::thread sender;
    std::mutex m;
    std::condition_variable cv;
    const std::byte* job = nullptr;
    std::size_t job_bytes = 0;
    clock::time_point job_deadline;
    context job_ctx;
    bool pending = false, finished = true, stopping = false;
    std::exception_ptr job_error;

    void post_send(const std::byte* p, std::size_t bytes, clock::time_point deadline, const context& ctx) {
      std::lock_guard<std::mutex> lock(m);
      job = p;
      job_bytes = bytes;
      job_deadline = deadline;
      job_ctx = ctx;
      job_error = nullptr;
      pending = true;
      finished = false;
      cv.notify_all();
    }
    void wait_send() {
      std::unique_lock<std::mutex> lock(m);
      cv.wait(lock, [&] { return finished; });
      if (job_error) std::rethrow_exception(std::exchange(job_error, nullptr));
    }
    void drain_send() noexcept {  // after an error: the sender must not touch the region any more
      std::unique_lock<std::mutex> lock(m);
      cv.wait(lock, [&] { return finished; });
      job_error = nullptr;
    }
    void send_loop() {
      std::unique_lock<std::mutex> lock(m);
      for (;;) {
        cv.wait(lock, [&] { return pending || stopping; });
        if (stopping) return;
        pending = false;
        const std::string peer = "node leader " + std::to_string((index + 1) % count) + " (right in the ring)";
        lock.unlock();
        std::exception_ptr err;
        try {
          send_all(right, job, job_bytes, job_deadline, job_ctx, peer);
        } catch (...) {
          err = std::current_exception();
        }
        lock.lock();
        job_error = err;
        finished = true;
        cv.notify_all();
      }
    }
    void stop() noexcept {
      right.shutdown();
      left.shutdown();
      {
        std::lock_guard<std::mutex> lock(m);
        stopping = true;
        cv.notify_all();
      }
      if (sender.joinable()) sender.join();
    }
  };

  std::unique_ptr<state> s_;
};

}  // namespace ddp::net
