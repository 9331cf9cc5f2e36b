// net::ring, ddp's own TCP ring among node leaders (net/ring.hpp), on thread ranks of one
// process over real sockets: every dtype and operator at sizes around the segment, the same bits
// on every member, and its failures: a member that aborts, one that never calls, strangers that
// connect to a listener first (silent, or sending garbage; more than the acceptor keeps pending).
// Who may join (net/ring_handshake.hpp): members proving one job secret, a member with another
// secret, impostors that fail to prove it on either end of a connection, a relay on another
// address of the dialer's host (both ends refuse: the proofs bind the end point dialled), the
// addresses a ring across hosts never dials, the causes an unreachable neighbour's error names,
// and the rule without a secret (one host: a warning; records from several hosts: refused
// unless every member sets insecure_no_secret).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/detail/peer_proof.hpp>
#include <ddp/job_secret.hpp>
#include <ddp/net/ring.hpp>

#include "../common/collective_suite.hpp"
#include "../common/ranks.hpp"

namespace {

using namespace std::chrono_literals;
using records = std::vector<ddp::net::ring_record>;

// The ring's allgather over thread ranks; `edit` then changes the records alike on every member
// (e.g. to make them look as if they came from several hosts).
std::function<records(const ddp::net::ring_record&)> gather(ddp::local::communicator& c,
                                                            std::function<void(records&)> edit = {}) {
  return [&c, edit](const ddp::net::ring_record& mine) {
    records all(static_cast<std::size_t>(c.size()));
    ddp::net::ring_record in = mine;
    c.allgather(ddp::tensor_view{&in, sizeof in, ddp::dtype::u8},
                ddp::tensor_view{all.data(), sizeof mine * all.size(), ddp::dtype::u8})
        .wait();
    if (edit) edit(all);
    return all;
  };
}

// Connects thread rank `c` into the ring.
ddp::net::ring connect_ring(ddp::local::communicator& c, const ddp::job_secret& secret = {},
                            std::chrono::milliseconds timeout = 10s, std::function<void(records&)> edit = {},
                            bool insecure_no_secret = false) {
  return ddp::net::ring::connect(c.rank(), c.size(), gather(c, std::move(edit)), "", ddp::net::clock::now() + timeout,
                                 {c.rank(), "test: connect"}, secret, insecure_no_secret);
}

// Records edited to come from one host per member.
void one_host_each(records& all) {
  for (std::size_t i = 0; i < all.size(); ++i) {
    all[i].host = {};
    const std::string name = "host-" + std::to_string(i);
    std::memcpy(all[i].host.data(), name.data(), name.size());
  }
}

// A sum allreduce of rank + 1 on every member: the ring works.
void expect_sum_works(ddp::net::ring& ring, ddp::local::communicator& c) {
  std::vector<double> v(1000, c.rank() + 1.0);
  ring.allreduce(ddp::tensor_view{v.data(), v.size(), ddp::dtype::f64}, ddp::reduce_op::sum,
                 ddp::net::clock::now() + 10s, {c.rank(), "allreduce #1"});
  const double want = c.size() * (c.size() + 1) / 2.0;
  for (double x : v) SUITE_EXPECT(x == want, "got " << x << ", want " << want);
}

// A stranger's TCP connection to `rec`'s ring port at its first published address; -1 if none.
int connect_stranger(const ddp::net::ring_record& rec) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = rec.address[0];
  a.sin_port = htons(rec.port);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// This machine's addresses off loopback (the test places members on several hosts over them).
std::vector<ddp::net::ipv4> off_loopback() {
  std::vector<ddp::net::ipv4> out = ddp::net::local_addresses();
  std::erase_if(out, [](ddp::net::ipv4 a) { return ddp::net::detail::is_loopback(a); });
  if (out.size() > ddp::net::ring_record::max_addresses) out.resize(ddp::net::ring_record::max_addresses);
  return out;
}

// ring::connect's steps by hand (net/ring_handshake.hpp), listening on `addrs` and dialling as if
// this machine had no address of its own: members on one machine whose records (`edit`) place
// them on several hosts reach each other, as members on several hosts would. {left, right}.
std::pair<ddp::net::socket_fd, ddp::net::socket_fd> hand_ring(ddp::local::communicator& c,
                                                              const ddp::job_secret& secret,
                                                              const std::vector<ddp::net::ipv4>& addrs,
                                                              std::function<void(records&)> edit, bool insecure) {
  namespace nd = ddp::net::detail;
  const ddp::net::context ctx{c.rank(), "test: connect by hand"};
  const auto deadline = ddp::net::clock::now() + 10s;
  std::uint16_t port = 0;
  std::vector<ddp::net::socket_fd> listeners = ddp::net::listen_on(addrs, port, ctx);
  const records all = gather(c, std::move(edit))(nd::make_record(c.rank(), port, addrs, secret, insecure));
  const nd::ring_plan plan = nd::plan_ring(all, c.rank(), c.size(), secret, ctx);
  nd::drop_loopback_listeners(listeners, plan);
  const ddp::net::wakeup_pipe cancel(ctx);
  ddp::net::socket_fd left, right;
  std::exception_ptr accept_error;
  std::thread acceptor([&] {
    try {
      left = nd::answer(listeners, cancel, plan, deadline, ctx);
    } catch (...) {
      accept_error = std::current_exception();
    }
  });
  try {
    right = nd::dial(all[static_cast<std::size_t>((c.rank() + 1) % c.size())], plan, {}, deadline, ctx);
  } catch (...) {
    cancel.notify();
    acceptor.join();
    throw;
  }
  acceptor.join();
  if (accept_error) std::rethrow_exception(accept_error);
  return {std::move(left), std::move(right)};
}

// Each member sends its rank to the right and receives its left neighbour's.
void expect_ring_by_hand(ddp::local::communicator& c,
                         const std::pair<ddp::net::socket_fd, ddp::net::socket_fd>& links) {
  const ddp::net::context ctx{c.rank(), "test"};
  const int mine = c.rank();
  int theirs = -1;
  const auto until = ddp::net::clock::now() + 5s;
  ddp::net::send_all(links.second, &mine, sizeof mine, until, ctx, "right");
  ddp::net::recv_all(links.first, &theirs, sizeof theirs, until, ctx, "left");
  SUITE_EXPECT(theirs == (c.rank() + c.size() - 1) % c.size(), "received " << theirs);
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
        a.sin_addr.s_addr = all[1].address[0];  // the ring listens only where it publishes
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
    ddp::net::ring ring = ddp::net::ring::connect(c.rank(), 2, allgather, "", ddp::net::clock::now() + 10s,
                                                  {c.rank(), "test: connect"}, ddp::job_secret{});
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
                                    {c.rank(), "test: connect"}, ddp::job_secret{});
    } catch (const ddp::communication_error& e) {
      got = e.what();
    }
    SUITE_EXPECT(got.find("no IPv4 address") != std::string::npos && got.find("no-such-if0") != std::string::npos, got);
  });
}

