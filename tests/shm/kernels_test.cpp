// The shared-memory reduction kernel against the library's scalar definitions: the branch-free
// f16/bf16 conversions give exactly the bits of ddp::half / ddp::bfloat16 (every half, a dense
// sample of floats), and reduce_many matches a rank-order scalar reduction for every dtype,
// operator and input count, with the output aliasing an input and a second output.
#include <catch2/catch.hpp>
#include <ddp/detail/host_reduce.hpp>
#include <ddp/shm/kernels.hpp>

#include <bit>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

namespace k = ddp::shm::detail;

#ifdef DDP_TEST_FMA_BUILD
// Built with -mfma -ffp-contract=fast (tests/shm/CMakeLists.txt): the kernel must not fuse a
// product and a sum in one loop here, or the compiler would round them once, in an FMA.
static_assert(!k::fused_scaling,
              "kernels.hpp must keep the staged pre-multiplied sum where FMA contraction is possible");
namespace {
// Before main: this binary may use FMA instructions anywhere, so a CPU without them skips it.
[[maybe_unused]] const bool cpu_has_fma = [] {
  if (__builtin_cpu_supports("fma") == 0) std::_Exit(77);
  return true;
}();
}  // namespace
#endif

TEST_CASE("shm kernels: f16 and bf16 conversions are bit-exact", "[shm][kernels]") {
  std::size_t wrong = 0;
  for (std::uint32_t h = 0; h <= 0xffff; ++h) {
    const auto bits = static_cast<std::uint16_t>(h);
    wrong +=
        std::bit_cast<std::uint32_t>(k::half_to_float(bits)) != std::bit_cast<std::uint32_t>(ddp::half::to_float(bits));
    wrong += std::bit_cast<std::uint32_t>(k::bfloat_to_float(bits)) !=
             std::bit_cast<std::uint32_t>(ddp::bfloat16::to_float(bits));
  }
  REQUIRE(wrong == 0);
  // Every 251st float bit pattern, plus the boundaries of the half ranges.
  std::vector<std::uint32_t> samples;
  for (std::uint64_t x = 0; x <= 0xffffffffull; x += 251) samples.push_back(static_cast<std::uint32_t>(x));
  for (std::uint32_t edge : {0x38800000u, 0x387fffffu, 0x47800000u, 0x477fffffu, 0x7f800000u, 0x7f800001u, 0x33000000u,
                             0x33000001u, 0x32ffffffu, 0x477fe000u, 0x477fefffu, 0x477ff000u}) {
    for (std::uint32_t sign : {0u, 0x80000000u}) samples.push_back(edge | sign);
  }
  for (std::uint32_t x : samples) {
    const float f = std::bit_cast<float>(x);
    wrong += k::float_to_half(f) != ddp::half::from_float(f);
    wrong += k::float_to_bfloat(f) != ddp::bfloat16::from_float(f);
  }
  REQUIRE(wrong == 0);
}

