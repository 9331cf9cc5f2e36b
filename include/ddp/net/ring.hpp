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
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <ddp/detail/host_reduce.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/net/socket.hpp>
#include <ddp/reduce_op.hpp>
#include <ddp/tensor.hpp>

namespace ddp::net {

/// What each member publishes before the ring connects (a fixed-size record, allgathered).
struct ring_record {
  static constexpr std::uint32_t magic_value = 0x64647052;  ///< "ddpR": a ring's record or greeting
  static constexpr std::size_t max_addresses = 8;           ///< addresses a record carries at most
  std::uint32_t magic = magic_value;                        ///< `magic_value`
  std::uint32_t index = 0;                                  ///< the member's index in the ring
  std::uint64_t token = 0;                             ///< random; the ring's token is the XOR of all members' tokens
  std::uint16_t port = 0;                              ///< the member's listening port
  std::uint16_t addresses = 0;                         ///< entries of `address` in use
  std::array<std::uint32_t, max_addresses> address{};  ///< IPv4, network byte order
};

/// A TCP ring among node leaders (see the file comment). Move-only; a default-constructed or
/// one-member ring has nothing to do.
class ring {
 public:
  /// Connects member `index` of `count` into the ring. `allgather(record)` must return every
  /// member's `ring_record` in index order (the shm communicator passes the leaders'
  /// communicator's allgather). `interface`: publish only that interface's addresses (empty:
  /// every interface that is up). Collective over the members; throws communication_error or
  /// timeout_error naming the neighbour that could not be reached.
  template <class Allgather>
  [[nodiscard]] static ring connect(int index, int count, Allgather&& allgather, const std::string& interface,
                                    clock::time_point deadline, const context& ctx) {
    ring r;
    r.s_->index = index;
    r.s_->count = count;
    if (count < 2) return r;
    ring_record mine;
    mine.index = static_cast<std::uint32_t>(index);
    std::random_device entropy;
    mine.token = (std::uint64_t{entropy()} << 32) ^ entropy();
    socket_fd listener = listen_any(mine.port, ctx);
    const auto addrs = local_addresses(interface);
    if (addrs.empty()) {
      detail::fail(ctx, "no IPv4 address to publish" +
                            (interface.empty() ? std::string() : " on interface '" + interface + "'"));
    }
    for (const ipv4& a : addrs) {
      if (mine.addresses == ring_record::max_addresses) break;
      mine.address[mine.addresses++] = a.addr;
    }
    const std::vector<ring_record> all = allgather(mine);
    std::uint64_t token = 0;
    for (const ring_record& rec : all) token ^= rec.token;
    r.s_->token = token;
    const int right = (index + 1) % count;
    const int left = (index + count - 1) % count;
    // Accept the left neighbour while dialling the right one: each greeting waits for an answer,
    // so doing one after the other would wait around the ring.
    std::exception_ptr accept_error;
    std::thread acceptor([&] {
      try {
        r.s_->left = answer(listener, left, index, token, deadline, ctx);
      } catch (...) {
        accept_error = std::current_exception();
      }
    });
    try {
      r.s_->right = dial(all[static_cast<std::size_t>(right)], index, token, addrs, deadline, ctx);
    } catch (...) {
      listener.shutdown();  // ends the acceptor's wait
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
  struct hello {
    std::uint32_t magic = ring_record::magic_value;
    std::uint32_t index = 0;
    std::uint64_t token = 0;
  };

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

  // Connects to the right neighbour at one of its addresses (ours' subnets first) and checks it
  // answers as that member of this ring: a stranger at that address is skipped.
  static socket_fd dial(const ring_record& peer, int me, std::uint64_t token, const std::vector<ipv4>& mine,
                        clock::time_point deadline, const context& ctx) {
    std::vector<ipv4> candidates;
    for (std::uint16_t i = 0; i < std::min<std::size_t>(peer.addresses, ring_record::max_addresses); ++i) {
      candidates.push_back({peer.address[i]});
    }
    const auto same_subnet = [&](ipv4 a) {
      return std::any_of(mine.begin(), mine.end(), [&](ipv4 b) {
        return (ntohl(a.addr) >> 8) == (ntohl(b.addr) >> 8) && (ntohl(a.addr) >> 24) != 127;
      });
    };
    std::stable_partition(candidates.begin(), candidates.end(), same_subnet);
    const std::string who = "node leader " + std::to_string(peer.index) + " (right in the ring)";
    std::string tried;
    for (ipv4 a : candidates) {
      const auto try_until = std::min(deadline, clock::now() + std::chrono::seconds(5));
      socket_fd s = connect_to(a, peer.port, try_until);
      tried += (tried.empty() ? "" : ", ") + a.str() + ":" + std::to_string(peer.port);
      if (!s) continue;
      try {
        hello h{ring_record::magic_value, static_cast<std::uint32_t>(me), token};
        send_all(s, &h, sizeof h, try_until, ctx, who);
        hello back{};
        recv_all(s, &back, sizeof back, try_until, ctx, who);
        if (back.magic == ring_record::magic_value && back.token == token && back.index == peer.index) return s;
      } catch (const error&) {
      }
    }
    detail::fail(ctx, "could not connect to " + who + " at any of its addresses (" + tried +
                          "); set shm::options::socket_interface to the interface the hosts share");
  }

  // Accepts the left neighbour; connections that do not greet as it are closed and skipped.
  static socket_fd answer(const socket_fd& listener, int left, int me, std::uint64_t token, clock::time_point deadline,
                          const context& ctx) {
    const std::string who = "node leader " + std::to_string(left) + " (left in the ring)";
    for (;;) {
      socket_fd s = accept_one(listener, deadline, ctx, who + " to connect");
      try {
        hello h{};
        recv_all(s, &h, sizeof h, std::min(deadline, clock::now() + std::chrono::seconds(5)), ctx, who);
        if (h.magic != ring_record::magic_value || h.token != token || h.index != static_cast<std::uint32_t>(left)) {
          continue;
        }
        hello back{ring_record::magic_value, static_cast<std::uint32_t>(me), token};
        send_all(s, &back, sizeof back, deadline, ctx, who);
        return s;
      } catch (const timeout_error&) {
        if (clock::now() >= deadline) throw;
      } catch (const communication_error&) {
      }
    }
  }

  std::unique_ptr<state> s_;
};

}  // namespace ddp::net
