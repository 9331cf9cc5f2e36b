#pragma once
/// @file local_steps/cost_model.hpp
/// @brief When to use which: what synchronous data parallelism, LocalSGD, DiLoCo and Streaming
/// DiLoCo cost per inner step in communication, for a model size, a step time and a link, on top
/// of the allreduce model (`allreduce_model.hpp`). It sees time and bytes, never convergence:
/// docs/local-steps.md, "When to use which", has the guidance and where these modes lose.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/allreduce_model.hpp>
#include <ddp/error.hpp>
#include <ddp/local_steps/outer_exchange.hpp>

namespace ddp {

/// How replicas synchronise, as the cost model sees it.
enum class sync_mode : std::uint8_t {
  data_parallel,     ///< one gradient allreduce per inner step (Bucketer, optionally a bf16 comm hook)
  local_sgd,         ///< `local_sgd`: the parameters averaged every H steps
  diloco,            ///< `diloco`: the outer gradient averaged every H steps, blocking
  streaming_diloco,  ///< `streaming_diloco`: F fragments, each exchange overlapping `delay` inner steps
};

/// "data_parallel", "local_sgd", "diloco", "streaming_diloco".
[[nodiscard]] constexpr std::string_view name_of(sync_mode m) noexcept {
  switch (m) {
    case sync_mode::data_parallel: return "data_parallel";
    case sync_mode::local_sgd: return "local_sgd";
    case sync_mode::diloco: return "diloco";
    case sync_mode::streaming_diloco: return "streaming_diloco";
  }
  return "?";
}

/// A link of `gbit_per_s` (1e9 bits/s, how links are sold) and `latency_ms` one-way latency.
[[nodiscard]] constexpr link_cost gbit_link(double gbit_per_s, double latency_ms) noexcept {
  return link_cost::of(latency_ms * 1e3, gbit_per_s / 8);
}

/// The job whose communication is costed.
struct training_setup {
  double parameters = 0;             ///< parameter count
  int dtype_bytes = 4;               ///< bytes per parameter and per gradient: 4 (f32), 2 (bf16)
  std::size_t tensors = 1;           ///< parameter tensors (the int8 wire sends one 4-byte scale per tensor)
  int replicas = 2;                  ///< ranks that synchronise, one per site: the ranks of the collective
  double compute_s = 0;              ///< seconds of compute in one inner step (forward, backward, optimizer)
  link_cost link = gbit_link(1, 1);  ///< between replicas
  double reduce_us_per_byte = machine_model{}.reduce_us_per_byte;  ///< gamma: summing one byte
};

/// One way of synchronising, with its knobs. A field that does not apply to `mode` is ignored.
struct sync_plan {
  sync_mode mode = sync_mode::diloco;    ///< the component
  int sync_every = 100;                  ///< H (not data_parallel)
  outer_wire wire = outer_wire::native;  ///< data_parallel: native or bf16 (hook); local_sgd: native
  int fragments = 1;                     ///< F (streaming_diloco): must divide `sync_every`
  int delay = 0;                         ///< tau (streaming_diloco), in [0, sync_every / fragments)
  /// data_parallel: the fraction of an inner step's compute that the gradient allreduce can run
  /// under (the backward pass, once the first bucket is ready); 0: none of it is hidden.
  double overlap = 0;
  /// Inner steps this plan needs to reach data parallelism's loss, relative to it (1: no
  /// convergence cost). The model cannot know it: measure it; the ranking multiplies by it.
  double step_factor = 1;
};

/// What one plan costs per inner step, for one `training_setup`.
struct mode_cost {
  sync_plan plan{};               ///< the plan costed
  std::string_view collective{};  ///< the allreduce algorithm the model picks, or "allgather" (int8)
  double exchange_s = 0;          ///< one exchange (streaming: one fragment's)
  double comm_s = 0;              ///< communication per inner step, amortised over H
  double exposed_s = 0;           ///< of it, what the trainer waits for (not under compute)
  double bytes_per_step = 0;      ///< bytes each rank sends per inner step, amortised
  double peak_bytes = 0;          ///< bytes each rank sends in one exchange: the burst the link sees
  double step_s = 0;              ///< compute + exposed
  double utilisation = 1;         ///< compute / step_s
  double effective_step_s = 0;    ///< step_s * plan.step_factor: the ranking key
};

namespace detail {

/// Predicted microseconds of an allgather of `block_bytes` per rank over `ranks` ranks (Bruck's
/// algorithm, Thakur, Rabenseifner and Gropp 2005): `ceil(log2 p)` messages, `p - 1` blocks in.
[[nodiscard]] inline double predicted_allgather_us(double block_bytes, int ranks, const link_cost& link) {
  if (ranks <= 1) return 0.0;
  return std::ceil(log2_of(ranks)) * link.alpha_us + (ranks - 1) * block_bytes * link.us_per_byte;
}

[[noreturn]] inline void bad_plan(const std::string& what) { throw usage_error(-1, "local_steps cost model", what); }

inline void check_cost_inputs(const training_setup& s, const sync_plan& p) {
  if (!(s.parameters >= 1) || !std::isfinite(s.parameters)) bad_plan("parameters must be at least 1");
  if (s.dtype_bytes < 1) bad_plan("dtype_bytes " + std::to_string(s.dtype_bytes) + " must be at least 1");
  if (s.tensors < 1) bad_plan("tensors must be at least 1");
  if (s.replicas < 1) bad_plan("replicas " + std::to_string(s.replicas) + " must be at least 1");
  if (!(s.compute_s >= 0) || !std::isfinite(s.compute_s)) bad_plan("compute_s must be finite and >= 0");
  if (!(s.link.alpha_us >= 0 && s.link.us_per_byte >= 0 && s.reduce_us_per_byte >= 0)) {
    bad_plan("link latency, inverse bandwidth and reduce cost must be >= 0");
  }
  if (!(p.step_factor > 0) || !std::isfinite(p.step_factor)) bad_plan("step_factor must be finite and > 0");
  if (p.mode == sync_mode::data_parallel) {
    if (!(p.overlap >= 0 && p.overlap <= 1)) bad_plan("overlap " + std::to_string(p.overlap) + " is outside [0, 1]");
    if (p.wire == outer_wire::int8) bad_plan("data_parallel: ddp has no int8 gradient hook (native or bf16)");
    return;
  }
  if (p.sync_every < 1) bad_plan("sync_every " + std::to_string(p.sync_every) + " must be at least 1");
  if (p.mode == sync_mode::local_sgd && p.wire != outer_wire::native) {
    bad_plan("local_sgd averages the parameters in their own type: wire must be native");
  }
  if (p.mode != sync_mode::streaming_diloco) return;
  if (p.fragments < 1 || p.sync_every % p.fragments != 0 || static_cast<std::size_t>(p.fragments) > s.tensors) {
    bad_plan(std::to_string(p.fragments) + " fragments with sync_every " + std::to_string(p.sync_every) + " and " +
             std::to_string(s.tensors) + " tensors: need 1 <= fragments <= tensors, and fragments dividing sync_every");
  }
  if (p.delay < 0 || p.delay >= p.sync_every / p.fragments) {
    bad_plan("delay " + std::to_string(p.delay) +
             " is outside [0, sync_every / fragments = " + std::to_string(p.sync_every / p.fragments) + ")");
  }
}

/// One exchange of `elements` values in `tensors` tensors: its time and the bytes each rank sends.
struct exchange_cost {
  std::string_view collective;
  double us = 0;
  double sent_bytes = 0;
};

inline exchange_cost cost_exchange(const training_setup& s, outer_wire wire, double elements, double tensors) {
  const int p = s.replicas;
  if (wire == outer_wire::int8) {  // outer_exchange.hpp: every rank's scales and bytes gathered
    const double block = elements + 4 * tensors;
    const double sum_us = (p - 1) * elements * s.dtype_bytes * s.reduce_us_per_byte;  // dequantize, add
    return {"allgather", p > 1 ? predicted_allgather_us(block, p, s.link) + sum_us : 0.0, (p - 1) * block};
  }
  const double bytes = elements * (wire == outer_wire::bf16 ? std::min(s.dtype_bytes, 2) : s.dtype_bytes);
  // Every replica is its own node: the flat algorithms over the link, the fastest one.
  machine_model m;
  m.network = s.link;
  m.node = s.link;
  m.reduce_us_per_byte = s.reduce_us_per_byte;
  m.ranks_per_node = 1;
  const allreduce_choice c = choose_allreduce(bytes, p, m, flat_allreduce_algorithms);
  // The bandwidth-optimal volume (ring; halving-doubling at a power of two): latency-bound picks
  // such as recursive doubling send more, and are picked only where bytes do not matter.
  return {ddp::name_of(c.algorithm), c.predicted_us, 2.0 * (p - 1) / p * bytes};
}

}  // namespace detail

/// What `plan` costs per inner step on `setup`: one exchange per step (data parallel), one per H
/// steps (LocalSGD, DiLoCo), or F exchanges of 1/F of the parameters per H steps (Streaming
/// DiLoCo), each costed by the allreduce model (`choose_allreduce` over the flat algorithms, one
/// replica per node) or, for the int8 wire, as an allgather. Left out: convergence (`step_factor`
/// is yours), compute slowed by communication, the outer step's own arithmetic, buckets.
/// @throws usage_error on a bad setup or plan (naming the knob)
[[nodiscard]] inline mode_cost cost_of(const training_setup& setup, const sync_plan& plan) {
  detail::check_cost_inputs(setup, plan);
  mode_cost c;
  c.plan = plan;
  const double n = setup.parameters;
  const double c_s = setup.compute_s;
  double exposed_each = 0;  // seconds the trainer waits per exchange
  double per_step = 1;      // exchanges per inner step
  detail::exchange_cost e;
  switch (plan.mode) {
    case sync_mode::data_parallel:
      e = detail::cost_exchange(setup, plan.wire, n, static_cast<double>(setup.tensors));
      exposed_each = std::max(0.0, e.us * 1e-6 - plan.overlap * c_s);
      break;
    case sync_mode::local_sgd:
    case sync_mode::diloco:
      e = detail::cost_exchange(setup, plan.wire, n, static_cast<double>(setup.tensors));
      exposed_each = e.us * 1e-6;  // blocking
      per_step = 1.0 / plan.sync_every;
      break;
    case sync_mode::streaming_diloco: {
      const double f = plan.fragments;
      e = detail::cost_exchange(setup, plan.wire, n / f, std::ceil(static_cast<double>(setup.tensors) / f));
      exposed_each = std::max(0.0, e.us * 1e-6 - plan.delay * c_s);  // under `delay` inner steps
      per_step = f / plan.sync_every;
      break;
    }
  }
  c.collective = e.collective;
  c.exchange_s = e.us * 1e-6;
  c.comm_s = c.exchange_s * per_step;
  c.exposed_s = exposed_each * per_step;
  c.bytes_per_step = e.sent_bytes * per_step;
  c.peak_bytes = e.sent_bytes;
  c.step_s = c_s + c.exposed_s;
  c.utilisation = c.step_s > 0 ? c_s / c.step_s : 1.0;
  c.effective_step_s = c.step_s * plan.step_factor;
  return c;
}

/// Knobs of `candidate_plans`.
struct candidate_options {
  int sync_every = 100;   ///< H of every local-steps plan
  int fragments = 4;      ///< F of the streaming plans
  int delay = 5;          ///< tau of the streaming plans
  double dp_overlap = 0;  ///< `overlap` of the data-parallel plans
};

/// The plans ddp can run, one per mode and wire: data parallel (native, bf16 hook), LocalSGD,
/// DiLoCo (native, bf16, int8), Streaming DiLoCo (native, bf16), in that order.
[[nodiscard]] inline std::vector<sync_plan> candidate_plans(const candidate_options& o = {}) {
  const int h = o.sync_every;
  constexpr outer_wire native = outer_wire::native, bf16 = outer_wire::bf16, int8 = outer_wire::int8;
  return {
      {.mode = sync_mode::data_parallel, .wire = native, .overlap = o.dp_overlap},
      {.mode = sync_mode::data_parallel, .wire = bf16, .overlap = o.dp_overlap},
      {.mode = sync_mode::local_sgd, .sync_every = h},
      {.mode = sync_mode::diloco, .sync_every = h, .wire = native},
      {.mode = sync_mode::diloco, .sync_every = h, .wire = bf16},
      {.mode = sync_mode::diloco, .sync_every = h, .wire = int8},
      {.mode = sync_mode::streaming_diloco,
       .sync_every = h,
       .wire = native,
       .fragments = o.fragments,
       .delay = o.delay},
      {.mode = sync_mode::streaming_diloco, .sync_every = h, .wire = bf16, .fragments = o.fragments, .delay = o.delay}};
}

/// `plans` costed on `setup`, fastest first by `effective_step_s` (ties keep the order given).
/// @throws usage_error on a bad setup or plan
[[nodiscard]] inline std::vector<mode_cost> rank_modes(const training_setup& setup, std::span<const sync_plan> plans) {
  std::vector<mode_cost> out;
  for (const sync_plan& p : plans) out.push_back(cost_of(setup, p));
  std::stable_sort(out.begin(), out.end(),
                   [](const mode_cost& a, const mode_cost& b) { return a.effective_step_s < b.effective_step_s; });
  return out;
}

/// `rank_modes` over `candidate_plans()`.
[[nodiscard]] inline std::vector<mode_cost> rank_modes(const training_setup& setup) {
  const std::vector<sync_plan> plans = candidate_plans();
  return rank_modes(setup, plans);
}

/// A short label: "data_parallel", "data_parallel bf16", "diloco H=100 int8",
/// "streaming_diloco H=100 F=4 tau=5 bf16".
[[nodiscard]] inline std::string describe(const sync_plan& p) {
  std::string s(name_of(p.mode));
  if (p.mode != sync_mode::data_parallel) s += " H=" + std::to_string(p.sync_every);
  if (p.mode == sync_mode::streaming_diloco) {
    s += " F=" + std::to_string(p.fragments) + " tau=" + std::to_string(p.delay);
  }
  if (p.wire != outer_wire::native) s += std::string(" ") + name_of(p.wire);
  return s;
}

}  // namespace ddp