TEST_CASE("shm kernels: reduce_many matches a scalar reduction in rank order", "[shm][kernels]") {
  const std::vector<ddp::dtype> types{ddp::dtype::f16, ddp::dtype::bf16, ddp::dtype::f32, ddp::dtype::f64,
                                      ddp::dtype::i8,  ddp::dtype::u8,   ddp::dtype::i32, ddp::dtype::i64};
  const std::vector<ddp::reduce_op> ops{ddp::reduce_op::sum, ddp::reduce_op::avg, ddp::reduce_op::min,
                                        ddp::reduce_op::max, ddp::reduce_op::prod};
  for (ddp::dtype t : types) {
    const std::size_t esz = ddp::size_of(t);
    for (ddp::reduce_op op : ops) {
      for (int inputs = 1; inputs <= 5; ++inputs) {
        for (std::size_t n : {std::size_t{1}, std::size_t{15}, std::size_t{17}, std::size_t{1024}, std::size_t{3001}}) {
          std::vector<std::vector<std::byte>> in(static_cast<std::size_t>(inputs), std::vector<std::byte>(n * esz));
          for (int q = 0; q < inputs; ++q) {
            for (std::size_t i = 0; i < n; ++i) {
              const double v =
                  t == ddp::dtype::u8
                      ? static_cast<double>((i + static_cast<std::size_t>(q)) % 3)
                      : static_cast<double>(static_cast<int>((i * 7 + static_cast<std::size_t>(q) * 5) % 5) - 2) +
                            (ddp::is_floating(t) ? 0.375 * q : 0.0);
              ddp::detail::convert(ddp::dtype::f64, &v, t, in[static_cast<std::size_t>(q)].data() + i * esz, 1);
            }
          }
          // Reference: the local backend's way (widen halves to f32, reduce in order, divide, narrow).
          const bool widen = t == ddp::dtype::f16 || t == ddp::dtype::bf16;
          const ddp::dtype acc_t = widen ? ddp::dtype::f32 : t;
          std::vector<std::byte> acc(n * ddp::size_of(acc_t)), tmp(n * ddp::size_of(acc_t));
          ddp::detail::convert(t, in[0].data(), acc_t, acc.data(), n);
          for (int q = 1; q < inputs; ++q) {
            ddp::detail::convert(t, in[static_cast<std::size_t>(q)].data(), acc_t, tmp.data(), n);
            ddp::detail::reduce_into(acc_t, op, acc.data(), tmp.data(), n);
          }
          if (op == ddp::reduce_op::avg) ddp::detail::divide_in_place(acc_t, acc.data(), n, inputs);
          std::vector<std::byte> want(n * esz);
          ddp::detail::convert(acc_t, acc.data(), t, want.data(), n);

          std::vector<const void*> ptrs;
          for (auto& v : in) ptrs.push_back(v.data());
          std::vector<std::byte> second(n * esz);
          const std::size_t alias = static_cast<std::size_t>(inputs - 1);  // write over the last input
          k::reduce_many(t, op, in[alias].data(), second.data(), ptrs.data(), inputs, n, inputs);
          INFO(ddp::name_of(t) << " " << ddp::name_of(op) << " inputs=" << inputs << " n=" << n);
          REQUIRE(std::memcmp(in[alias].data(), want.data(), want.size()) == 0);
          REQUIRE(std::memcmp(second.data(), want.data(), want.size()) == 0);
        }
      }
    }
  }
}

TEST_CASE("shm kernels: a pre-multiplied sum gives the bits of scaling every input, then summing", "[shm][kernels]") {
  const std::vector<ddp::dtype> types{ddp::dtype::f16, ddp::dtype::bf16, ddp::dtype::f32, ddp::dtype::f64,
                                      ddp::dtype::i32};
  for (ddp::dtype t : types) {
    const std::size_t esz = ddp::size_of(t);
    for (int inputs = 1; inputs <= 5; ++inputs) {
      const double factor = 1.0 / (inputs + 2);  // not a power of two: every product rounds
      for (std::size_t n : {std::size_t{1}, std::size_t{17}, std::size_t{1024}, std::size_t{3001}}) {
        std::vector<std::vector<std::byte>> in(static_cast<std::size_t>(inputs), std::vector<std::byte>(n * esz));
        auto scaled = in;
        for (int q = 0; q < inputs; ++q) {
          for (std::size_t i = 0; i < n; ++i) {
            const double v = static_cast<double>(static_cast<int>((i * 7 + static_cast<std::size_t>(q) * 5) % 11) - 5) +
                             (ddp::is_floating(t) ? 0.3 * q + 0.01 * static_cast<double>(i % 13) : 0.0);
            ddp::detail::convert(ddp::dtype::f64, &v, t, in[static_cast<std::size_t>(q)].data() + i * esz, 1);
          }
          scaled[static_cast<std::size_t>(q)] = in[static_cast<std::size_t>(q)];
          ddp::detail::scale_in_place(t, scaled[static_cast<std::size_t>(q)].data(), n, factor);
        }
        std::vector<const void*> raw_ptrs, scaled_ptrs;
        for (auto& v : in) raw_ptrs.push_back(v.data());
        for (auto& v : scaled) scaled_ptrs.push_back(v.data());
        std::vector<std::byte> want(n * esz), got(n * esz);
        k::reduce_many(t, ddp::reduce_op::sum, want.data(), nullptr, scaled_ptrs.data(), inputs, n, 1);
        k::reduce_many(t, ddp::reduce_op::sum, got.data(), nullptr, raw_ptrs.data(), inputs, n, 1, factor);
        INFO(ddp::name_of(t) << " inputs=" << inputs << " n=" << n);
        // Integers ignore the factor (scale_in_place leaves them alone too).
        REQUIRE(std::memcmp(got.data(), want.data(), want.size()) == 0);
        // In place (the output is the last input, as a rank reducing its own slice), with a
        // second output: the same bits in both.
        auto last = in.back();
        std::vector<std::byte> second(n * esz);
        raw_ptrs.back() = last.data();
        k::reduce_many(t, ddp::reduce_op::sum, last.data(), second.data(), raw_ptrs.data(), inputs, n, 1, factor);
        REQUIRE(std::memcmp(last.data(), want.data(), want.size()) == 0);
        REQUIRE(std::memcmp(second.data(), want.data(), want.size()) == 0);
      }
    }
  }
}

