// MPI-specific behaviour of ddp::mpi::communicator. Every rank runs every test case; a test
// that needs peers checks comm.size() itself.
#include <atomic>
#include <chrono>
#include <climits>
#include <cstddef>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/mpi.hpp>

using namespace std::chrono_literals;
using Catch::Matchers::Contains;

namespace {

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

ddp::mpi::thread_level provided_level() {
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  return static_cast<ddp::mpi::thread_level>(provided);
}

}  // namespace

TEST_CASE("mpi: an MPI error code becomes mpi_error with MPI's text, the rank and the operation", "[mpi][error]") {
  // A real error code: a broadcast from a root that does not exist, on a duplicate that returns
  // errors instead of aborting.
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
  int value = 0;
  const int rc = MPI_Bcast(&value, 1, MPI_INT, world_size() + 3, dup);
  MPI_Comm_free(&dup);
  REQUIRE(rc != MPI_SUCCESS);

  ddp::op_info info;
  info.rank = world_rank();
  info.name = "allreduce";
  info.seq = 12;
  info.type = ddp::dtype::f32;
  info.count = 1024;
  info.op = ddp::reduce_op::sum;
  try {
    ddp::mpi::detail::check(rc, info, "MPI_Bcast");
    FAIL("check() accepted an error code");
  } catch (const ddp::mpi::mpi_error& e) {
    const std::string what = e.what();
    CHECK(e.code() == rc);
    CHECK(e.rank() == world_rank());
    CHECK(e.operation() == "allreduce #12 (sum, f32 x 1024)");
    CHECK_THAT(what, Contains("rank " + std::to_string(world_rank())));
    CHECK_THAT(what, Contains("allreduce #12 (sum, f32 x 1024)"));
    CHECK_THAT(what, Contains("MPI_Bcast failed"));
    CHECK_THAT(what, Contains(ddp::mpi::error_string(rc)));
    CHECK(ddp::mpi::error_string(rc).size() > 0);
  }
  // It is a communication_error, so backend-agnostic handlers catch it.
  CHECK_THROWS_AS(ddp::mpi::detail::check(rc, info, "MPI_Bcast"), ddp::communication_error);
  CHECK_NOTHROW(ddp::mpi::detail::check(MPI_SUCCESS, info, "MPI_Bcast"));
}

TEST_CASE("mpi: host memory only; the error names the device, the rank and the operation", "[mpi][error]") {
  auto comm = ddp::mpi::communicator::world();
  std::vector<float> host(8);
  ddp::tensor_view gpu = ddp::view(host);
  gpu.where = ddp::device::cuda(1);
  try {
    (void)comm.allreduce(std::span<const ddp::tensor_view>(&gpu, 1), ddp::reduce_op::avg);
    FAIL("a CUDA tensor was accepted");
  } catch (const ddp::usage_error& e) {
    CHECK_THAT(std::string(e.what()), Contains("cuda:1"));
    CHECK_THAT(std::string(e.what()), Contains("rank " + std::to_string(comm.rank())));
    CHECK_THAT(e.operation(), Contains("allreduce #0 (avg, f32 x 8)"));
  }
  CHECK_THROWS_AS(comm.broadcast(host, comm.size()), ddp::usage_error);
  std::vector<double> wrong_type(8 * static_cast<std::size_t>(comm.size()));
  CHECK_THROWS_AS(comm.allgather(ddp::view(host), ddp::view(wrong_type)), ddp::usage_error);
  std::vector<float> out(host.size() * static_cast<std::size_t>(comm.size()));
  // An input inside the output, but not at this rank's block.
  const ddp::tensor_view shifted{out.data() + 1, host.size(), ddp::dtype::f32, ddp::device::host()};
  CHECK_THROWS_AS(comm.allgather(shifted, ddp::view(out)), ddp::usage_error);
  // Rejected calls consume no sequence number: the ranks stay in step.
  CHECK(comm.issued() == 0);
  comm.barrier().wait();
}

