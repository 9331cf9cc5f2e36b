// Consumer of ddp as a subproject: a 3-rank allreduce over the in-process backend.
#include <ddp/ddp.hpp>
#include <ddp/local.hpp>

#include <atomic>
#include <cstdio>
#include <vector>

int main() {
  std::atomic<int> wrong{0};
  ddp::local::run(3, [&](ddp::local::communicator& comm) {
    std::vector<double> values(100, comm.rank() + 1.0);
    ddp::communicator_ref(comm).allreduce(values, ddp::reduce_op::sum).wait();
    for (const double v : values) {
      if (v != 6.0) ++wrong;
    }
  });
  if (wrong != 0) {
    std::fprintf(stderr, "local allreduce wrong in %d elements\n", wrong.load());
    return 1;
  }
  std::printf("local allreduce ok\n");
  return 0;
}