TEST_CASE("shm and host kernels: integer sums and products wrap around, the same in both", "[shm][kernels]") {
  // Signed overflow is undefined in C++; both kernels compute in the unsigned type, so an
  // overflowing sum gives two's complement bits (what MPI and NCCL give in practice) and UBSan,
  // which runs these tests in CI, has nothing to report.
  const std::int32_t i32max = std::numeric_limits<std::int32_t>::max();
  const std::int64_t i64max = std::numeric_limits<std::int64_t>::max();
  for (ddp::reduce_op op : {ddp::reduce_op::sum, ddp::reduce_op::prod}) {
    std::vector<std::int32_t> a(37, i32max), b(37, op == ddp::reduce_op::sum ? 1 : 3);
    std::vector<std::int64_t> c(37, i64max), d(37, op == ddp::reduce_op::sum ? 2 : 5);
    const std::int32_t want32 = op == ddp::reduce_op::sum ? std::numeric_limits<std::int32_t>::min() : 2147483645;
    const std::int64_t want64 =
        op == ddp::reduce_op::sum ? std::numeric_limits<std::int64_t>::min() + 1 : 9223372036854775803;
    INFO(ddp::name_of(op));
    std::vector<std::int32_t> out32(a.size());
    std::vector<std::int64_t> out64(c.size());
    const void* in32[] = {a.data(), b.data()};
    const void* in64[] = {c.data(), d.data()};
    k::reduce_many(ddp::dtype::i32, op, out32.data(), nullptr, in32, 2, a.size(), 1);
    k::reduce_many(ddp::dtype::i64, op, out64.data(), nullptr, in64, 2, c.size(), 1);
    CHECK(out32.front() == want32);
    CHECK(out32.back() == want32);
    CHECK(out64.front() == want64);
    CHECK(out64.back() == want64);
    ddp::detail::reduce_into(ddp::dtype::i32, op, a.data(), b.data(), a.size());
    ddp::detail::reduce_into(ddp::dtype::i64, op, c.data(), d.data(), c.size());
    CHECK(a == out32);
    CHECK(c == out64);
    // One-byte integers: 127 + 1 and 127 * 3 wrap; 255 + 2 and 255 * 3 too.
    std::vector<std::int8_t> e(19, 127), f(19, op == ddp::reduce_op::sum ? 1 : 3), out8(19);
    std::vector<std::uint8_t> g(19, 255), h(19, op == ddp::reduce_op::sum ? 2 : 3), outu8(19);
    const void* in8[] = {e.data(), f.data()};
    const void* inu8[] = {g.data(), h.data()};
    k::reduce_many(ddp::dtype::i8, op, out8.data(), nullptr, in8, 2, e.size(), 1);
    k::reduce_many(ddp::dtype::u8, op, outu8.data(), nullptr, inu8, 2, g.size(), 1);
    CHECK(out8.back() == (op == ddp::reduce_op::sum ? std::int8_t{-128} : std::int8_t{125}));
    CHECK(outu8.back() == (op == ddp::reduce_op::sum ? std::uint8_t{1} : std::uint8_t{253}));
    ddp::detail::reduce_into(ddp::dtype::i8, op, e.data(), f.data(), e.size());
    ddp::detail::reduce_into(ddp::dtype::u8, op, g.data(), h.data(), g.size());
    CHECK(e == out8);
    CHECK(g == outu8);
  }
}