TEST_CASE("mpi: in-place allgather (input is this rank's block of the output)", "[mpi]") {
  auto comm = ddp::mpi::communicator::world();
  const std::size_t n = 5;
  std::vector<std::int64_t> out(n * static_cast<std::size_t>(comm.size()), -1);
  for (std::size_t i = 0; i < n; ++i)
    out[static_cast<std::size_t>(comm.rank()) * n + i] = comm.rank() * 10 + static_cast<int>(i);
  const ddp::tensor_view mine{out.data() + static_cast<std::size_t>(comm.rank()) * n, n, ddp::dtype::i64,
                              ddp::device::host()};
  comm.allgather(mine, ddp::view(out)).wait();
  for (int r = 0; r < comm.size(); ++r) {
    for (std::size_t i = 0; i < n; ++i) CHECK(out[static_cast<std::size_t>(r) * n + i] == r * 10 + static_cast<int>(i));
  }
}

TEST_CASE("mpi: abort fails pending work and forbids further use, without MPI_Abort", "[mpi][abort]") {
  auto comm = ddp::mpi::communicator::world({.timeout = 10s});
  std::vector<float> v(16, 1.0f);
  auto pending = comm.allreduce(v, ddp::reduce_op::sum);  // every rank issues it, then aborts
  comm.abort();
  comm.abort();  // idempotent
  try {
    pending.wait();
    FAIL("pending work completed after abort()");
  } catch (const ddp::communication_error& e) {
    CHECK_THAT(std::string(e.what()), Contains("aborted"));
    CHECK_THAT(e.operation(), Contains("allreduce #0"));
  }
  CHECK(pending.failed());
  try {
    (void)comm.allreduce(v, ddp::reduce_op::sum);
    FAIL("allreduce accepted after abort()");
  } catch (const ddp::usage_error& e) {
    CHECK_THAT(std::string(e.what()), Contains("used after abort()"));
  }
  CHECK_THROWS_AS(comm.barrier(), ddp::usage_error);
  CHECK_THROWS_AS(comm.broadcast(v, 0), ddp::usage_error);
  // MPI itself is fine: the program's own communication goes on.
  int one = 1;
  int sum = 0;
  MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  CHECK(sum == world_size());
}

