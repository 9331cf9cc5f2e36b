// The local-steps cost model: its arithmetic at points worked out by hand, and the properties a
// user relies on when choosing a mode (DiLoCo's bytes fall as 1/H, bf16 halves f32's bytes,
// Streaming DiLoCo's peak is 1/F of DiLoCo's, on a fast link data parallelism loses nothing).
#include <catch2/catch.hpp>

#include <ddp/local_steps.hpp>

using ddp::outer_wire;
using ddp::sync_mode;

namespace {

// 1e8 f32 parameters (400 MB) in 10 tensors, 4 replicas, 1 s of compute per step, a link of
// 1 ms and 1 GB/s, summing free: round numbers, so every value below is worked out by hand.
// An allreduce of n bytes over 4 ranks (ranks_per_node 1, so every algorithm uses the link):
//   recursive doubling 2 (a + n b), halving-doubling 4 a + 1.5 n b,
//   ring 6 s a + 1.5 n b (s = ceil(n / 4 / 4 MiB) segments), binomial tree 4 (a + n b).
ddp::training_setup round_setup() {
  return {.parameters = 1e8,
          .dtype_bytes = 4,
          .tensors = 10,
          .replicas = 4,
          .compute_s = 1.0,
          .link = ddp::link_cost::of(1000.0, 1.0),  // us_per_byte = 1e-3
          .reduce_us_per_byte = 0};
}

}  // namespace

TEST_CASE("cost model: data parallel, by hand", "[unit][local_steps][model]") {
  const auto s = round_setup();
  // 4e8 bytes: halving-doubling 4000 + 6e5 us beats recursive doubling 802000 and the ring's
  // 144000 (24 segments) + 6e5.
  const auto dp = ddp::cost_of(s, {.mode = sync_mode::data_parallel});
  CHECK(dp.collective == "halving_doubling");
  CHECK(dp.exchange_s == Approx(0.604));
  CHECK(dp.comm_s == Approx(0.604));
  CHECK(dp.exposed_s == Approx(0.604));
  CHECK(dp.bytes_per_step == Approx(6e8));  // 2 (p - 1) / p of 4e8
  CHECK(dp.peak_bytes == Approx(6e8));
  CHECK(dp.step_s == Approx(1.604));
  CHECK(dp.utilisation == Approx(1.0 / 1.604));
  CHECK(dp.effective_step_s == Approx(1.604));

  // Half of the step's compute can hide it: 0.5 s of the 0.604 s are under the backward pass.
  const auto overlapped = ddp::cost_of(s, {.mode = sync_mode::data_parallel, .overlap = 0.5});
  CHECK(overlapped.comm_s == Approx(0.604));
  CHECK(overlapped.exposed_s == Approx(0.104));
  // All of it: nothing exposed.
  CHECK(ddp::cost_of(s, {.mode = sync_mode::data_parallel, .overlap = 0.7}).exposed_s == 0.0);

  // The bf16 hook: 2e8 bytes, halving-doubling 4000 + 3e5 us.
  const auto bf16 = ddp::cost_of(s, {.mode = sync_mode::data_parallel, .wire = outer_wire::bf16});
  CHECK(bf16.exchange_s == Approx(0.304));
  CHECK(bf16.bytes_per_step == Approx(3e8));
}

