#pragma once
/// @file shm/topology.hpp
/// @brief `node_topology`: which ranks share a node, and which rank leads each node.

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <ddp/communicator.hpp>
#include <ddp/error.hpp>
#include <ddp/tensor.hpp>

namespace ddp::shm {

/// Where one rank sits: its node, its place among the node's ranks, and the node leaders. Ranks
/// of a node are ordered by their rank in the wrapped communicator; the lowest one leads.
struct node_topology {
  int rank = 0;                 ///< rank in the wrapped communicator
  int size = 1;                 ///< size of the wrapped communicator
  int node = 0;                 ///< this rank's node, numbered by each node's lowest rank
  int nodes = 1;                ///< number of nodes
  int node_rank = 0;            ///< position among the ranks of this node
  int node_size = 1;            ///< ranks on this node
  std::vector<int> node_of{0};  ///< node of every rank
  std::vector<int> leaders{0};  ///< rank leading each node

  /// True on the rank that represents this node among the nodes.
  [[nodiscard]] bool is_leader() const noexcept { return node_rank == 0; }
  /// The rank leading this rank's node.
  [[nodiscard]] int leader() const { return leaders[static_cast<std::size_t>(node)]; }

  /// Topology from any labelling of ranks by node (`labels[r]` is rank r's node; labels are
  /// renumbered in order of first appearance).
  /// @throws usage_error if `labels` does not have one entry per rank
  [[nodiscard]] static node_topology from_labels(int rank, std::vector<int> labels) {
    const int size = static_cast<int>(labels.size());
    if (rank < 0 || rank >= size) {
      throw usage_error(rank, "shm::node_topology",
                        "node_of_rank has " + std::to_string(size) + " entries; it needs one per rank");
    }
    node_topology t;
    t.rank = rank;
    t.size = size;
    t.node_of.assign(labels.size(), -1);
    t.leaders.clear();
    std::vector<int> seen;  // label of each node index
    for (std::size_t r = 0; r < labels.size(); ++r) {
      auto it = std::find(seen.begin(), seen.end(), labels[r]);
      if (it == seen.end()) {
        seen.push_back(labels[r]);
        t.leaders.push_back(static_cast<int>(r));
        it = seen.end() - 1;
      }
      t.node_of[r] = static_cast<int>(it - seen.begin());
    }
    t.nodes = static_cast<int>(seen.size());
    t.node = t.node_of[static_cast<std::size_t>(rank)];
    t.node_rank = 0;
    t.node_size = 0;
    for (int r = 0; r < size; ++r) {
      if (t.node_of[static_cast<std::size_t>(r)] != t.node) continue;
      if (r < rank) ++t.node_rank;
      ++t.node_size;
    }
    return t;
  }

  /// Ranks of this node, in order (world ranks).
  [[nodiscard]] std::vector<int> node_ranks() const {
    std::vector<int> out;
    for (int r = 0; r < size; ++r) {
      if (node_of[static_cast<std::size_t>(r)] == node) out.push_back(r);
    }
    return out;
  }
};

/// The topology of `comm`: from `node_of_rank` if given (no communication), otherwise by host
/// name (one allgather of 64-byte names over `comm`: collective). Ranks on hosts with equal names
/// share a node; ranks in separate containers of one machine count as separate nodes, which is
/// safe (they would not see each other's shared memory anyway).
template <communicator C>
[[nodiscard]] node_topology detect_topology(C& comm, const std::vector<int>& node_of_rank) {
  const int rank = comm.rank();
  const int size = comm.size();
  if (!node_of_rank.empty()) {
    if (static_cast<int>(node_of_rank.size()) != size) {
      throw usage_error(rank, "shm::detect_topology",
                        "node_of_rank has " + std::to_string(node_of_rank.size()) +
                            " entries for a communicator of size " + std::to_string(size));
    }
    return node_topology::from_labels(rank, node_of_rank);
  }
  constexpr std::size_t name_bytes = 64;
  std::vector<std::uint8_t> mine(name_bytes, 0);
  std::array<char, 256> host{};
  if (::gethostname(host.data(), host.size() - 1) != 0) host[0] = '\0';
  std::memcpy(mine.data(), host.data(), std::min(name_bytes - 1, std::strlen(host.data())));
  std::vector<std::uint8_t> all(name_bytes * static_cast<std::size_t>(size));
  comm.allgather(view(mine), view(all)).wait();
  std::vector<std::string> names;
  std::vector<int> labels(static_cast<std::size_t>(size));
  for (std::size_t r = 0; r < labels.size(); ++r) {
    std::string name(reinterpret_cast<const char*>(all.data() + r * name_bytes), name_bytes);
    auto it = std::find(names.begin(), names.end(), name);
    if (it == names.end()) {
      names.push_back(std::move(name));
      it = names.end() - 1;
    }
    labels[r] = static_cast<int>(it - names.begin());
  }
  return node_topology::from_labels(rank, std::move(labels));
}

}  // namespace ddp::shm