TEST_CASE("mpi: after abort, work a peer never joins fails within one shared timeout", "[mpi][abort]") {
  // Through MPI_Iallreduce, whose leaked requests MPI itself completes when the peers join later
  // (ddp's own algorithms move only when tested: an aborted rank's part would never run).
  auto comm = ddp::mpi::communicator::world(
      {.timeout = 2s, .recursive_doubling_max_bytes = 0, .halving_doubling_max_bytes = 0});
  if (comm.size() < 2) return;
  // Deliberately never freed: rank 0's leaked requests complete when the peers join later.
  auto& bufs = *new std::vector<std::vector<float>>(3, std::vector<float>(8, 1.0f));
  if (comm.rank() == 0) {
    std::vector<ddp::work> pending;
    for (auto& b : bufs) pending.push_back(comm.allreduce(b, ddp::reduce_op::sum));
    comm.abort();
    const auto start = std::chrono::steady_clock::now();
    int failed = 0;
    for (auto& w : pending) {
      try {
        w.wait();
      } catch (const ddp::communication_error& e) {
        if (std::string(e.what()).find("aborted") != std::string::npos) ++failed;
      }
    }
    const auto took = std::chrono::steady_clock::now() - start;
    CHECK(failed == 3);
    CHECK(took < 4500ms);  // one timeout for all three (3 x 2 s would be 6 s); margin for a loaded machine
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (comm.rank() != 0) {
    for (auto& b : bufs) comm.allreduce(b, ddp::reduce_op::sum).wait();
    CHECK(bufs[2][0] == static_cast<float>(comm.size()));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("mpi: ddp traffic on its duplicate never mixes with the program's on MPI_COMM_WORLD", "[mpi][isolation]") {
  auto comm = ddp::mpi::communicator::world();
  int cmp = MPI_UNEQUAL;
  MPI_Comm_compare(comm.native_handle(), MPI_COMM_WORLD, &cmp);
  CHECK(cmp == MPI_CONGRUENT);  // same group, different context: a duplicate, not the same handle

  const int rank = comm.rank();
  const int size = comm.size();
  // A wildcard receive on MPI_COMM_WORLD would steal any ddp message sent on WORLD, including
  // the ring's point-to-point messages (which use ordinary tags).
  int user_msg = -1;
  MPI_Request user_recv = MPI_REQUEST_NULL;
  MPI_Irecv(&user_msg, 1, MPI_INT, MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &user_recv);

  std::vector<float> big(1 << 18);  // 1 MiB: goes through the ring
  std::vector<std::int32_t> small(3);
  std::vector<double> bcast(100);
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(rank + static_cast<int>(i % 5));
  for (auto& x : small) x = rank + 1;
  for (auto& x : bcast) x = rank == 0 ? 42.0 : -1.0;
  auto w1 = comm.allreduce(big, ddp::reduce_op::sum);
  auto w2 = comm.allreduce(small, ddp::reduce_op::max);
  auto w3 = comm.broadcast(bcast, 0);
  // The program's own collective on WORLD, interleaved with ddp's in flight.
  int mine = rank * 3;
  int total = 0;
  MPI_Allreduce(&mine, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  w3.wait();
  w1.wait();
  w2.wait();
  CHECK(total == 3 * size * (size - 1) / 2);

  int stolen = 0;
  MPI_Status status;
  MPI_Test(&user_recv, &stolen, &status);
  CHECK_FALSE(stolen);  // nothing of ddp's reached the program's wildcard receive
  if (stolen) FAIL("the wildcard receive got a message from rank " << status.MPI_SOURCE << " tag " << status.MPI_TAG);
  MPI_Barrier(MPI_COMM_WORLD);  // every rank checked before any rank sends its own message

  for (std::size_t i = 0; i < big.size(); i += 1013) {
    const float want = static_cast<float>(size * (size - 1) / 2 + size * static_cast<int>(i % 5));
    REQUIRE(big[i] == want);
  }
  for (auto x : small) CHECK(x == size);
  for (auto x : bcast) CHECK(x == 42.0);

  // The program's own message arrives intact.
  const int payload = 1000 + rank;
  MPI_Send(&payload, 1, MPI_INT, (rank + 1) % size, 77, MPI_COMM_WORLD);
  MPI_Wait(&user_recv, &status);
  CHECK(status.MPI_TAG == 77);
  CHECK(user_msg == 1000 + (rank + size - 1) % size);
}

TEST_CASE("mpi: environment over an MPI the program initialised itself", "[mpi][environment]") {
  {
    ddp::mpi::environment env;
    CHECK_FALSE(env.owns_mpi());
    CHECK(env.provided() == provided_level());
    auto comm = ddp::mpi::communicator::world();
    std::vector<std::int64_t> v{1};
    comm.allreduce(v, ddp::reduce_op::sum).wait();
    CHECK(v[0] == world_size());
  }
  // Leaving the scope did not finalize MPI.
  int finalized = 1;
  MPI_Finalized(&finalized);
  CHECK_FALSE(finalized);
  int initialized = 0;
  MPI_Initialized(&initialized);
  CHECK(initialized);
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("mpi: below MPI_THREAD_SERIALIZED, calls from another thread are refused", "[mpi][threads]") {
  auto comm = ddp::mpi::communicator::world({.max_thread_level = ddp::mpi::thread_level::funneled});
  CHECK(comm.threads() == std::min(provided_level(), ddp::mpi::thread_level::funneled));
  std::string message;
  std::thread other([&] {
    std::vector<float> v(4, 1.0f);
    try {
      (void)comm.allreduce(v, ddp::reduce_op::sum);
    } catch (const ddp::usage_error& e) {
      message = e.what();
    }
  });
  other.join();
  CHECK_THAT(message, Contains("MPI_THREAD_SERIALIZED"));
  CHECK_THAT(message, Contains("MPI_THREAD_FUNNELED"));
  CHECK_THAT(message, Contains("rank " + std::to_string(comm.rank())));
  // The refused call consumed nothing: the creating thread goes on in step with the peers.
  std::vector<float> v(4, 1.0f);
  comm.allreduce(v, ddp::reduce_op::sum).wait();
  CHECK(v[0] == static_cast<float>(comm.size()));
}

TEST_CASE("mpi: at MPI_THREAD_SERIALIZED, several threads may drive one communicator", "[mpi][threads]") {
  if (provided_level() < ddp::mpi::thread_level::serialized) {
    WARN("MPI provides less than MPI_THREAD_SERIALIZED; skipped");
    return;
  }
  auto comm = ddp::mpi::communicator::world({.max_thread_level = ddp::mpi::thread_level::serialized});
  CHECK(comm.threads() == ddp::mpi::thread_level::serialized);
  // Two threads issue in an agreed order (as every rank must), then wait concurrently: the
  // communicator's lock serialises their MPI_Test calls.
  constexpr int rounds = 50;
  std::vector<float> a(1000), b(300000);
  std::atomic<int> turn{0};
  std::atomic<int> bad{0};
  auto body = [&](int me, std::vector<float>& buf) {
    for (int round = 0; round < rounds; ++round) {
      std::fill(buf.begin(), buf.end(), 1.0f);
      while (turn.load() != 2 * round + me) std::this_thread::yield();
      auto w = comm.allreduce(buf, ddp::reduce_op::sum);
      turn.fetch_add(1);
      w.wait();
      if (buf.front() != static_cast<float>(comm.size()) || buf.back() != static_cast<float>(comm.size())) ++bad;
    }
  };
  std::thread t0(body, 0, std::ref(a));
  std::thread t1(body, 1, std::ref(b));
  t0.join();
  t1.join();
  CHECK(bad == 0);
  CHECK(comm.issued() == 2 * rounds);
}

TEST_CASE("mpi: a collective a peer never joins times out, naming it, and is leaked", "[mpi][timeout]") {
  // MPI_Iallreduce: MPI completes rank 0's leaked request when the peers join late (ddp's own
  // algorithms move only when tested).
  auto comm = ddp::mpi::communicator::world(
      {.timeout = 300ms, .recursive_doubling_max_bytes = 0, .halving_doubling_max_bytes = 0});
  if (comm.size() < 2) {
    // Alone, every collective completes at once.
    std::vector<float> v(3, 2.0f);
    comm.allreduce(v, ddp::reduce_op::avg).wait();
    CHECK(v[0] == 2.0f);
    return;
  }
  // Deliberately never freed: after the leak, MPI may still write rank 0's buffer.
  auto& v = *new std::vector<float>(3, 1.0f);
  if (comm.rank() == 0) {
    const auto start = std::chrono::steady_clock::now();
    try {
      comm.allreduce(v, ddp::reduce_op::sum).wait();
      FAIL("completed without the peers");
    } catch (const ddp::timeout_error& e) {
      CHECK_THAT(std::string(e.what()), Contains("allreduce #0 (sum, f32 x 3)"));
      CHECK_THAT(std::string(e.what()), Contains("300 ms"));
    }
    CHECK(std::chrono::steady_clock::now() - start < 5s);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (comm.rank() != 0) {
    // The peers join late; rank 0 progresses its leaked request inside the barrier below.
    comm.allreduce(v, ddp::reduce_op::sum).wait();
    CHECK(v[0] == static_cast<float>(comm.size()));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("mpi: a moved-from communicator refuses calls; options print and compare", "[mpi]") {
  auto a = ddp::mpi::communicator::world({.timeout = 7s});
  auto b = std::move(a);
  CHECK(b.options().timeout == 7s);
  CHECK_THROWS_AS(a.barrier(), ddp::usage_error);  // NOLINT(bugprone-use-after-move): the point of the test
  b.barrier().wait();

  // The ring's threshold grows with the number of peers; one rank never needs it.
  const std::size_t peers = static_cast<std::size_t>(b.size() - 1);
  CHECK(b.ring_threshold() == (peers ? b.options().ring_min_bytes * peers : ddp::mpi::options::never));
  CHECK(ddp::mpi::communicator::world({.ring_min_bytes = ddp::mpi::options::never}).ring_threshold() ==
        ddp::mpi::options::never);

  ddp::mpi::options o{.timeout = 2s, .ring_min_bytes = ddp::mpi::options::never};
  CHECK(o == ddp::mpi::options{.timeout = 2s, .ring_min_bytes = ddp::mpi::options::never});
  CHECK_FALSE(o == ddp::mpi::options{});
  std::ostringstream os;
  os << o;
  CHECK(os.str() ==
        "{timeout: 2000 ms, max_thread_level: provided, ring_min_bytes: never, recursive_doubling_max_bytes: 4096, "
        "halving_doubling_max_bytes: unbounded, ring_segment_bytes: 4194304}");
}

TEST_CASE("mpi: one selector maps a region's size and the rank count to its algorithm", "[mpi]") {
  using ddp::mpi::algorithm;
  constexpr ddp::mpi::allreduce_selector pick{};  // today's thresholds: 4 KiB, 4 KiB per peer, unbounded
  static_assert(pick(1, 2) == algorithm::recursive_doubling);
  CHECK(ddp::mpi::options{}.selector() == pick);
  CHECK(pick(100, 1) == algorithm::mpi_iallreduce);  // one rank: nothing to exchange
  CHECK(pick(std::size_t{1} << 30, 1) == algorithm::mpi_iallreduce);
  // 2 ranks: the ring starts where recursive doubling stops.
  CHECK(pick(4095, 2) == algorithm::recursive_doubling);
  CHECK(pick(4096, 2) == algorithm::ring);
  // 3 and 4 ranks: halving-doubling between them, the ring from 4 KiB per peer.
  CHECK(pick(4095, 3) == algorithm::recursive_doubling);
  CHECK(pick(4096, 3) == algorithm::halving_doubling);
  CHECK(pick(8191, 3) == algorithm::halving_doubling);
  CHECK(pick(8192, 3) == algorithm::ring);
  CHECK(pick(12287, 4) == algorithm::halving_doubling);
  CHECK(pick(12288, 4) == algorithm::ring);
  CHECK(pick.ring_threshold(4) == 12288);
  CHECK(pick.ring_threshold(1) == ddp::mpi::allreduce_selector::never);

  // The options' thresholds, as the tests set them.
  const auto mpi_only = ddp::mpi::options{.ring_min_bytes = ddp::mpi::options::never,
                                          .recursive_doubling_max_bytes = 0,
                                          .halving_doubling_max_bytes = 0}
                            .selector();
  CHECK(mpi_only(1, 4) == algorithm::mpi_iallreduce);
  CHECK(mpi_only(std::size_t{1} << 30, 4) == algorithm::mpi_iallreduce);
  const auto no_small =
      ddp::mpi::options{.recursive_doubling_max_bytes = 0, .halving_doubling_max_bytes = 0}.selector();
  CHECK(no_small(100, 4) == algorithm::mpi_iallreduce);
  CHECK(no_small(12288, 4) == algorithm::ring);
  CHECK(ddp::mpi::options{.ring_min_bytes = 0}.selector()(1, 2) == algorithm::ring);
  // Recursive doubling and halving-doubling send a region in one message: below INT_MAX bytes.
  const ddp::mpi::allreduce_selector no_ring{.ring_min_bytes = ddp::mpi::allreduce_selector::never,
                                             .recursive_doubling_max_bytes = std::size_t{1} << 30};
  CHECK(no_ring((std::size_t{1} << 30) - 1, 2) == algorithm::recursive_doubling);
  CHECK(no_ring(std::size_t{1} << 30, 2) == algorithm::halving_doubling);
  CHECK(no_ring(std::size_t{INT_MAX}, 2) == algorithm::mpi_iallreduce);
  // A threshold that overflows never triggers.
  CHECK(ddp::mpi::allreduce_selector{.ring_min_bytes = ddp::mpi::allreduce_selector::never / 2}.ring_threshold(4) ==
        ddp::mpi::allreduce_selector::never);

  auto comm = ddp::mpi::communicator::world();
  CHECK(comm.ring_threshold() == pick.ring_threshold(comm.size()));
  std::ostringstream os;
  os << algorithm::halving_doubling << ", " << algorithm::mpi_iallreduce;
  CHECK(os.str() == "halving-doubling, MPI_Iallreduce");
}

TEST_CASE("mpi: communicators are independent; destroying one with work in flight is safe", "[mpi]") {
  std::vector<double> v(70000, 1.0);  // ring-sized
  ddp::work w;
  {
    auto comm = ddp::mpi::communicator::world();
    auto other = ddp::mpi::communicator::world();
    w = comm.allreduce(v, ddp::reduce_op::avg);
    std::vector<double> s(4, 2.0);
    other.allreduce(s, ddp::reduce_op::sum).wait();
    CHECK(s[0] == 2.0 * other.size());
  }
  w.wait();  // the work keeps what it needs alive
  CHECK(v[0] == 1.0);
  CHECK(v.back() == 1.0);
}
