#pragma once
// Running one test case on N ranks as threads of this process (the `local` backend). MPI test
// programs get their communicator from `make_world()` (mpi_world.hpp) instead.
//
// Catch2's macros are not thread-safe: `fn` reports a failure by throwing (SUITE_EXPECT of
// collective_suite.hpp), never with REQUIRE/CHECK/INFO; the helpers assert on this thread.

#include <chrono>
#include <concepts>
#include <cstddef>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/communicator.hpp>
#include <ddp/detail/describe_exception.hpp>
#include <ddp/local/communicator.hpp>

namespace test_ranks {

/// The deadline of every blocking wait of `on_ranks` unless a test asks for another.
inline constexpr std::chrono::milliseconds default_timeout = std::chrono::seconds(20);

/// Runs `fn(c)` on `n` thread ranks of one local world, each blocking wait bounded by `timeout`,
/// and waits for all of them. `c` is a `ddp::communicator_ref` if `fn` takes one, else the rank's
/// `ddp::local::communicator&`. A rank that throws: once every rank is done, each failing rank
/// and its message go to the report of the next Catch assertion (UNSCOPED_INFO, on this thread),
/// and the exception of the lowest failing rank is rethrown as it was thrown (CHECK_THROWS_AS
/// sees its type). `ddp::local::rank_left` counts as a normal exit, as in `ddp::local::run`.
template <class F>
void on_ranks(int n, F&& fn, std::chrono::milliseconds timeout = default_timeout) {
  std::vector<std::exception_ptr> errors(n > 0 ? static_cast<std::size_t>(n) : 0);
  ddp::local::options opts;
  opts.timeout = timeout;
  ddp::local::run(
      n,
      [&](ddp::local::communicator& c) {
        try {
          if constexpr (std::invocable<F&, ddp::communicator_ref>) {
            fn(ddp::communicator_ref(c));
          } else {
            fn(c);
          }
        } catch (const ddp::local::rank_left&) {
          throw;
        } catch (...) {
          errors[static_cast<std::size_t>(c.rank())] = std::current_exception();
        }
      },
      opts);
  std::exception_ptr first;
  for (std::size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r]) continue;
    UNSCOPED_INFO("rank " << r << " of " << n << " threw: " << ddp::detail::describe_exception(errors[r]));
    if (!first) first = errors[r];
  }
  if (first) std::rethrow_exception(first);
}

/// `on_ranks(n, fn, timeout)` for every `n` from `from` to `to`, each required not to throw (the
/// rank count in the report).
template <class F>
void require_on_ranks(int from, int to, F&& fn, std::chrono::milliseconds timeout = default_timeout) {
  for (int n = from; n <= to; ++n) {
    INFO("ranks " << n);
    REQUIRE_NOTHROW(on_ranks(n, fn, timeout));
  }
}

}  // namespace test_ranks
