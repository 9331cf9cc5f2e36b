// The POSIX segment's lifetime and the checks of what peers wrote (issue #27): a set-up that
// fails or times out at any of its exchanges leaves no name in /dev/shm, nor does a SIGKILL after
// set-up; a segment another user owns (or others may access) is refused; a malformed set-up
// record and a chunk descriptor pointing outside its rank's memory are errors naming the peer.
// Ranks are threads of this process (local backend), so every name this test can create starts
// with "ddp-shm-<this pid in hex>-".
#include <catch2/catch.hpp>
#include <ddp/local.hpp>
#include <ddp/shm.hpp>

#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "../common/other_user.hpp"

namespace {

using namespace std::chrono_literals;
namespace shm = ddp::shm;

// Names in /dev/shm that a set-up of process `pid` created.
std::vector<std::string> segments_of(pid_t pid) {
  char prefix[64];
  std::snprintf(prefix, sizeof prefix, "ddp-shm-%lx-", static_cast<unsigned long>(pid));
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
    const std::string n = e.path().filename().string();
    if (n.rfind(prefix, 0) == 0) out.push_back(n);
  }
  return out;
}

// Forwards to a local rank; at its allgather number `give_up_at` (1-based; 0: never) it first
// sleeps `stall`, then throws, as a rank that dies or hangs in set-up would.
class flaky {
 public:
  flaky(ddp::communicator_ref inner, int give_up_at, std::chrono::milliseconds stall)
      : inner_(inner), give_up_at_(give_up_at), stall_(stall) {}
  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  ddp::work allreduce(std::span<const ddp::tensor_view> ts, ddp::reduce_op op) { return inner_.allreduce(ts, op); }
  ddp::work broadcast(std::span<const ddp::tensor_view> ts, int root) { return inner_.broadcast(ts, root); }
  ddp::work allgather(ddp::tensor_view in, ddp::tensor_view out) {
    if (++calls_ == give_up_at_) {
      std::this_thread::sleep_for(stall_);
      throw ddp::communication_error(rank(), "test", "this rank gives up at allgather " + std::to_string(calls_));
    }
    return inner_.allgather(in, out);
  }
  ddp::work reduce_scatter(ddp::tensor_view in, ddp::tensor_view out, ddp::reduce_op op) {
    return inner_.reduce_scatter(in, out, op);
  }
  ddp::work barrier() { return inner_.barrier(); }
  void abort() noexcept { inner_.abort(); }

 private:
  ddp::communicator_ref inner_;
  int give_up_at_;
  std::chrono::milliseconds stall_;
  int calls_ = 0;
};

struct outcome {
  bool threw = false;
  std::string what;
  std::vector<std::string> left;  // names in /dev/shm right after this rank's set-up returned
};

// Set-up of one 2-rank node (plus, with 3 ranks, a second node of one rank), where rank `who`
// gives up at allgather `at` after `stall`; returns every rank's outcome.
std::vector<outcome> failing_setup(int ranks, int who, int at, std::chrono::milliseconds stall,
                                   std::chrono::milliseconds timeout) {
  std::vector<outcome> out(static_cast<std::size_t>(ranks));
  const std::vector<int> labels = ranks == 2 ? std::vector<int>{0, 0} : std::vector<int>{0, 0, 1};
  ddp::local::run(
      ranks,
      [&](ddp::local::communicator& c) {
        auto& o = out[static_cast<std::size_t>(c.rank())];
        flaky f(c, c.rank() == who ? at : 0, stall);
        const auto topo = shm::node_topology::from_labels(c.rank(), labels);
        try {
          auto seg = shm::open_posix_segment(f, topo, shm::segment_layout(topo.node_size, 4096, 1 << 20));
        } catch (const ddp::error& e) {
          o.threw = true;
          o.what = e.what();
        }
        o.left = segments_of(::getpid());
      },
      [&] {
        ddp::local::options o;
        o.timeout = timeout;
        return o;
      }());
  return out;
}

}  // namespace

