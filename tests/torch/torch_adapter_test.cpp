// The libtorch adapter (<ddp/torch.hpp>) in one process: at::Tensor traits, the AccumulateGrad
// hook registry (hooks fire once per backward pass, survive between iterations, and are removed
// when the Bucketer goes: re-creating it 10 times leaves exactly one hook per parameter, counted
// by libtorch itself), register_module, and gradient accumulation under no_sync (issue #31).
#include <cstddef>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

// First: libtorch 1.13's headers need c10::IValue complete before <ATen/core/List.h> under
// clang++ -std=c++20 (pytorch/pytorch#93978); <ddp/torch.hpp> includes it first as well.
#include <ATen/core/ivalue.h>
// (then the rest)
#include <torch/torch.h>

#include <catch2/catch.hpp>
#include <ddp/average.hpp>
#include <ddp/bucketer.hpp>
#include <ddp/buffer_reducer.hpp>
#include <ddp/local.hpp>
#include <ddp/torch.hpp>

using Catch::Matchers::Contains;

namespace {

// Linear -> BatchNorm1d -> ReLU -> Linear, with a frozen parameter and a tied one.
struct NetImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  torch::Tensor frozen, tied;
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 5));
    bn = register_module("bn", torch::nn::BatchNorm1d(5));
    fc2 = register_module("fc2", torch::nn::Linear(5, 3));
    frozen = register_parameter("frozen", torch::ones({3}), /*requires_grad=*/false);
    tied = register_parameter("tied", fc2->bias);  // the same tensor under a second name
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(bn(fc1(x)))) * frozen; }
};
TORCH_MODULE(Net);

torch::Tensor loss_of(Net& net, int seed) {
  torch::manual_seed(static_cast<std::uint64_t>(seed));
  const auto x = torch::randn({8, 6});
  return net->forward(x).pow(2).mean();
}

std::size_t trainable_parameters(const Net& net) {
  std::size_t n = 0;
  for (const auto& p : net->parameters()) n += p.requires_grad() ? 1 : 0;
  return n - 1;  // `tied` is fc2.bias
}

}  // namespace

TEST_CASE("at::Tensor dtypes map to ddp dtypes; others are a usage_error naming them", "[torch][tensor]") {
  STATIC_REQUIRE(ddp::tensor<at::Tensor>);
  STATIC_REQUIRE(ddp::tensor<torch::Tensor>);
  const std::vector<std::pair<c10::ScalarType, ddp::dtype>> pairs{
      {torch::kHalf, ddp::dtype::f16},   {torch::kBFloat16, ddp::dtype::bf16}, {torch::kFloat, ddp::dtype::f32},
      {torch::kDouble, ddp::dtype::f64}, {torch::kChar, ddp::dtype::i8},       {torch::kByte, ddp::dtype::u8},
      {torch::kInt, ddp::dtype::i32},    {torch::kLong, ddp::dtype::i64}};
  for (const auto& [st, dt] : pairs) {
    at::Tensor t = torch::zeros({2, 3}, torch::TensorOptions().dtype(st));
    const ddp::tensor_view v = ddp::view(t);
    CHECK(v.type == dt);
    CHECK(v.count == 6);
    CHECK(v.data == t.data_ptr());
    CHECK(v.where == ddp::device::host());
    CHECK(v.bytes() == static_cast<std::size_t>(t.nbytes()));
    CHECK(ddp::libtorch::to_scalar_type(dt) == st);
  }
  for (const auto st : {torch::kBool, torch::kShort, torch::kComplexFloat}) {
    at::Tensor t = torch::zeros({2}, torch::TensorOptions().dtype(st));
    REQUIRE_THROWS_AS(ddp::view(t), ddp::usage_error);
    REQUIRE_THROWS_WITH(ddp::view(t), Contains(std::string("libtorch dtype ") + c10::toString(st)));
  }
}

