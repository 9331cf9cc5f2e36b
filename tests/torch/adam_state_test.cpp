// docs/coming-from-torchft.md's recipe for optimizer state that libtorch allocates lazily: Adam's
// moments created before the Manager and registered in a training_state stay the tensors Adam
// updates (in place, at the same addresses), and writing a replica's registered bytes and step
// scalar into another's (what a heal does: transferable_state) makes its next steps bit-identical.
#include <cstring>
#include <memory>
#include <vector>

// First: libtorch 1.13's headers need c10::IValue complete before <ATen/core/List.h> under
// clang++ -std=c++20 (pytorch/pytorch#93978); <ddp/torch.hpp> includes it first as well.
#include <ATen/core/ivalue.h>
// (then the rest)
#include <torch/torch.h>

#include <catch2/catch.hpp>
#include <ddp/torch.hpp>
#include <ddp/training_state.hpp>

namespace {

// One replica: a model, its Adam, and the training state registered as the docs say.
struct replica {
  torch::nn::Linear model;
  torch::optim::Adam opt;
  ddp::training_state state;
  std::size_t adam_step = 0;

  explicit replica(int seed)
      : model([seed] {
          torch::manual_seed(seed);
          return torch::nn::Linear(4, 3);
        }()),
        opt(model->parameters(), torch::optim::AdamOptions(1e-2)) {
    // The recipe of docs/coming-from-torchft.md ("Optimizer state allocated lazily").
    for (auto& p : model->parameters()) {
      auto s = std::make_unique<torch::optim::AdamParamState>();
      s->exp_avg(torch::zeros_like(p, at::MemoryFormat::Preserve));
      s->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
      state.add(p).add(s->exp_avg()).add(s->exp_avg_sq());  // Adam updates both in place
      opt.state()[c10::guts::to_string(p.unsafeGetTensorImpl())] = std::move(s);
    }
    adam_step = state.add_scalar(0);  // AdamParamState::step, the same on every tensor
  }

  torch::optim::AdamParamState& adam_state(const torch::Tensor& p) {
    return static_cast<torch::optim::AdamParamState&>(*opt.state().at(c10::guts::to_string(p.unsafeGetTensorImpl())));
  }
  // After start_quorum(): Adam's step count from the (possibly healed) scalar.
  void load_step() {
    for (auto& p : model->parameters()) adam_state(p).step(state.scalar(adam_step));
  }
  // A committed step: forward, backward, Adam; the step count back into the scalar.
  void train_step(int k) {
    opt.zero_grad();
    const auto x = torch::arange(8, torch::kFloat).reshape({2, 4}) * (0.1 * (k + 1));
    model->forward(x).pow(2).sum().backward();
    opt.step();
    state.scalar(adam_step) = adam_state(model->parameters().front()).step();
  }
};

// What a heal does (transferable_state): every registered tensor's bytes and every scalar.
void heal(replica& to, replica& from) {
  const auto src = from.state.state_tensors();
  const auto dst = to.state.state_tensors();
  REQUIRE(src.size() == dst.size());
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < src.size(); ++i) {
    REQUIRE(src[i].bytes() == dst[i].bytes());
    std::memcpy(dst[i].data, src[i].data, src[i].bytes());
  }
  for (std::size_t i = 0; i < from.state.state_scalars().size(); ++i) {
    to.state.state_scalars()[i] = from.state.state_scalars()[i];
  }
}

}  // namespace

TEST_CASE("libtorch Adam: moments created before the Manager stay the registered tensors", "[torch]") {
  replica r(1);
  REQUIRE(r.state.state_tensors().size() == 3 * r.model->parameters().size());
  std::vector<void*> before;
  for (const auto& v : r.state.state_tensors()) before.push_back(v.data);
  for (int k = 0; k < 3; ++k) {
    r.load_step();
    r.train_step(k);
  }
  CHECK(r.state.scalar(r.adam_step) == 3);
  std::size_t i = 0;
  for (auto& p : r.model->parameters()) {
    auto& s = r.adam_state(p);
    CHECK(p.data_ptr() == before[i++]);
    CHECK(s.exp_avg().data_ptr() == before[i++]);  // updated in place: the registered view sees it
    CHECK(s.exp_avg_sq().data_ptr() == before[i++]);
    CHECK(s.exp_avg().abs().sum().item<float>() > 0.0f);
    CHECK(s.step() == 3);
  }
}

TEST_CASE("libtorch Adam: a replica healed through its registered state steps bit for bit as its source", "[torch]") {
  replica source(1), healed(2);
  for (int k = 0; k < 4; ++k) {
    source.load_step();
    source.train_step(k);
  }
  healed.load_step();
  healed.train_step(0);  // its own, different history
  heal(healed, source);
  for (int k = 4; k < 7; ++k) {
    for (replica* r : {&source, &healed}) {
      r->load_step();
      r->train_step(k);
    }
  }
  const auto a = source.model->parameters(), b = healed.model->parameters();
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(torch::equal(a[i], b[i]));
  CHECK(healed.state.scalar(healed.adam_step) == 7);
  // Without the step count (bias correction differs), the same bytes do not give the same steps.
  replica stale(2);
  heal(stale, source);
  stale.state.scalar(stale.adam_step) = 0;
  source.load_step();
  source.train_step(7);
  stale.load_step();
  stale.train_step(7);
  CHECK_FALSE(torch::equal(source.model->parameters().front(), stale.model->parameters().front()));
}