TEST_CASE("net::ring: strangers that connect first and stay silent or send garbage neither stall nor break set-up",
          "[net]") {
  for (const bool with_secret : {false, true}) {
    INFO((with_secret ? "with a job secret" : "without a secret"));
    const ddp::job_secret secret = with_secret ? ddp::job_secret::generate() : ddp::job_secret{};
    std::mutex m;
    std::vector<int> strangers;
    std::atomic<int> connected{0};
    REQUIRE_NOTHROW(test_ranks::on_ranks(3, [&](ddp::local::communicator& c) {
      // Before this member dials its right neighbour, strangers connect to that neighbour's
      // port: four that stay silent, one that sends a few bytes and stays, one that sends more
      // than a greeting of garbage, one that greets as the neighbour's left with a wrong token.
      const auto edit = [&](records& all) {
        const auto& right = all[static_cast<std::size_t>((c.rank() + 1) % c.size())];
        std::vector<int> mine;
        for (int k = 0; k < 7; ++k) {
          const int fd = connect_stranger(right);
          if (fd < 0) continue;
          ++connected;
          if (k == 4) {
            const char junk[16] = "GET / HTTP/1.0\r";
            (void)!::send(fd, junk, sizeof junk, MSG_NOSIGNAL);
          } else if (k == 5) {
            const std::vector<unsigned char> junk(200, 0xff);
            (void)!::send(fd, junk.data(), junk.size(), MSG_NOSIGNAL);
          } else if (k == 6) {
            ddp::net::detail::ring_hello h;
            h.index = static_cast<std::uint32_t>(c.rank());
            h.token = 42;
            (void)!::send(fd, &h, sizeof h, MSG_NOSIGNAL);
          }
          mine.push_back(fd);
        }
        std::lock_guard<std::mutex> lock(m);
        strangers.insert(strangers.end(), mine.begin(), mine.end());
      };
      const auto start = ddp::net::clock::now();
      ddp::net::ring ring = connect_ring(c, secret, 10s, edit);
      const auto took = ddp::net::clock::now() - start;
      // One silent stranger held for its greeting_timeout (2 s) would show here.
      SUITE_EXPECT(took < ddp::net::detail::greeting_timeout,
                   "set-up took " << std::chrono::duration<double>(took).count() << " s");
      expect_sum_works(ring, c);
    }));
    REQUIRE(connected == 3 * 7);
    // No stranger got a byte: they were dropped (or never answered) without a greeting.
    for (int fd : strangers) {
      pollfd p{fd, POLLIN, 0};
      (void)::poll(&p, 1, 200);
      char byte = 0;
      CHECK(::recv(fd, &byte, 1, MSG_DONTWAIT) <= 0);
      ::close(fd);
    }
  }
}

