// Issue #31: a libtorch trainer with gradient accumulation (the first micro-batch of each step
// under no_sync) whose `extra` layer is used only in that micro-batch, on some ranks. Over 2 and 3
// thread ranks, every rank must end with the bits of a one-process reference that averages each
// rank's accumulated gradients by ddp's rule (ddp::average_copy per rank, summed in rank order, as
// the thread backend reduces). Before the fix, `extra`'s gradient was left un-averaged on each rank
// and the ranks drifted apart. Also: errors name the parameter and the rank.
#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

// First: libtorch 1.13's headers need c10::IValue complete before <ATen/core/List.h> under
// clang++ -std=c++20 (pytorch/pytorch#93978).
#include <ATen/core/ivalue.h>
// (then the rest)
#include <torch/torch.h>

#include <catch2/catch.hpp>
#include <ddp/average.hpp>
#include <ddp/bucketer.hpp>
#include <ddp/local.hpp>
#include <ddp/torch.hpp>

using Catch::Matchers::Contains;

namespace {

struct TinyImpl : torch::nn::Module {
  torch::nn::Linear base{nullptr}, extra{nullptr};
  TinyImpl() {
    base = register_module("base", torch::nn::Linear(4, 3));
    extra = register_module("extra", torch::nn::Linear(4, 3));
    torch::NoGradGuard no_grad;  // the same weights on every rank and in the reference, no RNG
    float v = -1.0f;
    for (auto& p : parameters()) {
      p.copy_(torch::linspace(v, v + 0.75f, p.numel()).reshape(p.sizes()));
      v += 0.3f;
    }
  }
};
TORCH_MODULE(Tiny);

// Rank r's input of micro-batch m at step s; `extra` is used in micro-batch 0 on ranks r % 3 != 2.
torch::Tensor input(int r, int s, int m) {
  return torch::linspace(0.1f * static_cast<float>(r + 1), 1.0f + 0.2f * static_cast<float>(s + m), 8).reshape({2, 4});
}
bool uses_extra(int r, int m) { return m == 0 && r % 3 != 2; }

torch::Tensor loss(Tiny& net, int r, int s, int m) {
  const torch::Tensor x = input(r, s, m);
  torch::Tensor y = net->base(x);
  if (uses_extra(r, m)) y = y + net->extra(x);
  return y.pow(2).sum();
}

constexpr int steps = 3;
constexpr float lr = 0.05f;

void sgd(Tiny& net) {
  torch::NoGradGuard no_grad;
  for (auto& p : net->parameters()) p.sub_(p.grad() * lr);
}

// The reference: one model; each step, every rank's accumulated gradients, averaged by the rule.
std::vector<torch::Tensor> reference(int n) {
  Tiny net;
  for (auto& p : net->parameters()) p.mutable_grad() = torch::zeros_like(p);
  for (int s = 0; s < steps; ++s) {
    std::vector<torch::Tensor> avg;
    for (int r = 0; r < n; ++r) {
      for (auto& p : net->parameters()) p.mutable_grad().zero_();
      for (int m = 0; m < 2; ++m) loss(net, r, s, m).backward();
      std::size_t i = 0;
      for (auto& p : net->parameters()) {
        torch::Tensor scaled = torch::empty_like(p);
        ddp::average_copy(ddp::dtype::f32, scaled.data_ptr(), p.grad().data_ptr(), static_cast<std::size_t>(p.numel()),
                          n);
        if (r == 0) {
          avg.push_back(scaled);
        } else {
          avg[i].add_(scaled);
        }
        ++i;
      }
    }
    std::size_t i = 0;
    for (auto& p : net->parameters()) p.mutable_grad().copy_(avg[i++]);
    sgd(net);
  }
  std::vector<torch::Tensor> out;
  for (auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  return a.numel() == b.numel() && std::memcmp(a.data_ptr(), b.data_ptr(), a.numel() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("libtorch: a parameter used only inside no_sync is averaged; every rank ends on the reference's bits",
          "[torch][no_sync]") {
  torch::set_num_threads(1);
  for (int n : {2, 3}) {
    INFO("ranks " << n);
    const std::vector<torch::Tensor> want = reference(n);
    std::vector<std::vector<torch::Tensor>> got(static_cast<std::size_t>(n));
    ddp::local::run(n, [&](ddp::local::communicator& comm) {
      Tiny net;
      ddp::libtorch::hook_registry hooks;
      ddp::Bucketer grads(comm, {.find_unused_parameters = true});
      ddp::libtorch::register_module(*net, grads, hooks);
      grads.build();
      grads.attach(hooks);
      for (int s = 0; s < steps; ++s) {
        for (auto& p : net->parameters()) p.mutable_grad().zero_();  // in place: the hooks check the memory
        for (int m = 0; m < 2; ++m) {
          auto scope = grads.no_sync(m == 0);  // accumulate locally in the first micro-batch
          loss(net, comm.rank(), s, m).backward();
          grads.finalize();
        }
        sgd(net);
      }
      for (auto& p : net->parameters()) got[static_cast<std::size_t>(comm.rank())].push_back(p.detach().clone());
    });
    for (int r = 0; r < n; ++r) {
      const auto& mine = got[static_cast<std::size_t>(r)];
      REQUIRE(mine.size() == want.size());
      for (std::size_t i = 0; i < want.size(); ++i) {
        INFO("rank " << r << ", parameter " << i << ": max difference "
                     << (mine[i] - want[i]).abs().max().item<float>());
        CHECK(same_bits(mine[i], want[i]));
      }
    }
  }
}

TEST_CASE("libtorch: errors about a gradient name its parameter and the rank", "[torch][no_sync]") {
  ddp::local::world w(1);
  auto comm = w.rank(0);
  Tiny net;
  {  // never marked, without find_unused: the names register_module gave
    ddp::libtorch::hook_registry hooks;
    ddp::Bucketer grads(comm);
    ddp::libtorch::register_module(*net, grads, hooks);
    grads.attach(hooks);
    net->base(input(0, 0, 0)).sum().backward();  // `extra` unused
    REQUIRE_THROWS_WITH(grads.finalize(),
                        Contains("rank 0") && Contains("('extra.weight')") && Contains("('extra.bias')"));
  }
  {  // a gradient slot registered by reference and set to None (zero_grad(set_to_none=true))
    ddp::Bucketer grads(comm);
    auto& weight = net->base->weight;
    weight.mutable_grad() = torch::zeros_like(weight);
    grads.add(weight.mutable_grad(), "base.weight");
    grads.build();
    weight.mutable_grad() = torch::Tensor();
    REQUIRE_THROWS_WITH(grads.mark_ready(0),
                        Contains("rank 0") && Contains("gradient 0 ('base.weight')") && Contains("undefined tensor"));
  }
}