TEST_CASE("at::Tensor is a handle; non-contiguous, undefined and sparse tensors are clear errors", "[torch][tensor]") {
  at::Tensor t = torch::arange(24, torch::kFloat).reshape({4, 6});
  at::Tensor copy = t;  // shares the storage
  CHECK(ddp::view(copy).data == ddp::view(t).data);

  // A contiguous slice (rows 1..2) is viewable: its data pointer includes the storage offset.
  at::Tensor rows = t.narrow(0, 1, 2);
  const ddp::tensor_view rv = ddp::view(rows);
  CHECK(rv.count == 12);
  CHECK(rv.as<float>()[0] == 6.0f);

  at::Tensor transposed = t.t();
  REQUIRE_THROWS_AS(ddp::view(transposed), ddp::usage_error);
  REQUIRE_THROWS_WITH(ddp::view(transposed), Contains("non-contiguous") && Contains("strides [1, 6]"));
  at::Tensor columns = t.narrow(1, 0, 2);
  REQUIRE_THROWS_WITH(ddp::view(columns), Contains("non-contiguous"));
  at::Tensor channels_last = torch::zeros({2, 3, 4, 4}).contiguous(at::MemoryFormat::ChannelsLast);
  REQUIRE_THROWS_WITH(ddp::view(channels_last), Contains("channels_last"));

  at::Tensor undefined;
  REQUIRE_THROWS_WITH(ddp::view(undefined), Contains("undefined tensor"));
  at::Tensor sparse = torch::eye(3).to_sparse();
  REQUIRE_THROWS_WITH(ddp::view(sparse), Contains("layout Sparse"));

  // A Bucketer rejects them at add(), before anything runs.
  ddp::local::world w(1);
  auto comm = w.rank(0);
  ddp::Bucketer grads(comm);
  REQUIRE_THROWS_WITH(grads.add(transposed), Contains("non-contiguous"));
}

TEST_CASE("libtorch devices map to ddp devices", "[torch][tensor]") {
  CHECK(ddp::libtorch::to_device(c10::Device(c10::kCPU)) == ddp::device::host());
  CHECK(ddp::libtorch::to_device(c10::Device(c10::kCUDA, 3)) == ddp::device::cuda(3));
  CHECK(ddp::libtorch::to_device(c10::Device(c10::kCUDA)) == ddp::device::cuda(0));
  REQUIRE_THROWS_WITH(ddp::libtorch::to_device(c10::Device(c10::kMeta)), Contains("device 'meta'"));
  at::Tensor meta = torch::zeros({4}, torch::TensorOptions().device(c10::kMeta));
  REQUIRE_THROWS_AS(ddp::view(meta), ddp::usage_error);
}

TEST_CASE("register_module: gradients pre-allocated, frozen and tied parameters skipped, buffer strategies",
          "[torch][register_module]") {
  torch::manual_seed(1);
  Net net;
  ddp::local::world w(1);
  auto comm = w.rank(0);
  ddp::libtorch::hook_registry hooks;
  ddp::Bucketer grads(comm);
  ddp::BufferReducer buffers(comm);
  const auto reg = ddp::libtorch::register_module(*net, grads, hooks, buffers);

  // named_parameters() order: the module's own parameters, then its children's. `tied` comes
  // first, so fc2.bias (the same tensor) is the one skipped.
  std::vector<std::string> names;
  for (const auto& p : reg.parameters) names.push_back(p.name);
  CHECK(names == std::vector<std::string>{"tied", "fc1.weight", "fc1.bias", "bn.weight", "bn.bias", "fc2.weight"});
  for (std::size_t i = 0; i < reg.parameters.size(); ++i) CHECK(reg.parameters[i].index == i);
  CHECK(hooks.size() == reg.parameters.size());
  REQUIRE(reg.skipped.size() == 2);
  CHECK_THAT(reg.skipped[0], Contains("frozen") && Contains("does not require a gradient"));
  CHECK_THAT(reg.skipped[1], Contains("fc2.bias") && Contains("shared"));
  for (const auto& p : net->parameters()) {
    if (!p.requires_grad()) continue;
    REQUIRE(p.grad().defined());
    CHECK(p.grad().is_contiguous());
    CHECK(p.grad().sizes() == p.sizes());
    CHECK(p.grad().abs().sum().item<float>() == 0.0f);
  }

  REQUIRE(reg.buffers.size() == 3);
  CHECK(reg.buffers[0].name == "bn.running_mean");
  CHECK(reg.buffers[0].strategy == "allreduce(avg)");
  CHECK(reg.buffers[1].name == "bn.running_var");
  CHECK(reg.buffers[1].strategy == "allreduce(avg)");
  CHECK(reg.buffers[2].name == "bn.num_batches_tracked");
  CHECK(reg.buffers[2].strategy == "broadcast(root=0)");
  buffers.build();
  CHECK(buffers.stats().collectives_per_sync == 2);  // f32 mean group, i64 broadcast group

  // Another picker: everything gets the reducer's default.
  ddp::BufferReducer<ddp::strategies::allreduce_sum> sums(comm);
  const auto reg2 = ddp::libtorch::register_buffers(*net, sums, {.buffer_strategy = {}});
  for (const auto& b : reg2.buffers) CHECK(b.strategy == "allreduce(sum)");
}