TEST_CASE("net::ring: members that prove one job secret form the ring across hosts", "[net]") {
  const ddp::job_secret secret = ddp::job_secret::generate();
  const std::vector<ddp::net::ipv4> addrs = off_loopback();
  if (addrs.empty()) {
    WARN("no address off loopback: not run");
    return;
  }
  REQUIRE_NOTHROW(test_ranks::on_ranks(3, [&](ddp::local::communicator& c) {
    expect_ring_by_hand(c, hand_ring(c, secret, addrs, one_host_each, false));
  }));
}

TEST_CASE("net::ring: a ring across hosts dials neither loopback nor an address of the dialer's own host", "[net]") {
  namespace nd = ddp::net::detail;
  const auto ip = [](unsigned a, unsigned b, unsigned c, unsigned d) {
    return ddp::net::ipv4{htonl((a << 24) | (b << 16) | (c << 8) | d)};
  };
  ddp::net::ring_record peer;
  peer.index = 1;
  for (ddp::net::ipv4 a : {ip(127, 0, 0, 1), ip(172, 17, 0, 1), ip(10, 1, 2, 3), ip(192, 0, 2, 9)}) {
    peer.address[peer.addresses++] = a.addr;
  }
  const std::vector<ddp::net::ipv4> own{ip(172, 17, 0, 1), ip(192, 0, 2, 2), ip(127, 0, 0, 1)};
  const auto strs = [](const std::vector<ddp::net::ipv4>& v) {
    std::vector<std::string> out;
    for (ddp::net::ipv4 a : v) out.push_back(a.str());
    return out;
  };
  nd::ring_plan plan;
  SECTION("the records place the members on several hosts: only the others' addresses, its subnets first") {
    plan.one_host = false;
    std::string skipped;
    CHECK(strs(nd::dial_candidates(peer, plan, own, skipped)) == std::vector<std::string>{"192.0.2.9", "10.1.2.3"});
    CHECK(skipped == "127.0.0.1 (loopback), 172.17.0.1 (this host's)");
  }
  SECTION("one host: every address, its subnets first, loopback after them") {
    plan.one_host = true;
    std::string skipped;
    CHECK(strs(nd::dial_candidates(peer, plan, own, skipped)) ==
          std::vector<std::string>{"172.17.0.1", "192.0.2.9", "127.0.0.1", "10.1.2.3"});
    CHECK(skipped.empty());
  }
  SECTION("ring::connect with records of several hosts on this one machine: a clean error naming what it skipped") {
    std::vector<std::string> got(2, "no exception");
    const auto start = ddp::net::clock::now();
    test_ranks::on_ranks(2, [&](ddp::local::communicator& c) {
      try {
        (void)connect_ring(c, ddp::job_secret::generate(), 5s, one_host_each);
      } catch (const ddp::communication_error& e) {
        got[static_cast<std::size_t>(c.rank())] = e.what();
      }
    });
    CHECK(ddp::net::clock::now() - start < 3s);  // no dial waits: each fails at once, the acceptors soon after
    for (int r : {0, 1}) {
      const std::string& e = got[static_cast<std::size_t>(r)];
      INFO(e);
      CHECK(contains(e, "could not connect to node leader " + std::to_string(1 - r) + " (right in the ring)"));
      CHECK(contains(e, "it publishes no address this leader may dial"));
      CHECK(contains(e, "127.0.0.1 (loopback)"));
    }
  }
}

