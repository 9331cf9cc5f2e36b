#pragma once
/// @file allreduce_model.hpp
/// @brief An alpha-beta-gamma cost model of allreduce algorithms, and the algorithm it picks for
/// a message size and a rank count: how ddp plans past the machines it can be measured on.
///
/// Predicted times of recursive doubling, halving-doubling, the ring, the binomial tree and the
/// hierarchical form (shared memory in a node, leaders across nodes), with the fold for rank
/// counts that are not a power of two. `bench/allreduce_model_bench.cpp` prints its table.
/// The formulas, which link each algorithm uses, what the model leaves out, and the model
/// against measurements: docs/allreduce-model.md.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string_view>

namespace ddp {

/// The allreduce algorithms the model knows.
enum class allreduce_algorithm : std::uint8_t {
  recursive_doubling,  ///< log2(p) exchanges of the whole message: the fewest latencies
  halving_doubling,    ///< reduce-scatter by recursive halving, allgather by doubling (Rabenseifner)
  ring,                ///< reduce-scatter and allgather around a ring: bandwidth-optimal
  binomial_tree,       ///< reduce to a root, then broadcast, both binomial trees
  hierarchical,        ///< shared memory inside each node, the best flat algorithm between nodes
};

/// Every algorithm, in declaration order.
inline constexpr std::array<allreduce_algorithm, 5> all_allreduce_algorithms{
    allreduce_algorithm::recursive_doubling, allreduce_algorithm::halving_doubling, allreduce_algorithm::ring,
    allreduce_algorithm::binomial_tree, allreduce_algorithm::hierarchical};

/// "recursive_doubling", "halving_doubling", "ring", "binomial_tree", "hierarchical".
[[nodiscard]] constexpr std::string_view name_of(allreduce_algorithm a) noexcept {
  switch (a) {
    case allreduce_algorithm::recursive_doubling: return "recursive_doubling";
    case allreduce_algorithm::halving_doubling: return "halving_doubling";
    case allreduce_algorithm::ring: return "ring";
    case allreduce_algorithm::binomial_tree: return "binomial_tree";
    case allreduce_algorithm::hierarchical: return "hierarchical";
  }
  return "?";
}

/// Costs of one link: a message of `n` bytes takes `alpha_us + n * us_per_byte` microseconds.
struct link_cost {
  double alpha_us = 0;     ///< latency per message
  double us_per_byte = 0;  ///< inverse bandwidth
  /// A link of `alpha_us` latency and `gb_per_s` (1e9 bytes/s) bandwidth.
  [[nodiscard]] static constexpr link_cost of(double alpha_us, double gb_per_s) noexcept {
    return {alpha_us, 1.0 / (gb_per_s * 1e3)};
  }
};

/// The machine the model plans for.
struct machine_model {
  link_cost network = link_cost::of(5.0, 12.5);      ///< between nodes (default: 100 Gb/s, 5 us)
  link_cost node = link_cost::of(0.5, 10.0);         ///< shared memory inside a node (copies)
  double reduce_us_per_byte = 1.0 / (8.0 * 1e3);     ///< gamma: summing one byte (default 8 GB/s)
  int ranks_per_node = 8;                            ///< `q` of the hierarchical form
  std::size_t segment_bytes = std::size_t{4} << 20;  ///< the ring's message size (ddp's MPI ring)
};

namespace detail {
[[nodiscard]] inline int floor_pow2(int p) noexcept {
  int q = 1;
  while (q * 2 <= p) q *= 2;
  return q;
}
[[nodiscard]] inline double log2_of(int p) noexcept { return std::log2(static_cast<double>(p)); }
}  // namespace detail

/// Predicted microseconds of a flat (one-level) `algorithm` over `ranks` ranks joined by `link`.
/// `hierarchical` is not flat: use `predicted_allreduce_us`.
[[nodiscard]] inline double predicted_flat_us(allreduce_algorithm algorithm, double bytes, int ranks,
                                              const link_cost& link, double gamma, std::size_t segment_bytes) {
  if (ranks <= 1) return 0.0;
  const double a = link.alpha_us;
  const double b = link.us_per_byte;
  const double p = ranks;
  const int pow2 = detail::floor_pow2(ranks);
  const double P = pow2;
  const double fold = ranks == pow2 ? 0.0 : (a + bytes * b + bytes * gamma) + (a + bytes * b);
  switch (algorithm) {
    case allreduce_algorithm::recursive_doubling: return detail::log2_of(pow2) * (a + bytes * b + bytes * gamma) + fold;
    case allreduce_algorithm::halving_doubling:
      return 2 * detail::log2_of(pow2) * a + 2 * (P - 1) / P * bytes * b + (P - 1) / P * bytes * gamma + fold;
    case allreduce_algorithm::ring: {
      const double block = bytes / p;
      const double segments =
          segment_bytes == 0 ? 1.0 : std::max(1.0, std::ceil(block / static_cast<double>(segment_bytes)));
      return 2 * (p - 1) * segments * a + 2 * (p - 1) / p * bytes * b + (p - 1) / p * bytes * gamma;
    }
    case allreduce_algorithm::binomial_tree: {
      const double lg = std::ceil(detail::log2_of(ranks));
      return 2 * lg * (a + bytes * b) + lg * bytes * gamma;
    }
    case allreduce_algorithm::hierarchical: break;
  }
  return std::numeric_limits<double>::infinity();
}

/// The flat algorithms, for the network level of the hierarchical form.
inline constexpr std::array<allreduce_algorithm, 4> flat_allreduce_algorithms{
    allreduce_algorithm::recursive_doubling, allreduce_algorithm::halving_doubling, allreduce_algorithm::ring,
    allreduce_algorithm::binomial_tree};

/// An algorithm and its predicted time.
struct allreduce_choice {
  allreduce_algorithm algorithm = allreduce_algorithm::ring;      ///< the fastest candidate
  double predicted_us = std::numeric_limits<double>::infinity();  ///< its predicted time
};

/// The fastest of `candidates` (flat ones only) for `bytes` over `ranks` ranks on `link`; ties go
/// to the earlier candidate.
[[nodiscard]] inline allreduce_choice fastest_flat(std::span<const allreduce_algorithm> candidates, double bytes,
                                                   int ranks, const link_cost& link, double gamma,
                                                   std::size_t segment_bytes) {
  allreduce_choice best;
  for (const allreduce_algorithm a : candidates) {
    if (a == allreduce_algorithm::hierarchical) continue;
    const double t = predicted_flat_us(a, bytes, ranks, link, gamma, segment_bytes);
    if (t < best.predicted_us) best = {a, t};
  }
  return best;
}

/// Predicted microseconds of `algorithm` for an allreduce of `bytes` over `ranks` ranks of `m`
/// (which link each level uses: the file comment). `hierarchical` reduces inside each node of
/// `m.ranks_per_node` ranks first; a job that fits in one node never touches the network.
[[nodiscard]] inline double predicted_allreduce_us(allreduce_algorithm algorithm, double bytes, int ranks,
                                                   const machine_model& m) {
  if (ranks <= 1) return 0.0;
  const int q = std::max(1, std::min(m.ranks_per_node, ranks));
  const int nodes = (ranks + q - 1) / q;
  if (algorithm != allreduce_algorithm::hierarchical) {
    link_cost link = nodes == 1 ? m.node : m.network;
    if (nodes > 1 && algorithm != allreduce_algorithm::ring) link.us_per_byte *= q;  // q flows share a node's link
    return predicted_flat_us(algorithm, bytes, ranks, link, m.reduce_us_per_byte, m.segment_bytes);
  }
  const double in = 2 * m.node.alpha_us + 2 * bytes * m.node.us_per_byte +
                    (q - 1) / static_cast<double>(q) * bytes * m.reduce_us_per_byte;
  const double out = m.node.alpha_us + bytes * m.node.us_per_byte;
  const double between =  // one leader per node: no sharing of the link
      fastest_flat(flat_allreduce_algorithms, bytes, nodes, m.network, m.reduce_us_per_byte, m.segment_bytes)
          .predicted_us;
  return in + between + out;
}

/// The algorithm of `candidates` the model predicts fastest for `bytes` over `ranks` ranks of `m`
/// (ties go to the earlier candidate).
[[nodiscard]] inline allreduce_choice choose_allreduce(
    double bytes, int ranks, const machine_model& m,
    std::span<const allreduce_algorithm> candidates = all_allreduce_algorithms) {
  allreduce_choice best;
  for (const allreduce_algorithm a : candidates) {
    const double t = predicted_allreduce_us(a, bytes, ranks, m);
    if (t < best.predicted_us) best = {a, t};
  }
  return best;
}

/// The smallest power-of-two message size from `min_bytes` up to `max_bytes` at which `b` is
/// predicted faster than `a` over `ranks` ranks of `m` (0 if never in that range): the threshold
/// that a backend switching from `a` to `b` by size should use.
[[nodiscard]] inline double crossover_bytes(allreduce_algorithm a, allreduce_algorithm b, int ranks,
                                            const machine_model& m, double min_bytes = 4,
                                            double max_bytes = double(std::uint64_t{1} << 34)) {
  for (double n = min_bytes; n <= max_bytes; n *= 2) {
    if (predicted_allreduce_us(b, n, ranks, m) < predicted_allreduce_us(a, n, ranks, m)) return n;
  }
  return 0;
}

}  // namespace ddp