TEST_CASE("hooks fire once per parameter and backward pass, and the accumulators are kept alive", "[torch][hooks]") {
  torch::manual_seed(2);
  Net net;
  ddp::local::world w(1);
  auto comm = w.rank(0);
  ddp::libtorch::hook_registry hooks;
  ddp::Bucketer grads(comm);
  const auto reg = ddp::libtorch::register_module(*net, grads, hooks);
  grads.build();
  grads.attach(hooks);
  CHECK(grads.attached_hooks() == reg.parameters.size());

  for (int step = 0; step < 3; ++step) {
    // Between iterations no graph exists: only the registry keeps the accumulators (and hooks).
    for (const auto& p : reg.parameters) {
      CHECK(ddp::libtorch::hook_registry::post_hook_count(net->named_parameters()[p.name]) == 1);
    }
    for (auto& p : net->parameters()) {
      if (p.grad().defined()) p.grad().zero_();
    }
    loss_of(net, step).backward();  // marks every gradient ready: twice would throw
    CHECK(grads.last_step().iteration == static_cast<std::uint64_t>(step));
    grads.finalize();  // every gradient was marked, or this throws
    CHECK(grads.last_step().iteration == static_cast<std::uint64_t>(step + 1));
  }
}

TEST_CASE("re-creating the Bucketer 10 times leaves exactly one hook per parameter", "[torch][hooks]") {
  torch::manual_seed(3);
  Net net;
  ddp::local::world w(1);
  auto comm = w.rank(0);
  const std::size_t params = trainable_parameters(net);
  auto hook_counts = [&] {
    std::vector<std::size_t> counts;
    for (const auto& p : net->parameters()) {
      if (p.requires_grad()) counts.push_back(ddp::libtorch::hook_registry::post_hook_count(p));
    }
    return counts;
  };

  SECTION("one registry, a new Bucketer each time (PyTorch's #21344 scenario)") {
    ddp::libtorch::hook_registry hooks;
    std::unique_ptr<ddp::Bucketer<>> grads;
    for (int round = 0; round < 10; ++round) {
      grads.reset();  // the old one goes first, taking its hooks with it
      grads = std::make_unique<ddp::Bucketer<>>(comm);
      ddp::libtorch::register_module(*net, *grads, hooks);  // binds the same keys again
      grads->attach(hooks);
      loss_of(net, round).backward();
      grads->finalize();
      CHECK(hooks.live_hooks() == params);
    }
    // Counted by libtorch on the accumulators, tied parameter included once (fc2.bias twice).
    for (const std::size_t c : hook_counts()) CHECK(c == 1);
    grads.reset();
    CHECK(hooks.live_hooks() == 0);
    for (const std::size_t c : hook_counts()) CHECK(c == 0);
  }

  SECTION("a new registry and a new Bucketer each time") {
    for (int round = 0; round < 10; ++round) {
      ddp::libtorch::hook_registry hooks;
      ddp::Bucketer grads(comm);
      ddp::libtorch::register_module(*net, grads, hooks);
      grads.attach(hooks);
      loss_of(net, round).backward();
      grads.finalize();
      for (const std::size_t c : hook_counts()) CHECK(c == 1);
    }
    // Nothing holds the accumulators any more: libtorch freed them, hooks and all.
    for (const std::size_t c : hook_counts()) CHECK(c == 0);
  }

  SECTION("a registry destroyed first removes its hooks itself") {
    auto hooks = std::make_unique<ddp::libtorch::hook_registry>();
    ddp::Bucketer grads(comm);
    ddp::libtorch::register_module(*net, grads, *hooks);
    grads.attach(*hooks);
    for (const std::size_t c : hook_counts()) CHECK(c == 1);
    grads.detach();  // the documented order: detach (or destroy the Bucketer) first
    hooks->clear();
    for (const std::size_t c : hook_counts()) CHECK(c == 0);
  }
}

