#pragma once
/// @file mpi/p2p_allreduce.hpp
/// @brief `detail::p2p_allreduce`: what an operation's work handle needs of an allreduce that ddp
/// runs itself over MPI point-to-point messages (the ring, recursive doubling): advance it, and
/// know whether MPI may still touch its memory.

namespace ddp::mpi::detail {

class p2p_allreduce {
 public:
  virtual ~p2p_allreduce() = default;
  /// Tests this rank's messages, reduces what arrived and posts the next messages. Returns true
  /// once the allreduce completed here. Throws `mpi_error`.
  virtual bool progress() = 0;
  /// True while MPI may still read or write this object's memory or the region.
  [[nodiscard]] virtual bool in_flight() const noexcept = 0;
  /// True once `progress()` returned true.
  [[nodiscard]] virtual bool done() const noexcept = 0;

 protected:
  p2p_allreduce() = default;
  p2p_allreduce(const p2p_allreduce&) = default;
  p2p_allreduce& operator=(const p2p_allreduce&) = default;
};

}  // namespace ddp::mpi::detail
