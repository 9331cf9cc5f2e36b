#pragma once
// Local steps (LocalSGD, DiLoCo, Streaming DiLoCo) over any communicator: a tiny linear
// regression trained on every rank with its own data, and a serial reference that simulates the
// replicas in one thread with the library's arithmetic (the thread backend sums ranks in rank
// order; the reference does too). Rank lambdas throw, never use Catch macros (ranks.hpp).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <ddp/local_steps.hpp>

namespace local_steps_cases {

/// Which data the replicas train on.
enum class data_kind {
  /// Pseudo-random values in [-1, 1): every rounding of the arithmetic happens.
  general,
  /// Small integers (inputs multiples of 3) and quarter-integer weights: with a power-of-two
  /// learning rate, every update of a few steps is exact in f64 (the H = 1 equivalence's condition).
  exact,
};

/// One replica of the model: y ~ wa . x[0..3) + wb . x[3..5) + bias, three tensors.
template <class T>
struct model {
  std::vector<T> wa, wb, bias;
  std::vector<ddp::tensor_view> views() { return {ddp::view(wa), ddp::view(wb), ddp::view(bias)}; }
  std::array<std::vector<T>*, 3> tensors() { return {&wa, &wb, &bias}; }
  [[nodiscard]] std::vector<T> flat() const {
    std::vector<T> f = wa;
    f.insert(f.end(), wb.begin(), wb.end());
    f.insert(f.end(), bias.begin(), bias.end());
    return f;
  }
};

inline double unit(std::uint64_t a, std::uint64_t b, std::uint64_t c) {  // splitmix64 -> [-1, 1)
  std::uint64_t z = a * 0x9e3779b97f4a7c15ull + b * 0xbf58476d1ce4e5b9ull + c * 0x94d049bb133111ebull + 1;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) / static_cast<double>(1ull << 52) - 1.0;
}

/// Rank-dependent on purpose: `broadcast_initial` makes every replica start from rank 0's.
template <class T>
model<T> initial(int rank, data_kind kind) {
  model<T> m{std::vector<T>(3), std::vector<T>(2), std::vector<T>(1)};
  std::size_t i = 0;
  for (auto* t : m.tensors()) {
    for (T& v : *t) {
      const double u = unit(7, static_cast<std::uint64_t>(rank), i++);
      v = kind == data_kind::exact ? static_cast<T>(std::floor(u * 8) / 4) : static_cast<T>(u);
    }
  }
  return m;
}

template <class T>
struct sample {
  std::array<T, 5> x{};
  T y{};
};

template <class T>
sample<T> data(int rank, long step, data_kind kind) {
  sample<T> s;
  const auto r = static_cast<std::uint64_t>(rank);
  const auto t = static_cast<std::uint64_t>(step);
  for (std::size_t i = 0; i < 5; ++i) {
    const double u = unit(r, t, i);
    s.x[i] = kind == data_kind::exact ? static_cast<T>(3 * std::floor(u * 2.5)) : static_cast<T>(u);
  }
  const double u = unit(r, t, 99);
  s.y = kind == data_kind::exact
            ? static_cast<T>(std::floor(u * 6))
            : static_cast<T>(0.5 * s.x[0] - s.x[1] + 0.25 * s.x[2] + 2 * s.x[3] - s.x[4] + 0.3 + 0.1 * u);
  return s;
}

/// The gradient of 0.5 (prediction - y)^2, as a model of the same shape.
template <class T>
model<T> gradient(const model<T>& m, const sample<T>& s) {
  T e = m.bias[0] - s.y;
  for (std::size_t i = 0; i < 3; ++i) e += m.wa[i] * s.x[i];
  for (std::size_t i = 0; i < 2; ++i) e += m.wb[i] * s.x[3 + i];
  model<T> g{std::vector<T>(3), std::vector<T>(2), std::vector<T>{e}};
  for (std::size_t i = 0; i < 3; ++i) g.wa[i] = e * s.x[i];
  for (std::size_t i = 0; i < 2; ++i) g.wb[i] = e * s.x[3 + i];
  return g;
}

/// Plain SGD, `p = p - eta * g`. Returns false if some update rounded (p - (p - eta g) != eta g).
template <class T>
bool sgd(model<T>& m, model<T> g, T eta) {
  bool exact = true;
  auto ps = m.tensors();
  auto gs = g.tensors();
  for (std::size_t k = 0; k < 3; ++k) {
    for (std::size_t i = 0; i < ps[k]->size(); ++i) {
      const T before = (*ps[k])[i];
      const T step = eta * (*gs[k])[i];
      (*ps[k])[i] = before - step;
      exact = exact && before - (*ps[k])[i] == step;
    }
  }
  return exact;
}

