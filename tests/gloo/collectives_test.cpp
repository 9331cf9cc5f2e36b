// The backend-generic collective suite over gloo, ranks as forked processes meeting in a file
// store. One ctest entry per process count selects its test case by name.

#include <chrono>
#include <string>

#include <catch2/catch.hpp>
#include <ddp/gloo.hpp>

#include "../common/collective_suite.hpp"
#include "process_group.hpp"

using namespace std::chrono_literals;
using gloo_test::process_group;
using gloo_test::reporter;

namespace {

void run_suite(int n, bool large) {
  gloo_test::temp_dir dir("gloo-suite");
  const auto t0 = std::chrono::steady_clock::now();
  process_group g(n, [&](int rank, const reporter&) {
    ddp::stores::file_store store(dir.path());
    auto ns = ddp::stores::generation_store(store, "suite", 0);
    ddp::gloo::communicator comm(ns, rank, n, {.timeout = 20s, .connect_timeout = 10s});
    suite::run_all(comm);
    if (large) suite::large_allreduce(comm);
  });
  const auto outs = g.wait_all(50s);
  INFO(gloo_test::describe_all(outs));
  for (const auto& o : outs) CHECK(o.ok());
  std::cout << "gloo suite, " << n << " processes: "
            << std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count()
            << " ms\n";
}

}  // namespace

TEST_CASE("gloo: collective suite over 1 process", "[gloo][suite][np1]") { run_suite(1, false); }
TEST_CASE("gloo: collective suite over 2 processes", "[gloo][suite][np2]") { run_suite(2, true); }
TEST_CASE("gloo: collective suite over 3 processes", "[gloo][suite][np3]") { run_suite(3, false); }
TEST_CASE("gloo: collective suite over 4 processes", "[gloo][suite][np4]") { run_suite(4, false); }

TEST_CASE("gloo: f16/bf16 reduced in their own format when widening is off", "[gloo]") {
  gloo_test::temp_dir dir("gloo-half");
  process_group g(3, [&](int rank, const reporter&) {
    ddp::stores::file_store store(dir.path());
    auto ns = ddp::stores::generation_store(store, "half", 0);
    ddp::gloo::communicator comm(ns, rank, 3, {.timeout = 10s, .connect_timeout = 10s, .widen_half = false});
    suite::allreduce_every_op_and_dtype(comm, {1, 1000});
    suite::allgather_and_reduce_scatter(comm);
  });
  const auto outs = g.wait_all(30s);
  INFO(gloo_test::describe_all(outs));
  for (const auto& o : outs) CHECK(o.ok());
}