TEST_CASE("shm segment: a set-up that fails or times out at any exchange leaves nothing in /dev/shm",
          "[shm][segment]") {
  REQUIRE(segments_of(::getpid()).empty());
  for (int who : {0, 1}) {               // the leader, or the other rank of the node, gives up
    for (int at : {1, 2, 3}) {           // at the name exchange, after the leader created it, after the mapping
      for (auto stall : {0ms, 600ms}) {  // at once (exception), or after the peers' timeout
        INFO("rank " << who << " gives up at allgather " << at << " after " << stall.count() << " ms");
        const auto out = failing_setup(2, who, at, stall, 250ms);
        for (std::size_t r = 0; r < out.size(); ++r) {
          CHECK(out[r].threw);
          // A rank that gave up at once may look before the leader, still inside the exchange,
          // has created (and then removed) the object: only the check below, after every rank
          // returned, holds for it.
          if (stall > 0ms || static_cast<int>(r) != who) CHECK(out[r].left.empty());
        }
        CHECK(out[static_cast<std::size_t>(who)].what.find("gives up") != std::string::npos);
        if (stall > 0ms) {
          // The peer timed out while the rank was stuck, and its guard removed the name then.
          CHECK(out[static_cast<std::size_t>(1 - who)].what.find("did not complete") != std::string::npos);
        }
        CHECK(segments_of(::getpid()).empty());
      }
    }
  }
  // A rank alone on a second node fails: the node that succeeded must unlink all the same.
  const auto out = failing_setup(3, 2, 3, 0ms, 250ms);
  for (const auto& o : out) CHECK(o.threw);
  CHECK(segments_of(::getpid()).empty());
}

TEST_CASE("shm segment: once set up, the name is gone (a SIGKILL leaks nothing)", "[shm][segment]") {
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {  // two ranks on one node, holding a 64 MiB segment until killed
    ::close(ready[0]);
    ddp::local::run(2, [&](ddp::local::communicator& c) {
      shm::communicator<ddp::local::communicator> comm(std::move(c), {.arena_bytes = 32 << 20, .node_of_rank = {0, 0}});
      std::vector<float> x(1000, 1.0f);
      comm.allreduce(x, ddp::reduce_op::sum).wait();
      comm.barrier().wait();
      if (comm.rank() == 0 && ::write(ready[1], "r", 1) != 1) std::_Exit(3);
      ::pause();
    });
    std::_Exit(0);
  }
  ::close(ready[1]);
  char byte = 0;
  const bool up = ::read(ready[0], &byte, 1) == 1;
  ::close(ready[0]);
  const auto while_running = segments_of(child);
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  REQUIRE(up);
  CHECK(while_running.empty());
  CHECK(WIFSIGNALED(status));
  CHECK(segments_of(child).empty());
}

TEST_CASE("shm segment: an object others may access is refused by open", "[shm][segment]") {
  const std::string name = "/ddp-shm-test-mode-" + std::to_string(::getpid());
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::fchmod(fd, 0644) == 0);
  REQUIRE(::ftruncate(fd, 8192) == 0);
  ::close(fd);
  const auto r = shm::posix_segment::open(name, 8192);
  ::shm_unlink(name.c_str());
  CHECK(r.segment == nullptr);
  CHECK(r.failed == shm::posix_segment::step::foreign_owner);
}

TEST_CASE("shm segment: a segment another user created is refused by open", "[shm][segment][.other_user]") {
  if (!other_user::can_switch_user()) {
    std::puts("SKIP: not root, cannot act as another user");
    return;
  }
  const std::string name = "/ddp-shm-test-owner-" + std::to_string(::getpid());
  const int code = other_user::run([&] { return shm::posix_segment::create(name, 8192).segment ? 0 : 1; });
  REQUIRE(code == 0);
  const auto r = shm::posix_segment::open(name, 8192);  // root could map it: the check refuses
  ::shm_unlink(name.c_str());
  CHECK(r.segment == nullptr);
  CHECK(r.failed == shm::posix_segment::step::foreign_owner);
  CHECK(std::string(shm::posix_segment::name_of(r.failed)).find("another user") != std::string::npos);
}

TEST_CASE("shm segment: malformed set-up records are communication errors naming the peer", "[shm][segment]") {
  namespace d = shm::detail;
  d::posix_setup_record rec;
  std::snprintf(rec.name, sizeof rec.name, "%s", d::random_segment_name(3).c_str());
  CHECK(d::check_setup_record(rec, 1, true, 0) == rec.name);
  const auto throws = [](d::posix_setup_record r, const char* part) {
    try {
      (void)d::check_setup_record(r, 5, true, 0);
    } catch (const ddp::usage_error&) {
      return false;
    } catch (const ddp::communication_error& e) {
      return std::string(e.what()).find("rank 5") != std::string::npos &&
             std::string(e.what()).find(part) != std::string::npos;
    }
    return false;
  };
  auto r = rec;
  r.failed = 99;
  CHECK(throws(r, "step 99"));
  r = rec;
  r.error = -1;
  CHECK(throws(r, "errno -1"));
  r = rec;
  std::memset(r.name, 'a', sizeof r.name);  // no terminating NUL
  CHECK(throws(r, "segment name"));
  r = rec;
  std::snprintf(r.name, sizeof r.name, "/ddp-shm-../../etc");
  CHECK(throws(r, "segment name"));
  r = rec;
  std::snprintf(r.name, sizeof r.name, "/other");
  CHECK(throws(r, "segment name"));
  // A record reporting a failure becomes the same error on every rank.
  std::vector<d::posix_setup_record> all(3);
  all[2].failed = static_cast<std::int32_t>(shm::posix_segment::step::fallocate);
  all[2].error = 28;  // ENOSPC
  CHECK_THROWS_WITH(d::throw_first_failure(all, 0, 1 << 20),
                    Catch::Contains("rank 2") && Catch::Contains("posix_fallocate") && Catch::Contains("1048576"));
}