TEST_CASE("net::ring: a member with another job secret is a clean error naming the neighbour on every side", "[net]") {
  const ddp::job_secret ours = ddp::job_secret::generate(), theirs = ddp::job_secret::generate();
  SECTION("two members, two secrets: each one's right neighbour refuses its proof, at once") {
    std::vector<std::string> got(2, "no exception");
    const auto start = ddp::net::clock::now();
    test_ranks::on_ranks(2, [&](ddp::local::communicator& c) {
      try {
        (void)connect_ring(c, c.rank() == 0 ? ours : theirs, 10s);
      } catch (const ddp::communication_error& e) {
        got[static_cast<std::size_t>(c.rank())] = e.what();
      }
    });
    CHECK(ddp::net::clock::now() - start < 5s);
    for (int r : {0, 1}) {
      const std::string& e = got[static_cast<std::size_t>(r)];
      INFO(e);
      CHECK(contains(e, "rank " + std::to_string(r) + ", test: connect"));
      CHECK(contains(e, "node leader " + std::to_string(1 - r) + " (right in the ring)"));
      CHECK(contains(e, "refused this leader's proof of the job secret"));
    }
  }
  SECTION("three members, member 2 with another secret: both its neighbours and itself fail, naming whom") {
    std::vector<std::string> got(3, "no exception");
    test_ranks::on_ranks(3, [&](ddp::local::communicator& c) {
      try {
        (void)connect_ring(c, c.rank() == 2 ? theirs : ours, 3s);
      } catch (const ddp::communication_error& e) {
        got[static_cast<std::size_t>(c.rank())] = e.what();
      }
    });
    INFO(got[0] << "\n" << got[1] << "\n" << got[2]);
    // Member 0 accepted from member 1 but waited in vain for a left neighbour that proves it.
    CHECK(contains(got[0], "node leader 2 (left in the ring) did not prove the job secret"));
    CHECK(contains(got[1], "node leader 2 (right in the ring)"));
    CHECK(contains(got[1], "refused this leader's proof"));
    CHECK(contains(got[2], "node leader 0 (right in the ring)"));
    CHECK(contains(got[2], "refused this leader's proof"));
  }
}

namespace {

// Member 1 of a 2-member ring played by the test with `secret`, member 0 being a real
// ring::connect on loopback ("lo"): an impostor that answers member 0's dial with a wrong
// proof (`wrong_acceptor`), or that dials member 0 first with a wrong proof and then answers
// member 0's dial honestly.
struct fake_member {
  const ddp::job_secret& secret;
  bool wrong_acceptor = false;
  ddp::net::ring_record record;
  std::vector<ddp::net::socket_fd> listener;
  std::promise<ddp::net::ring_record> member0;  // member 0's record, from the allgather
  // What the impostor saw: member 0's dialer proof was right; member 0's verdict on the
  // impostor's dialer proof was a refusal carrying no proof; then member 0 closed.
  bool dialer_proof_right = false, refused_without_proof = false, closed_after = false;
  std::string error;

  explicit fake_member(const ddp::job_secret& s, bool wrong) : secret(s), wrong_acceptor(wrong) {
    const ddp::net::context ctx{1, "fake member"};
    listener = ddp::net::listen_on({ddp::net::ipv4{htonl(INADDR_LOOPBACK)}}, record.port, ctx);
    record.index = 1;
    record.token = 0x1234;
    record.addresses = 1;
    record.address[0] = htonl(INADDR_LOOPBACK);
    record.nonce = ddp::detail::fresh_nonce();
    record.flags = ddp::net::ring_record::has_secret;
    // Member 0's host and addresses ("lo": 127.0.0.1), so that the ring is on one host and
    // member 0 dials loopback.
    if (::gethostname(record.host.data(), record.host.size() - 1) != 0) record.host[0] = '\0';
  }

