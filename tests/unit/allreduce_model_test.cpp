// The allreduce cost model: its formulas at points worked out by hand, and the choices it makes at
// the two ends of the range it plans for (latency-bound small messages, bandwidth-bound large ones).
#include <catch2/catch.hpp>

#include <ddp/allreduce_model.hpp>

using ddp::allreduce_algorithm;

namespace {

// One node of 8 ranks unless said otherwise; round numbers so the formulas can be checked by hand.
ddp::machine_model round_machine() {
  ddp::machine_model m;
  m.node = {0.5, 1.0 / 10000.0};        // 0.5 us, 10 GB/s
  m.network = {5.0, 1.0 / 12500.0};     // 5 us, 12.5 GB/s
  m.reduce_us_per_byte = 1.0 / 8000.0;  // 8 GB/s
  m.ranks_per_node = 8;
  m.segment_bytes = std::size_t{4} << 20;
  return m;
}

}  // namespace

TEST_CASE("allreduce model: one rank costs nothing; the formulas at hand-checked points", "[unit][model]") {
  const auto m = round_machine();
  for (const auto a : ddp::all_allreduce_algorithms) CHECK(ddp::predicted_allreduce_us(a, 1 << 20, 1, m) == 0.0);

  const double n = 1 << 20;  // 2 ranks in one node: the node's link
  const double b = m.node.us_per_byte;
  const double g = m.reduce_us_per_byte;
  CHECK(ddp::predicted_allreduce_us(allreduce_algorithm::recursive_doubling, n, 2, m) == Approx(0.5 + n * b + n * g));
  CHECK(ddp::predicted_allreduce_us(allreduce_algorithm::ring, n, 2, m) == Approx(2 * 0.5 + n * b + n * g / 2));
  CHECK(ddp::predicted_allreduce_us(allreduce_algorithm::binomial_tree, n, 2, m) == Approx(2 * (0.5 + n * b) + n * g));
  // A rank count that is not a power of two pays the fold: 3 ranks cost more than 4.
  CHECK(ddp::predicted_allreduce_us(allreduce_algorithm::recursive_doubling, 4, 3, m) >
        ddp::predicted_allreduce_us(allreduce_algorithm::recursive_doubling, 4, 4, m));
  // The ring sends a block of more than one segment as several messages.
  ddp::machine_model small_segments = m;
  small_segments.segment_bytes = 1 << 10;
  CHECK(ddp::predicted_allreduce_us(allreduce_algorithm::ring, n, 2, small_segments) ==
        Approx(2 * 512 * 0.5 + n * b + n * g / 2));
  // Every algorithm costs more for more bytes.
  for (const auto a : ddp::all_allreduce_algorithms) {
    for (int p : {2, 3, 16, 4096}) {
      CHECK(ddp::predicted_allreduce_us(a, 1 << 21, p, m) > ddp::predicted_allreduce_us(a, 1 << 20, p, m));
    }
  }
}

TEST_CASE("allreduce model: latency-bound small messages, bandwidth-bound large ones", "[unit][model]") {
  const auto m = round_machine();
  // 4 bytes over 4096 ranks: a logarithmic number of messages, never the ring's 2 (p - 1).
  const auto tiny = ddp::choose_allreduce(4, 4096, m);
  CHECK(tiny.algorithm != allreduce_algorithm::ring);
  CHECK(ddp::predicted_allreduce_us(allreduce_algorithm::ring, 4, 4096, m) > 100 * tiny.predicted_us);
  // 1 GiB over 4096 ranks: within a small factor of the bandwidth floor 2 (p-1)/p n beta.
  const double big = double(std::uint64_t{1} << 30);
  const auto large = ddp::choose_allreduce(big, 4096, m);
  CHECK((large.algorithm == allreduce_algorithm::ring || large.algorithm == allreduce_algorithm::halving_doubling));
  CHECK(large.predicted_us < 2.5 * 2 * big * m.network.us_per_byte);
  // Medium messages over many nodes: the shared-memory level pays (the network sees one rank per node).
  CHECK(ddp::choose_allreduce(1 << 20, 4096, m).algorithm == allreduce_algorithm::hierarchical);
  // A job inside one node never pays the network.
  CHECK(ddp::predicted_allreduce_us(allreduce_algorithm::hierarchical, 1 << 20, 4, m) <
        ddp::predicted_allreduce_us(allreduce_algorithm::hierarchical, 1 << 20, 16, m));
}

TEST_CASE("allreduce model: the crossover from recursive doubling to the ring on 2 ranks", "[unit][model]") {
  // RD: a + n (b + g); ring: 2a + n b + n g / 2. The ring wins once n g / 2 > a: n > 2 a / g = 8000 B.
  const auto m = round_machine();
  CHECK(ddp::crossover_bytes(allreduce_algorithm::recursive_doubling, allreduce_algorithm::ring, 2, m) == 8192);
  // Never, in range, the other way round.
  CHECK(ddp::crossover_bytes(allreduce_algorithm::ring, allreduce_algorithm::recursive_doubling, 2, m, 8192) == 0);
  CHECK(ddp::name_of(allreduce_algorithm::halving_doubling) == "halving_doubling");
}
