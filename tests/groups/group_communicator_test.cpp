// group_communicator over threads (issue #30): G groups of k ranks, an inner local communicator
// per group and a cross one per rank index. Every collective gives what the same collective over
// one flat communicator of G k ranks gives; an allreduce sends 1/k of the data across the groups;
// a Bucketer averages over it; the reproducible reducer gives the same bits as over a flat
// communicator.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/bucketer.hpp>
#include <ddp/bucketing/fixed.hpp>
#include <ddp/groups/group_communicator.hpp>
#include <ddp/local.hpp>
#include <ddp/reproducible.hpp>

namespace {

using ddp::tensor_view;

// Catch2's assertions are not thread-safe: a rank's thread throws instead, and run_groups
// reports what each rank threw on the test's own thread.
#define TREQUIRE(...)                                                                                     \
  do {                                                                                                    \
    if (!(__VA_ARGS__)) throw std::runtime_error("line " + std::to_string(__LINE__) + ": " #__VA_ARGS__); \
  } while (false)

// Forwards to a communicator and counts the elements of the allreduces and broadcasts issued
// through it.
struct counted {
  ddp::local::communicator inner;
  std::atomic<std::size_t>* elements;
  [[nodiscard]] int rank() const { return inner.rank(); }
  [[nodiscard]] int size() const { return inner.size(); }
  ddp::work allreduce(std::span<const tensor_view> ts, ddp::reduce_op op) {
    for (const auto& t : ts) *elements += t.count;
    return inner.allreduce(ts, op);
  }
  ddp::work broadcast(std::span<const tensor_view> ts, int root) {
    for (const auto& t : ts) *elements += t.count;
    return inner.broadcast(ts, root);
  }
  ddp::work allgather(tensor_view in, tensor_view out) { return inner.allgather(in, out); }
  ddp::work reduce_scatter(tensor_view in, tensor_view out, ddp::reduce_op op) {
    return inner.reduce_scatter(in, out, op);
  }
  ddp::work barrier() { return inner.barrier(); }
  void abort() noexcept { inner.abort(); }
};

using group_comm = ddp::group_communicator<ddp::local::communicator, counted>;

// Runs fn(comm) on G x k threads, rank g k + i holding inner "in<g>" (rank i) and cross "x<i>"
// (rank g). `cross_elements[rank]` counts what each rank allreduced across.
void run_groups(int groups, int k, const std::function<void(group_comm&)>& fn,
                std::vector<std::atomic<std::size_t>>* cross_elements = nullptr,
                ddp::group_inner_reduction inner_reduction = ddp::group_inner_reduction::allreduce) {
  ddp::local::fabric fabric(ddp::local::options{.timeout = std::chrono::seconds(20), .faults = {}});
  std::vector<std::atomic<std::size_t>> own(static_cast<std::size_t>(groups * k));
  auto& counts = cross_elements ? *cross_elements : own;
  std::vector<std::thread> threads;
  std::mutex mu;
  std::vector<std::string> errors;
  for (int g = 0; g < groups; ++g) {
    for (int i = 0; i < k; ++i) {
      threads.emplace_back([&, g, i] {
        try {
          auto inner = fabric.connect("in" + std::to_string(g), i, k);
          auto cross = fabric.connect("x" + std::to_string(i), g, groups);
          group_comm c(std::move(inner), counted{std::move(cross), &counts[static_cast<std::size_t>(g * k + i)]},
                       {.inner = inner_reduction});
          fn(c);
        } catch (const std::exception& e) {
          std::lock_guard lk(mu);
          errors.push_back(e.what());
        }
      });
    }
  }
  for (auto& t : threads) t.join();
  std::string all;
  for (const auto& e : errors) all += e + "\n";
  INFO(all);
  REQUIRE(errors.empty());
}

double value(int rank, std::size_t j) { return static_cast<double>((rank + 1) * 1000 + static_cast<int>(j % 97)); }

}  // namespace

TEST_CASE("group_communicator: allreduce over G groups of k ranks is the flat allreduce, 1/k of it across",
          "[local][groups]") {
  for (const auto inner_reduction : {ddp::group_inner_reduction::allreduce, ddp::group_inner_reduction::reduce_scatter})
    for (const auto& shape : {std::pair{2, 2}, std::pair{3, 2}, std::pair{2, 3}, std::pair{1, 4}, std::pair{4, 1}}) {
      const int groups = shape.first, k = shape.second;
      INFO(groups << " groups of " << k
                  << (inner_reduction == ddp::group_inner_reduction::allreduce ? ", inner allreduce"
                                                                               : ", inner reduce-scatter"));
      const int n = groups * k;
      std::vector<std::atomic<std::size_t>> across(static_cast<std::size_t>(n));
      std::mutex mu;
      std::vector<std::vector<double>> f64_results(static_cast<std::size_t>(n));
      run_groups(
          groups, k,
          [&](group_comm& c) {
            TREQUIRE(c.size() == n);
            TREQUIRE(c.group_size() == k);
            // Mixed dtypes, counts not multiples of k, an empty tensor.
            std::vector<double> a(1001), e;
            std::vector<float> b(7);
            std::vector<std::int32_t> d(3);
            for (std::size_t j = 0; j < a.size(); ++j) a[j] = value(c.rank(), j);
            for (std::size_t j = 0; j < b.size(); ++j) b[j] = static_cast<float>(value(c.rank(), j + 5));
            for (std::size_t j = 0; j < d.size(); ++j) d[j] = c.rank() * 10 + static_cast<int>(j);
            const std::vector<tensor_view> ts{ddp::view(a), ddp::view(b), ddp::view(e), ddp::view(d)};
            c.allreduce(ts, ddp::reduce_op::sum).wait();
            for (std::size_t j = 0; j < a.size(); ++j) {
              double want = 0;
              for (int r = 0; r < n; ++r) want += value(r, j);
              TREQUIRE(a[j] == want);
            }
            for (std::size_t j = 0; j < b.size(); ++j) {
              double want = 0;
              for (int r = 0; r < n; ++r) want += value(r, j + 5);
              TREQUIRE(b[j] == static_cast<float>(want));
            }
            for (std::size_t j = 0; j < d.size(); ++j) TREQUIRE(d[j] == 10 * n * (n - 1) / 2 + n * static_cast<int>(j));
            std::vector<double> m(5, static_cast<double>(c.rank()));
            c.allreduce(std::vector<tensor_view>{ddp::view(m)}, ddp::reduce_op::max).wait();
            for (const double x : m) TREQUIRE(x == n - 1);
            std::lock_guard lk(mu);
            f64_results[static_cast<std::size_t>(c.rank())] = a;
          },
          &across, inner_reduction);
      // Each rank sent ceil(count / k) of each dtype across: 1/k of the gradient (plus padding),
      // then 5 elements' shard of the max.
      const std::size_t per_rank = (1001 + k - 1) / k + (7 + k - 1) / k + (3 + k - 1) / k + (5 + k - 1) / k;
      for (int r = 0; r < n; ++r) CHECK(across[static_cast<std::size_t>(r)].load() == per_rank);
      for (const auto& v : f64_results) CHECK(v == f64_results.front());
    }
}

TEST_CASE("group_communicator: broadcast, allgather, reduce_scatter and barrier in job rank order", "[local][groups]") {
  for (const auto& shape : {std::pair{2, 2}, std::pair{3, 2}, std::pair{2, 3}}) {
    const int groups = shape.first, k = shape.second;
    INFO(groups << " groups of " << k);
    const int n = groups * k;
    std::vector<std::atomic<std::size_t>> across(static_cast<std::size_t>(n));
    run_groups(
        groups, k,
        [&](group_comm& c) {
          const int me = c.rank();
          for (int root = 0; root < n; ++root) {
            std::vector<double> x(9, me == root ? 3.5 + root : -1.0);
            std::vector<std::int64_t> y(2, me == root ? root : -1);
            c.broadcast(std::vector<tensor_view>{ddp::view(x), ddp::view(y)}, root).wait();
            for (const double v : x) TREQUIRE(v == 3.5 + root);
            for (const auto v : y) TREQUIRE(v == root);
          }
          std::vector<float> in(3), out(static_cast<std::size_t>(3 * n));
          for (std::size_t j = 0; j < in.size(); ++j) in[j] = static_cast<float>(me * 10 + static_cast<int>(j));
          c.allgather(ddp::view(in), ddp::view(out)).wait();
          for (int r = 0; r < n; ++r) {
            for (std::size_t j = 0; j < 3; ++j)
              TREQUIRE(out[static_cast<std::size_t>(r) * 3 + j] == r * 10 + static_cast<int>(j));
          }
          // In place: this rank's block of out is the input.
          std::vector<float> place(static_cast<std::size_t>(2 * n), -1.0f);
          place[static_cast<std::size_t>(2 * me)] = static_cast<float>(me);
          place[static_cast<std::size_t>(2 * me + 1)] = static_cast<float>(-me);
          const tensor_view whole = ddp::view(place);
          c.allgather(whole.slice(static_cast<std::size_t>(2 * me), 2), whole).wait();
          for (int r = 0; r < n; ++r) {
            TREQUIRE(place[static_cast<std::size_t>(2 * r)] == static_cast<float>(r));
            TREQUIRE(place[static_cast<std::size_t>(2 * r + 1)] == static_cast<float>(-r));
          }
          // Block b of rank r's input is r * 100 + b: rank b gets sum_r (r * 100 + b) in every element.
          std::vector<double> rin(static_cast<std::size_t>(4 * n)), rout(4);
          for (std::size_t j = 0; j < rin.size(); ++j) rin[j] = me * 100 + static_cast<int>(j / 4);
          c.reduce_scatter(ddp::view(rin), ddp::view(rout), ddp::reduce_op::sum).wait();
          for (const double v : rout) TREQUIRE(v == 100.0 * n * (n - 1) / 2 + static_cast<double>(n) * me);
          c.barrier().wait();
        },
        &across);
    // Each broadcast moves 9 f64 and 2 i64 (88 bytes): every rank carries its 1/k of them across.
    for (int r = 0; r < n; ++r)
      CHECK(across[static_cast<std::size_t>(r)].load() == static_cast<std::size_t>(n) * ((88 + k - 1) / k));
  }
}

// Stages after the first start when a handle is tested; ranks that test in different orders
// must still issue every stage in one order (detail/stage_sequencer.hpp).
TEST_CASE("group_communicator: collectives in flight together, waited in different orders on different ranks",
          "[local][groups]") {
  for (const auto inner_reduction :
       {ddp::group_inner_reduction::allreduce, ddp::group_inner_reduction::reduce_scatter}) {
    run_groups(
        3, 2,
        [&](group_comm& c) {
          const int n = c.size(), me = c.rank();
          std::vector<std::vector<double>> bufs;
          for (std::size_t b = 0; b < 5; ++b) bufs.emplace_back(7 + 100 * b, static_cast<double>(me + 1) * (b + 1));
          std::vector<double> bcast(5, me == 3 ? 42.0 : 0.0);
          std::vector<ddp::work> works;
          for (auto& b : bufs)
            works.push_back(c.allreduce(std::vector<tensor_view>{ddp::view(b)}, ddp::reduce_op::sum));
          works.push_back(c.broadcast(std::vector<tensor_view>{ddp::view(bcast)}, 3));
          // Even ranks wait newest first, odd ranks oldest first, the rest round-robin.
          if (me % 3 == 0) {
            for (auto it = works.rbegin(); it != works.rend(); ++it) it->wait();
          } else if (me % 3 == 1) {
            for (auto& w : works) w.wait();
          } else {
            std::vector<ddp::work*> parts;
            for (auto& w : works) parts.push_back(&w);
            ddp::work::wait_all(parts);
          }
          for (std::size_t b = 0; b < bufs.size(); ++b) {
            for (const double v : bufs[b]) TREQUIRE(v == static_cast<double>(n * (n + 1) / 2) * (b + 1));
          }
          for (const double v : bcast) TREQUIRE(v == 42.0);
        },
        nullptr, inner_reduction);
  }
}

TEST_CASE("group_communicator: a Bucketer averages over it without special code", "[local][groups]") {
  run_groups(2, 2, [](group_comm& c) {
    std::vector<float> w(300, 0.0f), g(300), w2(17, 0.0f), g2(17);
    ddp::Bucketer<ddp::bucketing::fixed> grads(c, {}, {});
    grads.add(w, g);
    grads.add(w2, g2);
    grads.build();
    for (int step = 0; step < 3; ++step) {
      for (std::size_t j = 0; j < g.size(); ++j) g[j] = static_cast<float>(c.rank() * 4 + step);
      for (std::size_t j = 0; j < g2.size(); ++j) g2[j] = static_cast<float>(-c.rank());
      grads.mark_ready(1);
      grads.mark_ready(0);
      grads.finalize();
      // Mean over 4 ranks of rank * 4 + step: 6 + step; of -rank: -1.5.
      for (const float v : g) TREQUIRE(v == static_cast<float>(6 + step));
      for (const float v : g2) TREQUIRE(v == -1.5f);
    }
  });
}

TEST_CASE("group_communicator: the reproducible reducer gives the bits of a flat communicator", "[local][groups]") {
  constexpr std::size_t micro_batches = 8, dim = 257;
  const auto gradient_of = [](std::size_t micro_batch, std::vector<double>& g) {
    for (std::size_t j = 0; j < g.size(); ++j) g[j] = std::sin(static_cast<double>(micro_batch * 131 + j)) / 3.0;
  };
  const auto train = [&](ddp::communicator_ref comm) {
    std::vector<double> g(dim);
    ddp::ReproducibleReducer red(comm, micro_batches);
    red.add(g);
    red.build();
    red.begin(0);
    for (const std::size_t i : red.pending()) {
      gradient_of(i, g);
      red.accumulate(i);
    }
    red.finalize();
    return g;
  };
  std::vector<double> flat;
  ddp::local::run(1, [&](ddp::local::communicator& c) { flat = train(c); });
  std::mutex mu;
  std::vector<std::vector<double>> grouped;
  run_groups(2, 2, [&](group_comm& c) {
    auto g = train(c);
    std::lock_guard lk(mu);
    grouped.push_back(std::move(g));
  });
  REQUIRE(grouped.size() == 4);
  for (const auto& g : grouped) CHECK(g == flat);
}