  void run() {
    namespace nd = ddp::net::detail;
    const ddp::net::context ctx{1, "fake member"};
    try {
      const ddp::net::ring_record peer = member0.get_future().get();
      const std::uint64_t token = peer.token ^ record.token;
      const std::vector<ddp::detail::proof_nonce> nonces{peer.nonce, record.nonce};
      // This connection's binding: the ring's and the end point member 0 dials (this listener).
      const auto binding = nd::connection_binding(ddp::detail::communicator_binding("ddp net ring", "ring", 2, nonces),
                                                  ddp::net::ipv4{htonl(INADDR_LOOPBACK)}, record.port);
      const auto until = ddp::net::clock::now() + 5s;
      if (!wrong_acceptor) {  // dial member 0 (member 1's right) and send a wrong proof
        ddp::net::socket_fd s = ddp::net::connect_to({peer.address[0]}, peer.port, until);
        const nd::ring_hello h{ddp::net::ring_record::magic_value, 1, token, ddp::detail::fresh_nonce()};
        ddp::net::send_all(s, &h, sizeof h, until, ctx, "member 0");
        nd::ring_hello back{};
        ddp::net::recv_all(s, &back, sizeof back, until, ctx, "member 0");
        ddp::detail::sha256_digest garbage{};
        garbage.fill(std::byte{0x5a});
        ddp::net::send_all(s, garbage.data(), garbage.size(), until, ctx, "member 0");
        nd::ring_verdict v{};
        ddp::net::recv_all(s, &v, sizeof v, until, ctx, "member 0");
        refused_without_proof =
            v.magic == ddp::net::ring_record::magic_value && v.outcome == nd::ring_verdict::refused &&
            std::all_of(v.proof.begin(), v.proof.end(), [](std::byte b) { return b == std::byte{0}; });
        char more = 0;
        try {
          ddp::net::recv_all(s, &more, 1, until, ctx, "member 0");
        } catch (const ddp::communication_error&) {
          closed_after = true;
        }
      }
      // Answer member 0's dial: greet, check its proof, answer with a right or a wrong one.
      ddp::net::socket_fd s = ddp::net::accept_one(listener[0], until, ctx, "member 0");
      nd::ring_hello h{};
      ddp::net::recv_all(s, &h, sizeof h, until, ctx, "member 0");
      const nd::ring_hello back{ddp::net::ring_record::magic_value, 1, token, ddp::detail::fresh_nonce()};
      ddp::net::send_all(s, &back, sizeof back, until, ctx, "member 0");
      ddp::detail::sha256_digest proof{};
      ddp::net::recv_all(s, proof.data(), proof.size(), until, ctx, "member 0");
      dialer_proof_right = proof == ddp::detail::peer_proof(secret, binding, 0, 1, h.nonce, back.nonce);
      nd::ring_verdict v{};
      v.outcome = nd::ring_verdict::accepted;
      v.proof = ddp::detail::peer_proof(secret, binding, 1, 0, back.nonce, h.nonce);
      if (wrong_acceptor) v.proof[0] ^= std::byte{1};
      ddp::net::send_all(s, &v, sizeof v, until, ctx, "member 0");
      char more = 0;  // until member 0 closes
      try {
        ddp::net::recv_all(s, &more, 1, until, ctx, "member 0");
      } catch (const ddp::communication_error&) {
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
};

// Runs member 0 against `fake`; what member 0 threw.
std::string member0_against(fake_member& fake, const ddp::job_secret& secret) {
  std::thread t([&] { fake.run(); });
  std::string got = "no exception";
  const auto allgather = [&](const ddp::net::ring_record& mine) {
    fake.member0.set_value(mine);
    return records{mine, fake.record};
  };
  try {
    (void)ddp::net::ring::connect(0, 2, allgather, "lo", ddp::net::clock::now() + 3s, {0, "test: connect"}, secret);
  } catch (const ddp::communication_error& e) {
    got = e.what();
  }
  t.join();
  return got;
}

}  // namespace

TEST_CASE("net::ring: an impostor that cannot prove the secret is refused on either end of a connection", "[net]") {
  const ddp::job_secret secret = ddp::job_secret::generate();
  SECTION("it answers the dial with a wrong proof: the dialer fails at once, naming its right neighbour") {
    fake_member fake(secret, true);
    const auto start = ddp::net::clock::now();
    const std::string got = member0_against(fake, secret);
    INFO(got << "\nfake: " << fake.error);
    CHECK(fake.error.empty());
    CHECK(fake.dialer_proof_right);
    CHECK(contains(got, "node leader 1 (right in the ring) at 127.0.0.1:"));
    CHECK(contains(got, "did not prove the job secret"));
    CHECK(ddp::net::clock::now() - start < 2500ms);
  }
  SECTION(
      "it dials with a wrong proof: refused with no proof in return; at the deadline, an error naming the left "
      "neighbour") {
    fake_member fake(secret, false);
    const std::string got = member0_against(fake, secret);
    INFO(got << "\nfake: " << fake.error);
    CHECK(fake.error.empty());
    CHECK(fake.refused_without_proof);
    CHECK(fake.closed_after);
    CHECK(fake.dialer_proof_right);
    CHECK(contains(got, "node leader 1 (left in the ring) did not prove the job secret"));
  }
}

TEST_CASE("net::ring: without a secret, records from several hosts refuse to start unless every member allows it",
          "[net]") {
  const auto refusals = [](int n, const std::function<void(records&)>& edit, std::vector<bool> insecure,
                           std::vector<bool> with_secret) {
    const ddp::job_secret secret = ddp::job_secret::generate();
    std::vector<std::string> got(static_cast<std::size_t>(n));
    test_ranks::on_ranks(n, [&](ddp::local::communicator& c) {
      const auto r = static_cast<std::size_t>(c.rank());
      try {
        (void)connect_ring(c, with_secret[r] ? secret : ddp::job_secret{}, 10s, edit, insecure[r]);
      } catch (const ddp::usage_error& e) {
        got[r] = e.what();
      }
    });
    return got;
  };
  const auto other_address = [](records& all) {              // one more address published by member 1
    all[1].address[all[1].addresses++] = htonl(0xc6336407);  // 198.51.100.7
  };
  SECTION("another host name, or other addresses: refused on every member, saying how to set a secret") {
    for (const auto& edit :
         {std::function<void(records&)>(one_host_each), std::function<void(records&)>(other_address)}) {
      for (const std::string& e : refusals(2, edit, {false, false}, {false, false})) {
        INFO(e);
        CHECK(contains(e, "spans hosts"));
        CHECK(contains(e, "has no job secret"));
        CHECK(contains(e, "DDP_JOB_SECRET"));
        CHECK(contains(e, ddp::job_secret::how_to_make));
        CHECK(contains(e, "insecure_no_secret"));
      }
    }
  }
  SECTION("insecure_no_secret on one member only: still refused on every member, naming the other") {
    for (const std::string& e : refusals(2, one_host_each, {true, false}, {false, false})) {
      INFO(e);
      CHECK(contains(e, "spans hosts"));
      CHECK(contains(e, "node leader 1 did not set it"));
    }
  }
  SECTION("a secret on some members only: refused on every member, naming those without") {
    for (const std::string& e : refusals(3, {}, {false, false, false}, {true, false, true})) {
      INFO(e);
      CHECK(contains(e, "node leader 1 has none and the others have one"));
    }
  }
  SECTION("insecure_no_secret on every member: the ring forms across hosts") {
    const std::vector<ddp::net::ipv4> addrs = off_loopback();
    if (addrs.empty()) {
      WARN("no address off loopback: not run");
      return;
    }
    REQUIRE_NOTHROW(test_ranks::on_ranks(
        2, [&](ddp::local::communicator& c) { expect_ring_by_hand(c, hand_ring(c, {}, addrs, one_host_each, true)); }));
  }
}

TEST_CASE("net::ring: without a secret on one host, member 0 says once on stderr that the ring is not authenticated",
          "[net]") {
  std::FILE* capture = std::tmpfile();
  REQUIRE(capture != nullptr);
  std::fflush(stderr);
  const int saved = ::dup(2);
  ::dup2(::fileno(capture), 2);
  std::string failure;
  try {
    test_ranks::on_ranks(3, [&](ddp::local::communicator& c) {
      ddp::net::ring ring = connect_ring(c);
      expect_sum_works(ring, c);
    });
  } catch (const std::exception& e) {
    failure = e.what();
  }
  std::fflush(stderr);
  ::dup2(saved, 2);
  ::close(saved);
  std::rewind(capture);
  std::string text;
  char buf[512];
  while (std::fgets(buf, sizeof buf, capture)) text += buf;
  std::fclose(capture);
  INFO(text);
  REQUIRE(failure.empty());
  CHECK(std::count(text.begin(), text.end(), '\n') == 1);
  CHECK(contains(text, "not authenticated"));
  CHECK(contains(text, "DDP_JOB_SECRET"));
}

namespace {

// A process of the dialer's host that listens on another address at the neighbour's port and
// forwards the first connection to the neighbour's real address, both ways, counting the bytes.
struct relay {
  ddp::net::socket_fd listener;
  ddp::net::ipv4 to;
  std::uint16_t port = 0;
  std::atomic<std::size_t> from_dialer{0}, from_acceptor{0};
  std::string error;
  std::thread thread;

  relay(ddp::net::ipv4 at, ddp::net::ipv4 target, std::uint16_t p) : to(target), port(p) {
    listener = ddp::net::socket_fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = at.addr;
    a.sin_port = htons(port);
    if (::bind(listener.get(), reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0 ||
        ::listen(listener.get(), 4) != 0) {
      error = "relay: bind " + at.str() + ":" + std::to_string(port) + ": " + std::strerror(errno);
      return;
    }
    thread = std::thread([this] { run(); });
  }
  relay(const relay&) = delete;
  relay& operator=(const relay&) = delete;
  ~relay() {
    if (thread.joinable()) thread.join();
  }

  void run() {
    const ddp::net::context ctx{-1, "relay"};
    const auto until = ddp::net::clock::now() + 8s;
    try {
      ddp::net::socket_fd in = ddp::net::accept_one(listener, until, ctx, "the dialer");
      ddp::net::socket_fd out = ddp::net::connect_to(to, port, until);
      if (!out) throw std::runtime_error("relay: cannot reach " + to.str());
      for (;;) {
        pollfd p[2] = {{in.get(), POLLIN, 0}, {out.get(), POLLIN, 0}};
        if (::poll(p, 2, ddp::net::detail::remaining_ms(until)) <= 0) return;
        for (int k = 0; k < 2; ++k) {
          if (p[k].revents == 0) continue;
          char buf[4096];
          const ssize_t n = ::recv(p[k].fd, buf, sizeof buf, 0);
          if (n <= 0) return;  // one side closed: both close here
          ddp::net::send_all(k == 0 ? out : in, buf, static_cast<std::size_t>(n), until, ctx, "relay");
          (k == 0 ? from_dialer : from_acceptor) += static_cast<std::size_t>(n);
        }
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
};

}  // namespace

TEST_CASE("net::ring: a relay on another address of the dialer's host is refused by both ends", "[net]") {
  // The dialer tries the neighbour's addresses in turn; a process of its host that listens at the
  // neighbour's port on one it tries first (here 127.0.0.2, which every record lists before
  // 127.0.0.1, so the ring stays on one host) forwards the connection to the real neighbour. It
  // echoes the hello with the right token; the proofs name the end point as each side sees it
  // (127.0.0.2 dialled, 127.0.0.1 accepted), so the acceptor refuses the dialer's proof and the
  // dialer reports that refusal, at that address, instead of trying 127.0.0.1.
  const ddp::job_secret secret = ddp::job_secret::generate();
  const ddp::net::ipv4 other{htonl(0x7f000002)}, loopback{htonl(INADDR_LOOPBACK)};
  std::unique_ptr<relay> r;
  std::vector<std::string> got(2, "no exception");
  const auto start = ddp::net::clock::now();
  test_ranks::on_ranks(2, [&](ddp::local::communicator& c) {
    const auto edit = [&](records& all) {
      for (auto& rec : all) {
        std::copy_backward(rec.address.begin(), rec.address.begin() + rec.addresses,
                           rec.address.begin() + rec.addresses + 1);
        rec.address[0] = other.addr;
        ++rec.addresses;
      }
      if (c.rank() == 0) r = std::make_unique<relay>(other, loopback, all[1].port);  // before member 0 dials
    };
    try {
      (void)ddp::net::ring::connect(c.rank(), 2, gather(c, edit), "lo", ddp::net::clock::now() + 3s,
                                    {c.rank(), "test: connect"}, secret);
    } catch (const ddp::communication_error& e) {
      got[static_cast<std::size_t>(c.rank())] = e.what();
    }
  });
  REQUIRE(r);
  if (r->thread.joinable()) r->thread.join();
  INFO(got[0] << "\n" << got[1] << "\nrelay: " << r->error);
  CHECK(r->error.empty());
  // The relay carried the handshake both ways: the hellos, the dialer's proof, the verdict.
  namespace nd = ddp::net::detail;
  CHECK(r->from_dialer == sizeof(nd::ring_hello) + sizeof(ddp::detail::sha256_digest));
  CHECK(r->from_acceptor == sizeof(nd::ring_hello) + sizeof(nd::ring_verdict));
  CHECK(contains(got[0], "node leader 1 (right in the ring) at 127.0.0.2:"));
  CHECK(contains(got[0], "refused this leader's proof of the job secret"));
  CHECK_FALSE(contains(got[0], "could not connect"));
  CHECK(contains(got[1], "node leader 0 (left in the ring) did not prove the job secret"));
  CHECK(ddp::net::clock::now() - start < 6s);
}

TEST_CASE("net::ring: a flood of strangers evicts them before a connection that greeted as the neighbour", "[net]") {
  // The acceptor (member 1 of 2) keeps 64 connections pending at most. The left neighbour greets,
  // then 80 strangers connect and stay silent before it sends its proof: the strangers go first,
  // and the neighbour's handshake completes.
  namespace nd = ddp::net::detail;
  const ddp::job_secret secret = ddp::job_secret::generate();
  const ddp::net::context ctx{1, "test: accept"};
  const ddp::net::ipv4 loopback{htonl(INADDR_LOOPBACK)};
  std::uint16_t port = 0;
  const std::vector<ddp::net::socket_fd> listeners = ddp::net::listen_on({loopback}, port, ctx);
  nd::ring_plan plan;
  plan.token = 0x5eed;
  plan.authenticated = true;
  plan.binding = ddp::detail::communicator_binding("test", "ring", 2, std::vector<ddp::detail::proof_nonce>(2));
  plan.secret = &secret;
  plan.index = 1;
  plan.count = 2;
  const ddp::net::wakeup_pipe cancel(ctx);
  ddp::net::socket_fd won;
  std::string accept_error;
  std::thread acceptor([&] {
    try {
      won = nd::answer(listeners, cancel, plan, ddp::net::clock::now() + 5s, ctx);
    } catch (const std::exception& e) {
      accept_error = e.what();
    }
  });
  const auto until = ddp::net::clock::now() + 4s;
  const ddp::net::context dctx{0, "test: dial"};
  ddp::net::socket_fd s = ddp::net::connect_to(loopback, port, until);
  REQUIRE(s);
  const nd::ring_hello h{ddp::net::ring_record::magic_value, 0, plan.token, ddp::detail::fresh_nonce()};
  nd::ring_hello back{};
  ddp::net::send_all(s, &h, sizeof h, until, dctx, "member 1");
  ddp::net::recv_all(s, &back, sizeof back, until, dctx, "member 1");
  std::vector<ddp::net::socket_fd> strangers;
  for (int k = 0; k < 80; ++k) {
    strangers.push_back(ddp::net::connect_to(loopback, port, until));
    if (k % 10 == 9) std::this_thread::sleep_for(20ms);  // within the listen backlog
  }
  std::this_thread::sleep_for(200ms);  // all accepted by now
  const auto binding = nd::connection_binding(plan.binding, loopback, port);
  const auto proof = ddp::detail::peer_proof(secret, binding, 0, 1, h.nonce, back.nonce);
  nd::ring_verdict v{};
  std::string dial_error;
  try {
    ddp::net::send_all(s, proof.data(), proof.size(), until, dctx, "member 1");
    ddp::net::recv_all(s, &v, sizeof v, until, dctx, "member 1");
  } catch (const std::exception& e) {
    dial_error = e.what();
  }
  acceptor.join();
  INFO(dial_error << "\n" << accept_error);
  CHECK(std::all_of(strangers.begin(), strangers.end(), [](const ddp::net::socket_fd& f) { return bool(f); }));
  CHECK(dial_error.empty());
  CHECK(accept_error.empty());
  CHECK(won);
  CHECK(v.outcome == nd::ring_verdict::accepted);
  CHECK(v.proof == ddp::detail::peer_proof(secret, binding, 1, 0, back.nonce, h.nonce));
}

TEST_CASE("net::ring: a neighbour that no address reaches fails soon, naming each address and why", "[net]") {
  // Every record says member 1 listens on a port where nothing does: member 0 is refused at each
  // address, gives each up after a few tries (not after seconds), and says so per address.
  std::uint16_t closed = 0;
  {
    std::vector<ddp::net::socket_fd> l =
        ddp::net::listen_on({ddp::net::ipv4{htonl(INADDR_LOOPBACK)}}, closed, {-1, "test"});
  }
  std::string got = "no exception";
  std::chrono::steady_clock::duration took{};
  test_ranks::on_ranks(2, [&](ddp::local::communicator& c) {
    const auto start = ddp::net::clock::now();
    try {
      (void)connect_ring(c, ddp::job_secret::generate(), 3s, [&](records& all) { all[1].port = closed; });
    } catch (const ddp::error& e) {
      if (c.rank() == 0) {
        got = e.what();
        took = ddp::net::clock::now() - start;
      }
    }
  });
  INFO(got);
  CHECK(contains(got, "could not connect to node leader 1 (right in the ring) at any of its addresses (tried "));
  CHECK(contains(got, "127.0.0.1:" + std::to_string(closed) + ": " + std::strerror(ECONNREFUSED)));
  CHECK(took < 1s);
}