TEST_CASE("cost model: LocalSGD, DiLoCo and Streaming DiLoCo, by hand", "[unit][local_steps][model]") {
  const auto s = round_setup();
  const auto diloco = ddp::cost_of(s, {.mode = sync_mode::diloco, .sync_every = 100});
  CHECK(diloco.exchange_s == Approx(0.604));  // the same allreduce as data parallel's, once per 100 steps
  CHECK(diloco.comm_s == Approx(0.00604));
  CHECK(diloco.exposed_s == Approx(0.00604));  // blocking
  CHECK(diloco.bytes_per_step == Approx(6e6));
  CHECK(diloco.peak_bytes == Approx(6e8));
  CHECK(diloco.utilisation == Approx(1.0 / 1.00604));
  // LocalSGD averages the parameters: the same bytes as DiLoCo's native outer gradients.
  const auto local = ddp::cost_of(s, {.mode = sync_mode::local_sgd, .sync_every = 100});
  CHECK(local.comm_s == diloco.comm_s);
  CHECK(local.bytes_per_step == diloco.bytes_per_step);

  // int8: an allgather of 1e8 bytes plus 10 scales per rank: ceil(log2 4) a + 3 block b.
  const auto int8 = ddp::cost_of(s, {.mode = sync_mode::diloco, .sync_every = 100, .wire = outer_wire::int8});
  const double block = 1e8 + 40;
  CHECK(int8.collective == "allgather");
  CHECK(int8.exchange_s == Approx((2 * 1000 + 3 * block * 1e-3) * 1e-6));
  CHECK(int8.bytes_per_step == Approx(3 * block / 100));
  CHECK(int8.peak_bytes == Approx(3 * block));

  // Streaming, F = 4: 1e8-byte fragments, halving-doubling 4000 + 1.5e5 us = 0.154 s each, four
  // of them per 100 steps. With tau = 5 they run under 5 s of compute: nothing exposed.
  const ddp::sync_plan streaming{.mode = sync_mode::streaming_diloco, .sync_every = 100, .fragments = 4, .delay = 5};
  const auto st = ddp::cost_of(s, streaming);
  CHECK(st.exchange_s == Approx(0.154));
  CHECK(st.comm_s == Approx(4 * 0.154 / 100));
  CHECK(st.exposed_s == 0.0);
  CHECK(st.utilisation == 1.0);
  CHECK(st.bytes_per_step == Approx(diloco.bytes_per_step));
  CHECK(st.peak_bytes == Approx(diloco.peak_bytes / 4));
  // tau = 0: the exchange blocks, as DiLoCo's does (plus three more latencies).
  auto blocking = streaming;
  blocking.delay = 0;
  CHECK(ddp::cost_of(s, blocking).exposed_s == Approx(4 * 0.154 / 100));
  // 10 ms of compute per step: 5 steps hide 0.05 s of each 0.154 s exchange.
  auto fast_compute = s;
  fast_compute.compute_s = 0.01;
  CHECK(ddp::cost_of(fast_compute, streaming).exposed_s == Approx(4 * 0.104 / 100));
}

TEST_CASE("cost model: bytes fall as 1/H, bf16 halves f32, int8 wins below eight ranks", "[unit][local_steps][model]") {
  auto s = round_setup();
  const double per_exchange = ddp::cost_of(s, {.mode = sync_mode::diloco, .sync_every = 1}).bytes_per_step;
  for (int h : {1, 2, 10, 100, 500, 1000}) {
    const auto c = ddp::cost_of(s, {.mode = sync_mode::diloco, .sync_every = h});
    CHECK(c.bytes_per_step * h == Approx(per_exchange));
    CHECK(c.peak_bytes == Approx(per_exchange));
    CHECK(c.comm_s * h == Approx(c.exchange_s));
  }
  for (int p : {2, 3, 4, 8, 64}) {
    s.replicas = p;
    for (const sync_mode m : {sync_mode::data_parallel, sync_mode::diloco}) {
      const auto native = ddp::cost_of(s, {.mode = m, .wire = outer_wire::native});
      const auto bf16 = ddp::cost_of(s, {.mode = m, .wire = outer_wire::bf16});
      CHECK(bf16.bytes_per_step == Approx(native.bytes_per_step / 2));
      CHECK(bf16.comm_s < native.comm_s);
    }
    // int8 gathers p - 1 one-byte blocks; an f32 allreduce sends 8 (p - 1) / p bytes per value.
    const auto native = ddp::cost_of(s, {.mode = sync_mode::diloco, .wire = outer_wire::native});
    const auto int8 = ddp::cost_of(s, {.mode = sync_mode::diloco, .wire = outer_wire::int8});
    CHECK((int8.bytes_per_step < native.bytes_per_step) == (p < 8));
  }
  // bf16 parameters: the bf16 wire sends what the native one does.
  s.dtype_bytes = 2;
  CHECK(ddp::cost_of(s, {.mode = sync_mode::diloco, .wire = outer_wire::bf16}).bytes_per_step ==
        ddp::cost_of(s, {.mode = sync_mode::diloco, .wire = outer_wire::native}).bytes_per_step);
}

TEST_CASE("cost model: more bandwidth never costs more; one replica costs nothing", "[unit][local_steps][model]") {
  auto s = round_setup();
  for (const auto& plan : ddp::candidate_plans({.sync_every = 100, .fragments = 4, .delay = 5})) {
    double last = 1e300;
    for (double gbit : {0.1, 1.0, 10.0, 100.0, 1000.0}) {
      s.link = ddp::gbit_link(gbit, 1.0);
      const auto c = ddp::cost_of(s, plan);
      INFO(ddp::describe(plan) << " at " << gbit << " Gbit/s");
      CHECK(c.step_s <= last);
      CHECK(c.exposed_s <= c.comm_s);
      CHECK(c.utilisation > 0);
      CHECK(c.utilisation <= 1);
      last = c.step_s;
    }
  }
  s.replicas = 1;
  for (const auto& c : ddp::rank_modes(s)) {
    CHECK(c.comm_s == 0.0);
    CHECK(c.bytes_per_step == 0.0);
    CHECK(c.utilisation == 1.0);
  }
}

