// net::ring, ddp's own TCP ring among node leaders (net/ring.hpp), on thread ranks of one
// process over real sockets: every dtype and operator at sizes around the segment, the same bits
// on every member, and its failures: a member that aborts, one that never calls, strangers that
// connect to a listener first (silent, or sending garbage). Who may join (net/ring_handshake.hpp):
// members proving one job secret, a member with another secret, impostors that fail to prove it
// on either end of a connection, and the rule without a secret (one host: a warning; records
// from several hosts: refused unless every member sets insecure_no_secret).
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
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <thread>
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
  REQUIRE_NOTHROW(test_ranks::on_ranks(3, [&](ddp::local::communicator& c) {
    ddp::net::ring ring = connect_ring(c, secret, 10s, one_host_each);
    expect_sum_works(ring, c);
  }));
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
  }

  void run() {
    namespace nd = ddp::net::detail;
    const ddp::net::context ctx{1, "fake member"};
    try {
      const ddp::net::ring_record peer = member0.get_future().get();
      const std::uint64_t token = peer.token ^ record.token;
      const std::vector<ddp::detail::proof_nonce> nonces{peer.nonce, record.nonce};
      const auto binding = ddp::detail::communicator_binding("ddp net ring", "ring", 2, nonces);
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
    REQUIRE_NOTHROW(test_ranks::on_ranks(2, [&](ddp::local::communicator& c) {
      ddp::net::ring ring = connect_ring(c, {}, 10s, one_host_each, true);
      expect_sum_works(ring, c);
    }));
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
