// A small training run shared by the reproducible-reduction tests (local threads and MPI): an
// MLP trained by SGD on a synthetic regression task, a global batch of M micro-batches per step,
// each rank computing its contiguous share. Two ways to average: the ReproducibleReducer, or the
// default path (local sum of the rank's micro-batches, then the Bucketer's average over ranks).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <ddp/bucketer.hpp>
#include <ddp/communicator.hpp>
#include <ddp/detail/fnv1a.hpp>
#include <ddp/reproducible.hpp>

namespace repro_training {

constexpr std::size_t in_dim = 6, hidden = 16, samples_per_micro = 3;
constexpr float lr = 0.05f;

struct model {
  std::vector<float> w1, b1, w2, b2;      // parameters
  std::vector<float> gw1, gb1, gw2, gb2;  // gradients (registered with the reducer)

  model() : w1(hidden * in_dim), b1(hidden), w2(hidden), b2(1), gw1(w1.size()), gb1(hidden), gw2(hidden), gb2(1) {
    std::mt19937 rng(42);  // the same initial parameters on every rank and at every world size
    std::normal_distribution<float> n(0.0f, 0.4f);
    for (auto& x : w1) x = n(rng);
    for (auto& x : w2) x = n(rng);
  }

  std::vector<std::vector<float>*> params() { return {&w1, &b1, &w2, &b2}; }
  std::vector<std::vector<float>*> grads() { return {&gw1, &gb1, &gw2, &gb2}; }

  // Mean-squared-error gradient of micro-batch `global_index` of step `step` (overwrites the
  // gradients). Depends only on the parameters and the two indices, never on the rank.
  void compute_gradients(std::size_t step, std::size_t global_index) {
    for (auto* g : grads()) std::fill(g->begin(), g->end(), 0.0f);
    std::mt19937_64 rng(0x9e3779b97f4a7c15ull * (step + 1) + global_index);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    const float scale = 1.0f / static_cast<float>(samples_per_micro);
    for (std::size_t s = 0; s < samples_per_micro; ++s) {
      float x[in_dim];
      float target = 0.0f;
      for (std::size_t k = 0; k < in_dim; ++k) {
        x[k] = u(rng);
        target += std::sin(static_cast<float>(k + 1) * x[k]);
      }
      float h[hidden];
      float out = b2[0];
      for (std::size_t j = 0; j < hidden; ++j) {
        float a = b1[j];
        for (std::size_t k = 0; k < in_dim; ++k) a += w1[j * in_dim + k] * x[k];
        h[j] = std::tanh(a);
        out += w2[j] * h[j];
      }
      const float d = (out - target) * scale;  // d loss / d out, loss = mean 0.5 (out - target)^2
      gb2[0] += d;
      for (std::size_t j = 0; j < hidden; ++j) {
        gw2[j] += d * h[j];
        const float dh = d * w2[j] * (1.0f - h[j] * h[j]);
        gb1[j] += dh;
        for (std::size_t k = 0; k < in_dim; ++k) gw1[j * in_dim + k] += dh * x[k];
      }
    }
  }

  void sgd() {
    auto ps = params();
    auto gs = grads();
    for (std::size_t t = 0; t < ps.size(); ++t) {
      for (std::size_t i = 0; i < ps[t]->size(); ++i) (*ps[t])[i] -= lr * (*gs[t])[i];
    }
  }

  // FNV-1a over the bytes of every parameter, as 16 hex digits.
  std::string fingerprint() {
    std::uint64_t h = ddp::detail::fnv1a_offset_basis;
    for (auto* p : params()) h = ddp::detail::fnv1a(std::as_bytes(std::span<const float>(*p)), h);
    char buf[17];
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
    return buf;
  }
};

// `steps` steps of the global batch of `micro_batches` micro-batches with the reproducible reducer.
inline std::string train_reproducible(ddp::communicator_ref comm, std::size_t micro_batches, int steps,
                                      ddp::reproducible_options opts = {}) {
  model m;
  ddp::ReproducibleReducer red(comm, micro_batches, opts);
  for (auto* g : m.grads()) red.add(*g);
  red.build();
  for (int s = 0; s < steps; ++s) {
    red.begin(static_cast<std::uint64_t>(s));
    for (std::size_t i : red.pending()) {
      m.compute_gradients(static_cast<std::size_t>(s), i);
      red.accumulate(i);
    }
    red.finalize();
    m.sgd();
  }
  return m.fingerprint();
}

// The same training the way a default data-parallel trainer does it: each rank sums its
// micro-batches in order, scales the sum so that the Bucketer's average over ranks is the mean
// over the global batch, and the Bucketer averages. Same mathematics, different rounding per DP.
inline std::string train_default(ddp::communicator_ref comm, std::size_t micro_batches, int steps) {
  model m;
  std::vector<std::vector<float>> acc;
  for (auto* g : m.grads()) acc.emplace_back(g->size());
  ddp::Bucketer<> b(comm);
  for (auto& a : acc) b.add(a);
  b.build();
  const ddp::item_range r = ddp::contiguous_share(micro_batches, comm.size(), comm.rank());
  const float weight = static_cast<float>(comm.size()) / static_cast<float>(micro_batches);
  for (int s = 0; s < steps; ++s) {
    for (auto& a : acc) std::fill(a.begin(), a.end(), 0.0f);
    for (std::size_t i = r.first; i < r.last; ++i) {
      m.compute_gradients(static_cast<std::size_t>(s), i);
      auto gs = m.grads();
      for (std::size_t t = 0; t < acc.size(); ++t) {
        for (std::size_t k = 0; k < acc[t].size(); ++k) acc[t][k] += (*gs[t])[k];
      }
    }
    for (auto& a : acc) {
      for (auto& x : a) x *= weight;
    }
    for (std::size_t t = 0; t < acc.size(); ++t) b.mark_ready(t);
    b.finalize();
    auto gs = m.grads();
    for (std::size_t t = 0; t < acc.size(); ++t) *gs[t] = acc[t];
    m.sgd();
  }
  return m.fingerprint();
}

}  // namespace repro_training