inline void expect(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

/// What a training run takes.
struct run_setup {
  int steps = 12;
  double eta = 0.05;
  data_kind kind = data_kind::general;
};

// ---- the runs, on one rank of any communicator ---------------------------------------------

/// Synchronous data-parallel training: every step, the gradients averaged by ddp's rule
/// (`allreduce_average`, what the Bucketer does), then plain SGD.
template <class T>
std::vector<T> run_sync_dp(ddp::communicator_ref c, run_setup s) {
  model<T> m = initial<T>(0, s.kind);
  for (long t = 1; t <= s.steps; ++t) {
    model<T> g = gradient(m, data<T>(c.rank(), t, s.kind));
    ddp::allreduce_average(c, g.views(), c.size()).wait();
    sgd(m, g, static_cast<T>(s.eta));
  }
  return m.flat();
}

template <class T>
std::vector<T> run_local_sgd(ddp::communicator_ref c, int sync_every, run_setup s) {
  model<T> m = initial<T>(c.rank(), s.kind);
  ddp::local_sgd sync(c, m.views(), {.sync_every = sync_every});
  for (long t = 1; t <= s.steps; ++t) {
    sgd(m, gradient(m, data<T>(c.rank(), t, s.kind)), static_cast<T>(s.eta));
    sync.step();
  }
  return m.flat();
}

/// DiLoCo; `*all_exact` (if given) is cleared when an inner update rounded.
template <class T>
std::vector<T> run_diloco(ddp::communicator_ref c, ddp::diloco_options<> o, run_setup s, bool* all_exact = nullptr) {
  model<T> m = initial<T>(c.rank(), s.kind);
  ddp::diloco sync(c, m.views(), o);
  for (long t = 1; t <= s.steps; ++t) {
    const bool exact = sgd(m, gradient(m, data<T>(c.rank(), t, s.kind)), static_cast<T>(s.eta));
    if (all_exact != nullptr && !exact) *all_exact = false;
    sync.step();
  }
  return m.flat();
}

template <class T>
std::vector<T> run_streaming(ddp::communicator_ref c, ddp::streaming_diloco_options<> o, run_setup s) {
  model<T> m = initial<T>(c.rank(), s.kind);
  ddp::streaming_diloco sync(c, m.views(), o);
  for (long t = 1; t <= s.steps; ++t) {
    sgd(m, gradient(m, data<T>(c.rank(), t, s.kind)), static_cast<T>(s.eta));
    sync.step();
  }
  return m.flat();
}

// ---- the serial reference: n replicas in one thread ----------------------------------------

/// The average over replicas of `xs[r]` (one tensor), in rank order, as `allreduce_average`
/// over the thread backend computes it for `wire`.
template <class T>
std::vector<T> reference_average(const std::vector<std::vector<T>>& xs, ddp::outer_wire wire) {
  const std::size_t n = xs.size();
  const std::size_t count = xs[0].size();
  std::vector<T> out(count);
  if (wire == ddp::outer_wire::int8) {
    std::vector<double> scales(n);
    std::vector<std::vector<double>> q(n, std::vector<double>(count));
    for (std::size_t r = 0; r < n; ++r) {
      double amax = 0;
      for (T v : xs[r]) amax = std::max(amax, std::abs(static_cast<double>(v)));
      const float scale = static_cast<float>(amax / 127);
      scales[r] = scale;
      for (std::size_t i = 0; i < count; ++i) {
        q[r][i] = scale > 0 ? std::clamp(std::nearbyint(static_cast<double>(xs[r][i]) / scale), -127.0, 127.0) : 0.0;
      }
    }
    for (std::size_t i = 0; i < count; ++i) {
      double acc = 0;
      for (std::size_t r = 0; r < n; ++r) acc += q[r][i] * scales[r];
      out[i] = static_cast<T>(acc * (1.0 / static_cast<double>(n)));
    }
    return out;
  }
  const T f = static_cast<T>(1.0 / static_cast<double>(n));
  for (std::size_t i = 0; i < count; ++i) {
    if (wire == ddp::outer_wire::bf16) {  // divided, narrowed, summed in f32 in rank order, narrowed
      float acc = 0;
      for (std::size_t r = 0; r < n; ++r) {
        const float v = static_cast<float>(ddp::bfloat16(static_cast<float>(xs[r][i] * f)));
        acc = r == 0 ? v : acc + v;
      }
      out[i] = static_cast<T>(static_cast<float>(ddp::bfloat16(acc)));
    } else {
      T acc = 0;
      for (std::size_t r = 0; r < n; ++r) acc = r == 0 ? xs[r][i] * f : acc + xs[r][i] * f;
      out[i] = acc;
    }
  }
  return out;
}

/// Every replica's parameters after LocalSGD.
template <class T>
std::vector<std::vector<T>> reference_local_sgd(int n, int sync_every, run_setup s) {
  std::vector<model<T>> ms(static_cast<std::size_t>(n), initial<T>(0, s.kind));
  for (long t = 1; t <= s.steps; ++t) {
    for (int r = 0; r < n; ++r) {
      auto& m = ms[static_cast<std::size_t>(r)];
      sgd(m, gradient(m, data<T>(r, t, s.kind)), static_cast<T>(s.eta));
    }
    if (t % sync_every != 0) continue;
    for (std::size_t k = 0; k < 3; ++k) {
      std::vector<std::vector<T>> xs;
      for (auto& m : ms) xs.push_back(*m.tensors()[k]);
      const std::vector<T> avg = reference_average(xs, ddp::outer_wire::native);
      for (auto& m : ms) *m.tensors()[k] = avg;
    }
  }
  std::vector<std::vector<T>> out;
  for (const auto& m : ms) out.push_back(m.flat());
  return out;
}

/// Every replica's parameters after Streaming DiLoCo (DiLoCo: one fragment, no delay, alpha 1).
/// The fragments of the model's three tensors: F = 1 (all), 3 (one each); outer SGD by hand.
template <class T>
std::vector<std::vector<T>> reference_streaming(int n, const ddp::streaming_diloco_options<>& o, run_setup s) {
  const auto nn = static_cast<std::size_t>(n);
  std::vector<model<T>> ms(nn, initial<T>(0, s.kind));
  const std::size_t f_count = static_cast<std::size_t>(o.fragments);
  std::vector<std::vector<std::size_t>> tensors_of = f_count == 1
                                                         ? std::vector<std::vector<std::size_t>>{{0, 1, 2}}
                                                         : std::vector<std::vector<std::size_t>>{{0}, {1}, {2}};
  if (f_count != 1 && f_count != 3) throw std::logic_error("reference_streaming: 1 or 3 fragments");
  model<T> anchor = ms[0];
  model<T> momentum{std::vector<T>(3), std::vector<T>(2), std::vector<T>(1)};
  std::vector<std::vector<std::vector<T>>> pending(3);  // per tensor: the average on its way
  const T lr = static_cast<T>(o.outer.lr);
  const T mu = static_cast<T>(o.outer.momentum);
  const long h = o.sync_every;
  for (long t = 1; t <= s.steps; ++t) {
    for (int r = 0; r < n; ++r) {
      auto& m = ms[static_cast<std::size_t>(r)];
      sgd(m, gradient(m, data<T>(r, t, s.kind)), static_cast<T>(s.eta));
    }
    for (std::size_t f = 0; f < f_count; ++f) {
      const long due = static_cast<long>(f + 1) * (h / o.fragments) % h;
      if ((t + o.delay) % h == due) {
        for (std::size_t k : tensors_of[f]) {
          std::vector<std::vector<T>> deltas;
          for (auto& m : ms) {
            std::vector<T> d(m.tensors()[k]->size());
            for (std::size_t i = 0; i < d.size(); ++i) d[i] = (*anchor.tensors()[k])[i] - (*m.tensors()[k])[i];
            deltas.push_back(d);
          }
          pending[k] = {reference_average(deltas, o.wire)};
        }
      }
      if (t % h != due || pending[tensors_of[f][0]].empty()) continue;
      for (std::size_t k : tensors_of[f]) {
        std::vector<T>& a = *anchor.tensors()[k];
        std::vector<T>& b = *momentum.tensors()[k];
        const std::vector<T>& g = pending[k][0];
        for (std::size_t i = 0; i < a.size(); ++i) {
          T d = g[i];
          if (o.outer.momentum != 0) {
            b[i] = mu * b[i] + d;
            d = o.outer.nesterov ? d + mu * b[i] : b[i];
          }
          a[i] = a[i] - lr * d;
        }
        pending[k].clear();
        for (auto& m : ms) {
          std::vector<T>& p = *m.tensors()[k];
          for (std::size_t i = 0; i < p.size(); ++i) {
            p[i] =
                o.alpha == 1.0
                    ? a[i]
                    : static_cast<T>((1.0 - o.alpha) * static_cast<double>(p[i]) + o.alpha * static_cast<double>(a[i]));
          }
        }
      }
    }
  }
  std::vector<std::vector<T>> out;
  for (const auto& m : ms) out.push_back(m.flat());
  return out;
}

}  // namespace local_steps_cases
