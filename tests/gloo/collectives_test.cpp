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

TEST_CASE("gloo: reduce_scatter (ddp's ring) for every op and dtype, input untouched", "[gloo][reduce_scatter]") {
  gloo_test::temp_dir dir("gloo-rs");
  process_group g(3, [&](int rank, const reporter&) {
    ddp::stores::file_store store(dir.path());
    auto ns = ddp::stores::generation_store(store, "rs", 0);
    ddp::gloo::communicator comm(ns, rank, 3, {.timeout = 10s, .connect_timeout = 10s});
    for (ddp::dtype t : suite::all_dtypes()) {
      for (ddp::reduce_op op : suite::all_ops()) {
        for (std::size_t n : {std::size_t{1}, std::size_t{1000}, (std::size_t{1} << 16) + 3}) {
          suite::buffer in(t, n * 3), out(t, n);
          for (std::size_t i = 0; i < in.count(); ++i) in.set(i, suite::value(rank, i));
          const auto before = in.bytes;
          comm.reduce_scatter(in.view(), out.view(), op).wait();
          const std::string where = "reduce_scatter " + std::string(ddp::name_of(op)) + " " +
                                    std::string(ddp::name_of(t)) + " n=" + std::to_string(n);
          CHILD_CHECK(in.bytes == before, where << ": input modified");
          for (std::size_t i = 0; i < n; i += (n > 1000 ? 997 : 1)) {
            suite::expect_close(out.get(i), suite::expected_reduction(op, t, 3, static_cast<std::size_t>(rank) * n + i),
                                t, [&] { return std::string(where + " i=" + std::to_string(i)); });
          }
        }
      }
    }
  });
  const auto outs = g.wait_all(50s);
  INFO(gloo_test::describe_all(outs));
  for (const auto& o : outs) CHECK(o.ok());
}