TEST_CASE("cost model: the ranking, on a slow link and on a fast one", "[unit][local_steps][model]") {
  // 1B bf16 parameters, 8 replicas, 1 s per step.
  ddp::training_setup s{.parameters = 1e9, .dtype_bytes = 2, .tensors = 200, .replicas = 8, .compute_s = 1.0};

  // 1 Gbit/s: data parallelism waits ~28 s per step and ranks last; a local-steps mode ranks first.
  s.link = ddp::gbit_link(1, 10);
  const auto slow = ddp::rank_modes(s);
  REQUIRE(slow.size() == ddp::candidate_plans().size());
  CHECK(slow.front().plan.mode != sync_mode::data_parallel);
  CHECK(slow.back().plan.mode == sync_mode::data_parallel);
  CHECK(slow.back().utilisation < 0.05);
  for (std::size_t i = 1; i < slow.size(); ++i) CHECK(slow[i - 1].effective_step_s <= slow[i].effective_step_s);

  // 400 Gbit/s with the backward pass hiding the allreduce: data parallelism exposes nothing, so
  // local steps can only tie on time, and lose as soon as they need more steps for the same loss
  // (which the model cannot see: the caller says so with step_factor).
  s.link = ddp::gbit_link(400, 0.005);
  auto plans = ddp::candidate_plans({.dp_overlap = 0.6});
  const auto fast_ties = ddp::rank_modes(s, plans);
  CHECK(fast_ties.front().plan.mode == sync_mode::data_parallel);
  CHECK(fast_ties.front().utilisation == 1.0);
  for (auto& p : plans) {
    if (p.mode != sync_mode::data_parallel) p.step_factor = 1.05;
  }
  const auto fast = ddp::rank_modes(s, plans);
  CHECK(fast[0].plan.mode == sync_mode::data_parallel);
  CHECK(fast[1].plan.mode == sync_mode::data_parallel);
  // Even without overlap data parallel computes for over 3/4 of its step there: the 2 GB allreduce
  // costs 0.07 s on the wire and 0.22 s summing (8 GB/s), against 1 s of compute.
  const auto no_overlap = ddp::cost_of(s, {.mode = sync_mode::data_parallel, .wire = outer_wire::bf16});
  CHECK(no_overlap.utilisation == Approx(1 / (1 + (6 * 5 + 1.75 * 2e9 / 5e4 + 0.875 * 2e9 / 8e3) * 1e-6)));
  CHECK(no_overlap.utilisation > 0.75);
}

TEST_CASE("cost model: bad knobs are usage errors that name them", "[unit][local_steps][model]") {
  const auto s = round_setup();
  auto fails_with = [&](ddp::training_setup setup, ddp::sync_plan plan, const char* what) {
    INFO(what);
    CHECK_THROWS_WITH(ddp::cost_of(setup, plan), Catch::Contains(what));
    CHECK_THROWS_AS(ddp::cost_of(setup, plan), ddp::usage_error);
  };
  fails_with(s, {.mode = sync_mode::diloco, .sync_every = 0}, "sync_every 0");
  fails_with(s, {.mode = sync_mode::local_sgd, .wire = outer_wire::bf16}, "wire must be native");
  fails_with(s, {.mode = sync_mode::data_parallel, .wire = outer_wire::int8}, "no int8 gradient hook");
  fails_with(s, {.mode = sync_mode::data_parallel, .overlap = 1.5}, "overlap");
  fails_with(s, {.mode = sync_mode::streaming_diloco, .sync_every = 10, .fragments = 3}, "fragments dividing");
  fails_with(s, {.mode = sync_mode::streaming_diloco, .sync_every = 100, .fragments = 20}, "fragments <= tensors");
  fails_with(s, {.mode = sync_mode::streaming_diloco, .sync_every = 100, .fragments = 4, .delay = 25},
             "delay 25 is outside [0, sync_every / fragments = 25)");
  fails_with(s, {.mode = sync_mode::diloco, .step_factor = 0}, "step_factor");
  auto no_ranks = s;
  no_ranks.replicas = 0;
  fails_with(no_ranks, {}, "replicas 0");
  auto empty = s;
  empty.parameters = 0;
  fails_with(empty, {}, "parameters");
  CHECK(ddp::describe({.mode = sync_mode::streaming_diloco,
                       .sync_every = 100,
                       .wire = outer_wire::bf16,
                       .fragments = 4,
                       .delay = 5}) == "streaming_diloco H=100 F=4 tau=5 bf16");
  CHECK(ddp::describe({.mode = sync_mode::data_parallel}) == "data_parallel");
}
