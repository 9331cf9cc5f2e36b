// net::ring, ddp's own TCP ring among node leaders (net/ring.hpp), on thread ranks of one
// process over real sockets: every dtype and operator at sizes around the segment, the same bits
// on every member, and its failures: a member that aborts, one that never calls, a stranger that
// connects to a listener first.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/net/ring.hpp>

#include "../common/collective_suite.hpp"
#include "../common/ranks.hpp"

namespace {

using namespace std::chrono_literals;

// Connects thread rank `c` into the ring; `seen` (if given) receives every member's record.
ddp::net::ring connect_ring(ddp::local::communicator& c, std::vector<ddp::net::ring_record>* seen = nullptr,
                            std::chrono::milliseconds timeout = 10s) {
  const auto allgather = [&](const ddp::net::ring_record& mine) {
    std::vector<ddp::net::ring_record> all(static_cast<std::size_t>(c.size()));
    ddp::net::ring_record in = mine;
    c.allgather(ddp::tensor_view{&in, sizeof in, ddp::dtype::u8},
                ddp::tensor_view{all.data(), sizeof mine * all.size(), ddp::dtype::u8})
        .wait();
    if (seen) *seen = all;
    return all;
  };
  return ddp::net::ring::connect(c.rank(), c.size(), allgather, "", ddp::net::clock::now() + timeout,
                                 {c.rank(), "test: connect"});
}

}  // namespace

TEST_CASE("net::ring: every dtype and operator on 2-4 members, the same bits on every member", "[net]") {
  for (int n : {2, 3, 4}) {
    test_ranks::on_ranks(n, [](ddp::local::communicator& c) {
      ddp::net::ring ring = connect_ring(c);
      SUITE_EXPECT(ring.index() == c.rank() && ring.count() == c.size(), "ring index and count");
      const std::size_t segment = ddp::net::ring::segment_bytes;
      for (ddp::dtype t : suite::all_dtypes()) {
        const std::size_t per_segment = segment / ddp::size_of(t);
        const std::size_t multi_segment = 2 * per_segment * static_cast<std::size_t>(c.size()) + 5;
        for (std::size_t count :
             {std::size_t{1}, std::size_t{7}, std::size_t(3 * c.size() + 1), per_segment + 13, multi_segment}) {
          for (ddp::reduce_op op : suite::all_ops()) {
            // Blocks of two segments and more (the segmenting is dtype- and operator-blind, the
            // kernels are checked by the smaller counts): f32 sum and avg, i64 max only, which
            // keeps the sanitizer builds' run short.
            const bool multi = (t == ddp::dtype::f32 && (op == ddp::reduce_op::sum || op == ddp::reduce_op::avg)) ||
                               (t == ddp::dtype::i64 && op == ddp::reduce_op::max);
            if (count == multi_segment && !multi) continue;
            suite::buffer b(t, count);
            for (std::size_t i = 0; i < count; ++i) b.set(i, suite::value(c.rank(), i));
            const std::string where = std::string(ddp::name_of(t)) + " " + std::string(ddp::name_of(op)) + " x " +
                                      std::to_string(count) + " on " + std::to_string(c.size());
            ring.allreduce(b.view(), op, ddp::net::clock::now() + 10s, {c.rank(), where});
            for (std::size_t i = 0; i < count; i += 1 + count / 97) {
              suite::expect_close(b.get(i), suite::expected_reduction(op, t, c.size(), i), t, where);
            }
            suite::expect_close(b.get(count - 1), suite::expected_reduction(op, t, c.size(), count - 1), t, where);
            suite::expect_same_bits_everywhere(c, b, where);
          }
        }
      }
    });
  }
}

TEST_CASE("net::ring: a member that aborts fails the others' allreduce, naming the neighbour, not a hang", "[net]") {
  test_ranks::on_ranks(3, [](ddp::local::communicator& c) {
    ddp::net::ring ring = connect_ring(c);
    std::vector<float> v(1 << 20, 1.0f);
    const auto start = ddp::net::clock::now();
    if (c.rank() == 1) {
      ring.abort();
      c.barrier().wait();
      return;
    }
    std::string got = "no exception";
    try {
      ring.allreduce(ddp::tensor_view{v.data(), v.size(), ddp::dtype::f32}, ddp::reduce_op::sum, start + 20s,
                     {c.rank(), "allreduce #7"});
    } catch (const ddp::communication_error& e) {
      got = e.what();
    }
    c.barrier().wait();
    SUITE_EXPECT(ddp::net::clock::now() - start < 10s, "the failure took the whole deadline");
    SUITE_EXPECT(got.find("rank " + std::to_string(c.rank())) != std::string::npos, got);
    SUITE_EXPECT(got.find("allreduce #7") != std::string::npos, got);
    SUITE_EXPECT(got.find("node leader") != std::string::npos, got);
    // Broken for good: the next call says so at once.
    std::string again = "no exception";
    try {
      ring.allreduce(ddp::tensor_view{v.data(), 4, ddp::dtype::f32}, ddp::reduce_op::sum, start + 20s,
                     {c.rank(), "allreduce #8"});
    } catch (const ddp::communication_error& e) {
      again = e.what();
    }
    SUITE_EXPECT(again.find("failed earlier or was aborted") != std::string::npos, again);
  });
}