TEST_CASE("shm segment: layout arithmetic is checked, naming the option", "[shm][segment]") {
  const std::size_t max = std::numeric_limits<std::size_t>::max();
  CHECK_THROWS_WITH(shm::segment_layout(2, max, 0, 3),
                    Catch::Contains("options::chunk_bytes") && Catch::Contains("rank 3"));
  CHECK_THROWS_WITH(shm::segment_layout(2, max - 100, 0), Catch::Contains("options::chunk_bytes"));
  CHECK_THROWS_WITH(shm::segment_layout(4, std::size_t{1} << 61, 0), Catch::Contains("options::chunk_bytes"));
  CHECK_THROWS_WITH(shm::segment_layout(2, 4096, max), Catch::Contains("options::arena_bytes"));
  CHECK_THROWS_WITH(shm::segment_layout(3, 4096, std::size_t{1} << 61), Catch::Contains("options::arena_bytes"));
  CHECK_THROWS_AS(shm::segment_layout(0, 4096, 0), ddp::usage_error);
  CHECK_THROWS_AS(shm::segment_layout(-1, 4096, 0), ddp::usage_error);
  const shm::segment_layout l(2, 4096, 8192);
  CHECK(l.total_bytes() == l.arena(1) + 8192);
  CHECK(l.in_own_region(1, 0, l.slot(1, 0), 4096));
  CHECK_FALSE(l.in_own_region(1, 0, l.slot(1, 0), 4097));
  CHECK_FALSE(l.in_own_region(1, 1, l.slot(1, 0), 16));  // the other parity's slot
  CHECK_FALSE(l.in_own_region(0, 0, l.slot(1, 0), 16));  // another rank's slot
  CHECK(l.in_own_region(1, 0, l.arena(1) + 100, 8092));
  CHECK_FALSE(l.in_own_region(1, 0, l.arena(1) + 100, 8093));
  CHECK_FALSE(l.in_own_region(0, 0, l.arena(1), 1));
  CHECK_FALSE(l.in_own_region(1, 0, std::numeric_limits<std::uint64_t>::max(), 1));
  CHECK_FALSE(l.in_own_region(1, 0, l.control(1), 8));
  // A request near SIZE_MAX must not round up to a 0-byte block.
  std::vector<std::byte> mem(8192);
  auto a = std::make_shared<shm::arena>(mem.data(), mem.size(), nullptr);
  CHECK_THROWS_WITH(shm::allocate(a, max, 0), Catch::Contains("arena exhausted"));
  CHECK_THROWS_WITH(shm::allocate(a, max - 100, 0), Catch::Contains("arena exhausted"));
}

TEST_CASE("shm segment: a peer's chunk descriptor outside its memory is an error naming it", "[shm][segment]") {
  // Node rank 0's engine over private memory; node rank 1 is simulated: its counters say it is
  // done with everything, its descriptor says what rank 0 would publish, with a bad offset.
  const shm::segment_layout l(2, 4096, 0);
  auto* base = static_cast<std::byte*>(std::aligned_alloc(shm::page_bytes, l.total_bytes()));
  REQUIRE(base != nullptr);
  std::memset(base, 0, l.total_bytes());
  l.initialise(base);
  auto& peer = *reinterpret_cast<shm::rank_control*>(base + l.control(1));
  peer.staged = peer.reduced = peer.copied = std::uint64_t{1} << 40;
  shm::node_engine engine(base, l, 0, {10, 11}, 0, 0);
  std::vector<float> x(512, 1.0f);
  shm::tensor_group g;
  g.type = ddp::dtype::f32;
  g.add(ddp::view(x));
  ddp::op_info info;
  info.rank = 10;
  info.timeout = 1000ms;
  auto& d = peer.desc[0];
  d.count = d.total = 512;
  d.type = static_cast<std::uint32_t>(ddp::dtype::f32);
  d.op = static_cast<std::uint32_t>(ddp::reduce_op::sum);
  d.phase = static_cast<std::uint32_t>(shm::node_phase::allreduce);
  d.offset = l.total_bytes() - 16;  // the last 16 bytes: 2048 would be read
  CHECK_THROWS_WITH(engine.run(shm::node_phase::allreduce, g, 0, ddp::reduce_op::sum, 1, info, ddp::clock::now() + 1s),
                    Catch::Contains("rank 11") && Catch::Contains("version-skewed or corrupt peer"));
  std::free(base);
}