TEST_CASE("a gradient replaced after registration makes backward() throw, naming the parameter", "[torch][hooks]") {
  torch::manual_seed(4);
  Net net;
  ddp::local::world w(1);
  auto comm = w.rank(0);
  for (const bool set_to_none : {false, true}) {
    ddp::libtorch::hook_registry hooks;
    ddp::Bucketer grads(comm);
    ddp::libtorch::register_module(*net, grads, hooks);
    grads.attach(hooks);
    if (set_to_none) {
      net->zero_grad(/*set_to_none=*/true);  // backward() then allocates new gradients
    } else {
      net->fc1->weight.mutable_grad() = torch::zeros_like(net->fc1->weight);
    }
    // (libtorch rethrows the hook's exception from backward(); the Bucketer's iteration is then
    // broken, as after any exception in a backward pass: this one is dropped.)
    const std::string who = set_to_none ? "parameter '" : "parameter 'fc1.weight'";
    REQUIRE_THROWS_WITH(loss_of(net, 0).backward(), Contains(who) && Contains("was reallocated") && Contains("rank 0"));
    for (auto& p : net->parameters()) {  // leave every gradient allocated for the next round
      if (p.requires_grad() && !p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    }
  }
}

TEST_CASE("hook_registry errors", "[torch][hooks]") {
  ddp::libtorch::hook_registry hooks;
  at::Tensor p = torch::zeros({3}).requires_grad_();
  REQUIRE_THROWS_WITH(hooks.bind(0, p, "p"), Contains("no gradient tensor yet"));
  p.mutable_grad() = torch::zeros_like(p);
  hooks.bind(0, p, "p");
  hooks.bind(0, p, "p");  // again, same parameter: fine
  at::Tensor q = torch::zeros({3}).requires_grad_();
  q.mutable_grad() = torch::zeros_like(q);
  REQUIRE_THROWS_WITH(hooks.bind(0, q, "q"), Contains("already bound to parameter 'p'"));
  REQUIRE_THROWS_WITH(hooks.bind(1, torch::zeros({3}), "c"), Contains("requires a gradient"));
  REQUIRE_THROWS_WITH(hooks.add_gradient_hook(7, [] {}), Contains("no parameter is bound to gradient 7"));
  const auto h = hooks.add_gradient_hook(0, [] {});
  CHECK(ddp::libtorch::hook_registry::post_hook_count(p) == 1);
  hooks.remove_gradient_hook(h);
  hooks.remove_gradient_hook(h);  // already gone: nothing
  CHECK(ddp::libtorch::hook_registry::post_hook_count(p) == 0);
}

// ---- Issue #31: gradient accumulation with a parameter used only under no_sync ------------
// A trainer whose `extra` layer is used only in the first (no_sync) micro-batch of each step, on
// some ranks. Over 2 and 3 thread ranks every rank must end with the bits of a one-process
// reference that averages each rank's accumulated gradients by ddp's rule (ddp::average_copy per
// rank, summed in rank order, as the thread backend reduces). Before the fix `extra`'s gradient
// was left un-averaged on each rank and the ranks drifted apart. Also: errors name the parameter
// and the rank. (In this translation unit: each one that includes <torch/torch.h> costs CI 90 s.)

namespace no_sync_case {

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

}  // namespace no_sync_case

TEST_CASE("libtorch: a parameter used only inside no_sync is averaged; every rank ends on the reference's bits",
          "[torch][no_sync]") {
  torch::set_num_threads(1);
  for (int n : {2, 3}) {
    INFO("ranks " << n);
    const std::vector<torch::Tensor> want = no_sync_case::reference(n);
    std::vector<std::vector<torch::Tensor>> got(static_cast<std::size_t>(n));
    ddp::local::run(n, [&](ddp::local::communicator& comm) {
      no_sync_case::Tiny net;
      ddp::libtorch::hook_registry hooks;
      ddp::Bucketer grads(comm, {.find_unused_parameters = true});
      ddp::libtorch::register_module(*net, grads, hooks);
      grads.build();
      grads.attach(hooks);
      for (int s = 0; s < no_sync_case::steps; ++s) {
        for (auto& p : net->parameters()) p.mutable_grad().zero_();  // in place: the hooks check the memory
        for (int m = 0; m < 2; ++m) {
          auto scope = grads.no_sync(m == 0);  // accumulate locally in the first micro-batch
          no_sync_case::loss(net, comm.rank(), s, m).backward();
          grads.finalize();
        }
        no_sync_case::sgd(net);
      }
      for (auto& p : net->parameters()) got[static_cast<std::size_t>(comm.rank())].push_back(p.detach().clone());
    });
    for (int r = 0; r < n; ++r) {
      const auto& mine = got[static_cast<std::size_t>(r)];
      REQUIRE(mine.size() == want.size());
      for (std::size_t i = 0; i < want.size(); ++i) {
        INFO("rank " << r << ", parameter " << i << ": max difference "
                     << (mine[i] - want[i]).abs().max().item<float>());
        CHECK(no_sync_case::same_bits(mine[i], want[i]));
      }
    }
  }
}

TEST_CASE("libtorch: errors about a gradient name its parameter and the rank", "[torch][no_sync]") {
  ddp::local::world w(1);
  auto comm = w.rank(0);
  no_sync_case::Tiny net;
  {  // never marked, without find_unused: the names register_module gave
    ddp::libtorch::hook_registry hooks;
    ddp::Bucketer grads(comm);
    ddp::libtorch::register_module(*net, grads, hooks);
    grads.attach(hooks);
    net->base(no_sync_case::input(0, 0, 0)).sum().backward();  // `extra` unused
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