TEST_CASE("net::ring: a member that never calls makes the others time out at their deadline", "[net]") {
  test_ranks::on_ranks(2, [](ddp::local::communicator& c) {
    ddp::net::ring ring = connect_ring(c);
    if (c.rank() == 1) {
      c.barrier().wait();
      return;
    }
    std::vector<float> v(1 << 22, 1.0f);  // 16 MiB: more than the sockets buffer
    const auto start = ddp::net::clock::now();
    std::string got = "no exception";
    try {
      ring.allreduce(ddp::tensor_view{v.data(), v.size(), ddp::dtype::f32}, ddp::reduce_op::sum, start + 500ms,
                     {c.rank(), "allreduce #3"});
    } catch (const ddp::timeout_error& e) {
      got = e.what();
    }
    const auto took = ddp::net::clock::now() - start;
    c.barrier().wait();
    SUITE_EXPECT(got.find("before the deadline") != std::string::npos && got.find("allreduce #3") != std::string::npos,
                 got);
    SUITE_EXPECT(took >= 450ms && took < 5s, "timed out after " << std::chrono::duration<double>(took).count() << " s");
  });
}

TEST_CASE("net::ring: a stranger that connects first is turned away; the ring still forms", "[net]") {
  std::atomic<bool> stranger_connected{false};
  test_ranks::on_ranks(2, [&](ddp::local::communicator& c) {
    // Rank 0 learns rank 1's port from the records, and before rank 0 dials, a stranger
    // connects to rank 1's listener and sends junk; rank 1 must skip it and accept rank 0.
    std::vector<ddp::net::ring_record> seen;
    const auto allgather = [&](const ddp::net::ring_record& mine) {
      std::vector<ddp::net::ring_record> all(2);
      ddp::net::ring_record in = mine;
      c.allgather(ddp::tensor_view{&in, sizeof in, ddp::dtype::u8},
                  ddp::tensor_view{all.data(), sizeof mine * 2, ddp::dtype::u8})
          .wait();
      if (c.rank() == 0) {
        const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        a.sin_port = htons(all[1].port);
        if (::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0) {
          const char junk[16] = "GET / HTTP/1.0";
          (void)!::send(fd, junk, sizeof junk, MSG_NOSIGNAL);
          stranger_connected = true;
        }
        ::close(fd);
      }
      return all;
    };
    ddp::net::ring ring =
        ddp::net::ring::connect(c.rank(), 2, allgather, "", ddp::net::clock::now() + 10s, {c.rank(), "test: connect"});
    std::vector<double> v(1000, c.rank() + 1.0);
    ring.allreduce(ddp::tensor_view{v.data(), v.size(), ddp::dtype::f64}, ddp::reduce_op::sum,
                   ddp::net::clock::now() + 10s, {c.rank(), "allreduce #1"});
    for (double x : v) SUITE_EXPECT(x == 3.0, "got " << x);
  });
  REQUIRE(stranger_connected);
}

TEST_CASE("net::ring: no address on the named interface is a clear error", "[net]") {
  test_ranks::on_ranks(2, [](ddp::local::communicator& c) {
    const auto allgather = [&](const ddp::net::ring_record& mine) {
      return std::vector<ddp::net::ring_record>(2, mine);
    };
    std::string got = "no exception";
    try {
      (void)ddp::net::ring::connect(c.rank(), 2, allgather, "no-such-if0", ddp::net::clock::now() + 1s,
                                    {c.rank(), "test: connect"});
    } catch (const ddp::communication_error& e) {
      got = e.what();
    }
    SUITE_EXPECT(got.find("no IPv4 address") != std::string::npos && got.find("no-such-if0") != std::string::npos, got);
  });
}
