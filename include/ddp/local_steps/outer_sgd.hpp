#pragma once
/// @file local_steps/outer_sgd.hpp
/// @brief The outer optimizer of DiLoCo: the `outer_optimizer` concept a policy models, and
/// `outer_sgd`, SGD with (Nesterov) momentum as the DiLoCo paper uses it. docs/local-steps.md.

#include <cmath>
#include <concepts>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <ddp/detail/host_reduce.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/tensor.hpp>

namespace ddp {

/// What DiLoCo asks of its outer optimizer: a copyable policy that `prepare`s its state for a list
/// of parameters once, then `step`s them (`params[i]` moved against `outer_grads[i]`, same dtype
/// and count) at every outer step, and shows its state as tensors (`state()`: what a recovering
/// replica must receive, so that healing restores the optimizer too).
template <class O>
concept outer_optimizer = std::copy_constructible<O> && requires(O& o, std::span<const tensor_view> ts) {
  o.prepare(ts);
  o.step(ts, ts);
  { o.state() } -> std::same_as<std::vector<tensor_view>>;
};

/// Host memory of one dtype holding optimizer state.
struct state_buffer {
  ddp::dtype type = dtype::f32;    ///< element type
  std::vector<std::byte> bytes{};  ///< the elements

  /// The buffer as a tensor.
  [[nodiscard]] tensor_view view() noexcept {
    return {bytes.data(), bytes.size() / size_of(type), type, device::host()};
  }
};

/// SGD with momentum as the outer optimizer (the DiLoCo paper's: lr 0.7, momentum 0.9, Nesterov).
/// PyTorch's `torch.optim.SGD` update without dampening or weight decay, per element:
/// `b = momentum * b + g; d = nesterov ? g + momentum * b : b; p = p - lr * d`, in the compute
/// type of the parameter (f64 for f64, f32 otherwise; f16/bf16 parameters are rounded once when
/// stored). With momentum 0 there is no buffer and `p = p - lr * g`.
struct outer_sgd {
  double lr = 0.7;        ///< outer learning rate
  double momentum = 0.9;  ///< momentum factor; 0: plain SGD
  bool nesterov = true;   ///< Nesterov momentum (needs momentum > 0)
  /// The momentum buffers, one per parameter (none without momentum), in the parameter's compute
  /// type; zero until the first step. Filled by `prepare`; part of the healed state.
  std::vector<state_buffer> buffers{};

  /// Checks the knobs and allocates one zeroed buffer per parameter.
  /// @throws usage_error on a non-finite or negative learning rate, a momentum outside [0, 1),
  ///         Nesterov without momentum, or a parameter that is not floating point
  void prepare(std::span<const tensor_view> params) {
    if (!(std::isfinite(lr) && lr >= 0)) {
      throw usage_error(-1, "outer_sgd", "lr " + std::to_string(lr) + " is not a finite value >= 0");
    }
    if (!(momentum >= 0 && momentum < 1)) {
      throw usage_error(-1, "outer_sgd", "momentum " + std::to_string(momentum) + " is not in [0, 1)");
    }
    if (nesterov && momentum == 0) throw usage_error(-1, "outer_sgd", "Nesterov momentum needs momentum > 0");
    buffers.clear();
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (!is_floating(params[i].type)) {
        throw usage_error(-1, "outer_sgd",
                          "parameter " + std::to_string(i) + " is " + std::string(name_of(params[i].type)) +
                              "; the outer optimizer needs floating-point parameters");
      }
      if (momentum == 0) continue;
      const dtype t = params[i].type == dtype::f64 ? dtype::f64 : dtype::f32;
      buffers.push_back({t, std::vector<std::byte>(params[i].count * size_of(t))});
    }
  }

  /// One outer step: `params[i]` moved against `outer_grads[i]` (precondition: `prepare(params)`
  /// was called with the same shapes).
  void step(std::span<const tensor_view> params, std::span<const tensor_view> outer_grads) {
    for (std::size_t i = 0; i < params.size(); ++i) {
      const tensor_view p = params[i];
      void* buf = momentum == 0 ? nullptr : buffers[i].bytes.data();
      detail::visit_dtype(p.type, [&]<class T>(T) {
        if constexpr (std::is_floating_point_v<detail::compute_t<T>>) {
          using C = detail::compute_t<T>;
          T* pd = static_cast<T*>(p.data);
          const T* gd = static_cast<const T*>(outer_grads[i].data);
          C* b = static_cast<C*>(buf);
          const C l = static_cast<C>(lr);
          const C m = static_cast<C>(momentum);
          for (std::size_t k = 0; k < p.count; ++k) {
            C d = detail::load(gd[k]);
            if (b != nullptr) {
              b[k] = m * b[k] + d;
              d = nesterov ? d + m * b[k] : b[k];
            }
            pd[k] = detail::store<T>(detail::load(pd[k]) - l * d);
          }
        }
      });
    }
  }

  /// The momentum buffers as tensors (empty without momentum).
  [[nodiscard]] std::vector<tensor_view> state() {
    std::vector<tensor_view> s;
    for (state_buffer& b : buffers) s.push_back(b.view());
    return s;
  }
};

static_assert(outer_optimizer<outer_sgd>);

}  // namespace ddp
