// Consumer of an installed ddp: a 2-rank MPI allreduce through the public headers.
#include <ddp/ddp.hpp>
#include <ddp/mpi.hpp>

#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  ddp::mpi::environment env(&argc, &argv);
  auto comm = ddp::mpi::communicator::world();
  const int rank = comm.rank();
  const int size = comm.size();

  std::vector<float> values(1000, static_cast<float>(rank + 1));
  ddp::communicator_ref(comm).allreduce(values, ddp::reduce_op::sum).wait();

  const auto expected = static_cast<float>(size * (size + 1) / 2);
  for (const float v : values) {
    if (v != expected) {
      std::fprintf(stderr, "rank %d of %d: allreduce sum wrong: got %g, expected %g\n", rank, size,
                   static_cast<double>(v), static_cast<double>(expected));
      return 1;
    }
  }
  std::printf("rank %d of %d: allreduce sum ok (%g)\n", rank, size, static_cast<double>(expected));
  return 0;
}
