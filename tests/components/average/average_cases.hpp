#pragma once
// ddp's one averaging rule (ddp/average.hpp), checked across every component that averages:
// the Bucketer (copy path, zero-copy, an explicitly registered default hook, the compression
// hooks' pass-through), the BufferReducer's allreduce_mean, allreduce_average itself, and (in
// the thread-backend test) the Manager's comm hook. Written once against communicator_ref and
// run over threads, MPI processes and the shared-memory backend. Failures throw
// suite::suite_failure (see collective_suite.hpp).
//
// The inputs sit near f16's largest value (65504) on every rank: a sum before the division would
// be infinite. Every caller must give finite values close to the true mean, and the same bits as
// every other caller (one gradient, one bucket, one buffer: the same layout for all).

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <ddp/average.hpp>
#include <ddp/buffer_reducer.hpp>
#include <ddp/bucketer.hpp>
#include <ddp/bucketing/fixed.hpp>
#include <ddp/hooks/allreduce_average.hpp>
#include <ddp/hooks/compress.hpp>
#include <ddp/strategies/allreduce.hpp>

#include "../../common/collective_suite.hpp"

namespace average_cases {

using suite::buffer;

inline constexpr std::size_t elements = 1000;

// Rank r's element k. Even k: near f16's maximum (multiples of 32 from 59904 to 60160, exact in
// f16), so any sum of two is out of f16's range. Odd k: small values with fractions that are not
// exact after a division by 3, so the order of rounding shows in the bits.
inline double value(int r, std::size_t k) {
  if (k % 2 == 0) return 59904.0 + 32.0 * static_cast<double>((static_cast<std::size_t>(r) * 5 + k) % 9);
  return 0.1 * static_cast<double>((static_cast<std::size_t>(r) * 3 + k) % 11) + 1.0 / 3.0;
}

inline void fill(buffer& b, int rank) {
  for (std::size_t k = 0; k < b.count(); ++k) b.set(k, value(rank, k));
}

inline buffer inputs(ddp::dtype t, int rank) {
  buffer b(t, elements);
  fill(b, rank);
  return b;
}

// The true mean of what the ranks hold (their inputs after rounding to the dtype).
inline double true_mean(ddp::dtype t, int size, std::size_t k) {
  double sum = 0;
  for (int r = 0; r < size; ++r) {
    buffer one(t, 1);
    one.set(0, value(r, k));
    sum += one.get(0);
  }
  return sum / size;
}

// Finite and within a few roundings of the dtype of the true mean.
inline void expect_mean(const buffer& got, int size, const std::string& where) {
  const double eps = got.type == ddp::dtype::f16 ? 0x1p-10 : got.type == ddp::dtype::bf16 ? 0x1p-7 : 0x1p-22;
  for (std::size_t k = 0; k < got.count(); ++k) {
    const double g = got.get(k), want = true_mean(got.type, size, k);
    SUITE_EXPECT(std::isfinite(g), where << ": element " << k << " is " << g << " (want " << want << ")");
    SUITE_EXPECT(std::abs(g - want) <= 2.0 * (size + 1) * eps * std::abs(want),
                 where << ": element " << k << " is " << g << ", want " << want);
  }
}

inline void expect_same_bits(const buffer& got, const buffer& reference, const std::string& where) {
  for (std::size_t k = 0; k < got.count(); ++k) {
    const std::size_t w = ddp::size_of(got.type);
    SUITE_EXPECT(std::memcmp(got.bytes.data() + k * w, reference.bytes.data() + k * w, w) == 0,
                 where << ": element " << k << " is " << got.get(k) << ", allreduce_average gave " << reference.get(k)
                       << " (different bits)");
  }
}

// One averaging caller: takes this rank's inputs, returns the average it computed.
using caller = std::function<buffer(ddp::communicator_ref, ddp::dtype)>;

// The Bucketer over `comm` with one gradient; `configure` may register a hook.
inline buffer through_bucketer(ddp::communicator_ref comm, ddp::dtype t, bool zero_copy,
                               const std::function<void(ddp::Bucketer<ddp::bucketing::fixed>&)>& configure = {}) {
  buffer g = inputs(t, comm.rank());
  ddp::Bucketer<ddp::bucketing::fixed> b(comm, {}, {.zero_copy = zero_copy});
  b.add(g.view());
  if (configure) configure(b);
  b.build();
  for (int step = 0; step < 2; ++step) {  // twice: the second step reuses everything
    fill(g, comm.rank());                 // in place: the Bucketer holds a view of g
    if (zero_copy) std::memcpy(b.gradient_view(0).data, g.bytes.data(), g.bytes.size());
    b.mark_ready(0);
    b.finalize();
    if (zero_copy) std::memcpy(g.bytes.data(), b.gradient_view(0).data, g.bytes.size());
  }
  return g;
}

inline std::vector<std::pair<std::string, caller>> callers() {
  return {
      {"Bucketer (copy path)", [](ddp::communicator_ref c, ddp::dtype t) { return through_bucketer(c, t, false); }},
      {"Bucketer (zero-copy)", [](ddp::communicator_ref c, ddp::dtype t) { return through_bucketer(c, t, true); }},
      {"Bucketer + hooks::allreduce_average",
       [](ddp::communicator_ref c, ddp::dtype t) {
         return through_bucketer(c, t, false, [](auto& b) { b.register_comm_hook(ddp::hooks::allreduce_average{}); });
       }},
      {"Bucketer + compress hook of the bucket's own type",
       [](ddp::communicator_ref c, ddp::dtype t) {
         return through_bucketer(c, t, false, [t](auto& b) {
           if (t == ddp::dtype::bf16) {
             b.register_comm_hook(ddp::hooks::bf16_compress{});
           } else {
             b.register_comm_hook(ddp::hooks::fp16_compress{});  // f32: a real compression, skipped below
           }
         });
       }},
      {"BufferReducer<allreduce_mean>",
       [](ddp::communicator_ref c, ddp::dtype t) {
         buffer m = inputs(t, c.rank());
         ddp::BufferReducer<ddp::strategies::allreduce_mean> buffers(c);
         buffers.add(m.view());
         buffers.build();
         buffers.sync();
         return m;
       }},
  };
}

// Every caller over `comm`, for f16, bf16 and f32, against allreduce_average itself.
inline void every_caller_same_bits(ddp::communicator_ref comm, const std::string& backend,
                                   const std::vector<std::pair<std::string, caller>>& extra = {}) {
  auto all = callers();
  all.insert(all.end(), extra.begin(), extra.end());
  for (ddp::dtype t : {ddp::dtype::f16, ddp::dtype::bf16, ddp::dtype::f32}) {
    buffer reference = inputs(t, comm.rank());
    ddp::allreduce_average(comm, reference.view(), comm.size()).wait();
    const std::string on =
        backend + ", " + std::string(ddp::name_of(t)) + ", " + std::to_string(comm.size()) + " ranks";
    expect_mean(reference, comm.size(), "allreduce_average on " + on);
    suite::expect_same_bits_everywhere(comm, reference, "allreduce_average on " + on);
    for (const auto& [name, run] : all) {
      if (t == ddp::dtype::f32 && name.find("compress") != std::string::npos) continue;  // narrows on purpose
      const buffer got = run(comm, t);
      expect_same_bits(got, reference, name + " on " + on);
    }
  }
}

// The backend's own avg sums first: what the rule avoids. Over 2+ ranks, f16 near 60000 must
// overflow there (documents why the rule divides first; if a backend ever accumulates in f32,
// this case says so and the rule may take the fast path for it).
inline bool backend_avg_overflows_f16(ddp::communicator_ref comm) {
  buffer b = inputs(ddp::dtype::f16, comm.rank());
  ddp::tensor_view v = b.view();
  comm.allreduce(v, ddp::reduce_op::avg).wait();
  for (std::size_t k = 0; k < b.count(); ++k) {
    if (!std::isfinite(b.get(k))) return true;
  }
  return false;
}

// Integers: the sum, then a division toward zero, both through the backend's avg (divisor = size)
// and through a sum and a division (divisor < size), e.g. in a join round.
inline void integers_truncate(ddp::communicator_ref comm) {
  for (int divisor : {comm.size(), std::max(1, comm.size() - 1)}) {
    std::vector<std::int32_t> v(10);
    for (std::size_t k = 0; k < v.size(); ++k) v[k] = static_cast<std::int32_t>(k) * 7 + comm.rank() - 20;
    ddp::allreduce_average(comm, ddp::tensor_view{v.data(), v.size(), ddp::dtype::i32, ddp::device::host()}, divisor)
        .wait();
    for (std::size_t k = 0; k < v.size(); ++k) {
      std::int64_t sum = 0;
      for (int r = 0; r < comm.size(); ++r) sum += static_cast<std::int64_t>(k) * 7 + r - 20;
      SUITE_EXPECT(v[k] == sum / divisor, "integer average over " << divisor << " of " << comm.size()
                                                                  << " ranks: " << v[k] << " != " << sum / divisor);
    }
  }
}

inline void bad_divisor(ddp::communicator_ref comm) {
  std::vector<float> v(4, 1.0f);
  bool threw = false;
  try {
    (void)ddp::allreduce_average(comm, ddp::tensor_view{v.data(), v.size(), ddp::dtype::f32, ddp::device::host()}, 0,
                                 ddp::average_input::raw, "test caller");
  } catch (const ddp::usage_error& e) {
    threw = std::string(e.what()).find("test caller") != std::string::npos &&
            std::string(e.what()).find("at least 1") != std::string::npos;
  }
  SUITE_EXPECT(threw, "a divisor of 0 must raise usage_error naming the caller");
}

inline void run_all(ddp::communicator_ref comm, const std::string& backend,
                    const std::vector<std::pair<std::string, caller>>& extra = {}) {
  every_caller_same_bits(comm, backend, extra);
  integers_truncate(comm);
  bad_divisor(comm);
}

}  // namespace average_cases
