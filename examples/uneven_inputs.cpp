// Uneven inputs: rank r holds 10 + 3r batches. Ranks that run out keep shadowing the others'
// gradient collectives (JoinContext), and at the end every rank holds the model of the last rank
// to finish. Without the join, the rank with more data would wait forever for partners.
//
//   mpiexec -n 3 ./uneven_inputs      or      ./uneven_inputs --threads 3
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include <ddp/ddp.hpp>
#include <ddp/local.hpp>
#include <ddp/mpi.hpp>

namespace {

void train(ddp::communicator_ref comm) {
  const int rank = comm.rank();
  const int batches = 10 + 3 * rank;
  std::vector<double> w(3, 0.0), gw(3, 0.0);  // y = w0 + w1 x + w2 x^2

  ddp::Bucketer grads(comm);
  grads.add(w, gw);
  grads.build();

  ddp::JoinContext join({.hooks = {.divide_by_initial_world_size = false}}, grads);
  for (int t = 0; t < batches; ++t) {
    const ddp::join_round& round = join.notify();  // one small int64 allreduce
    const double x = std::sin(rank * 13.0 + t);
    const double y = 1.0 - 2.0 * x + 0.5 * x * x;
    const double err = w[0] + w[1] * x + w[2] * x * x - y;
    gw = {err, err * x, err * x * x};
    grads.mark_ready(0);
    grads.finalize();  // averaged over the ranks still training
    for (int k = 0; k < 3; ++k) w[k] -= 0.3 * gw[k];
    if (rank == 0 && t % 5 == 0) std::printf("iteration %d: %d of %d ranks training\n", t, round.training, comm.size());
  }
  const ddp::join_summary s = join.finish();  // shadow the others, then agree on the final model
  std::printf("rank %d: trained %d batches, shadowed %llu rounds; final model from rank %d: w = [%.6f %.6f %.6f]\n",
              rank, batches, static_cast<unsigned long long>(s.rounds) - static_cast<unsigned long long>(batches),
              s.authoritative_rank, w[0], w[1], w[2]);

  std::vector<double> all(3 * static_cast<std::size_t>(comm.size()));
  comm.allgather(ddp::view(w), ddp::view(all)).wait();
  bool same = true;
  for (std::size_t i = 0; i < all.size(); ++i) same = same && all[i] == w[i % 3];
  if (rank == 0) std::printf("models identical on all %d ranks: %s\n", comm.size(), same ? "yes" : "NO");
  if (!same) throw std::runtime_error("models differ across ranks");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc > 2 && std::strcmp(argv[1], "--threads") == 0) {
      ddp::local::run(std::atoi(argv[2]), [](ddp::local::communicator& c) { train(c); });
      return 0;
    }
    ddp::mpi::environment env(&argc, &argv);
    auto comm = ddp::world(env);  // shared memory inside a node, TCP between nodes
    train(comm);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "uneven_inputs: %s\n", e.what());
    return 1;
  }
}
