// Consumer of an installed ddp: an at::Tensor and an Eigen matrix averaged by a Bucketer over two
// local ranks, through <ddp/torch.hpp> and <ddp/eigen.hpp>.
#include <ddp/torch.hpp>  // first: it includes what libtorch 1.13 needs first under clang++ -std=c++20

#include <ddp/bucketer.hpp>
#include <ddp/eigen.hpp>
#include <ddp/local.hpp>

#include <ATen/ops/full.h>
#include <atomic>
#include <cstdio>

int main() {
  std::atomic<int> correct{0};
  ddp::local::run(2, [&](ddp::local::communicator& c) {
    const auto value = static_cast<float>(c.rank() + 1);
    at::Tensor t = at::full({3, 4}, value);                                           // a libtorch tensor ...
    Eigen::MatrixXd m = Eigen::MatrixXd::Constant(2, 5, static_cast<double>(value));  // ... and an Eigen one
    ddp::Bucketer grads(c);
    grads.add(t);
    grads.add(m);
    grads.mark_ready(0);
    grads.mark_ready(1);
    grads.finalize();
    if (t.min().item<float>() == 1.5f && t.max().item<float>() == 1.5f && (m.array() == 1.5).all()) ++correct;
  });
  std::printf("%s\n", correct == 2 ? "adapters ok: at::Tensor and Eigen::MatrixXd averaged over 2 ranks" : "WRONG");
  return correct == 2 ? 0 : 1;
}
