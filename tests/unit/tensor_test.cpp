#include <array>
#include <cmath>
#include <span>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/tensor.hpp>

namespace user {
// A "foreign" tensor the library knows nothing about.
struct Tensor {
  float* ptr = nullptr;
  long numel = 0;
  bool on_gpu = false;
};
}  // namespace user

template <>
struct ddp::tensor_traits<user::Tensor> {
  static void* data(user::Tensor& t) { return t.ptr; }
  static std::size_t size(const user::Tensor& t) { return static_cast<std::size_t>(t.numel); }
  static ddp::dtype dtype(const user::Tensor&) { return ddp::dtype::f32; }
  static ddp::device device(const user::Tensor& t) { return t.on_gpu ? ddp::device::cuda(1) : ddp::device::host(); }
};

struct not_a_tensor {};

TEST_CASE("standard contiguous ranges are tensors with no user code", "[tensor]") {
  STATIC_REQUIRE(ddp::tensor<std::vector<float>>);
  STATIC_REQUIRE(ddp::tensor<std::span<double>>);
  STATIC_REQUIRE(ddp::tensor<std::array<std::int64_t, 4>>);
  STATIC_REQUIRE(ddp::tensor<std::vector<ddp::half>>);
  STATIC_REQUIRE(ddp::tensor<std::vector<ddp::bfloat16>>);
  STATIC_REQUIRE(ddp::tensor<std::vector<long long>>);
  STATIC_REQUIRE(ddp::tensor<user::Tensor>);
  STATIC_REQUIRE_FALSE(ddp::tensor<not_a_tensor>);
  STATIC_REQUIRE_FALSE(ddp::tensor<std::vector<bool>>);       // not contiguous
  STATIC_REQUIRE_FALSE(ddp::tensor<std::vector<std::string>>); // no dtype
  STATIC_REQUIRE_FALSE(ddp::tensor<std::span<const float>>);   // read-only memory

  std::array<std::int64_t, 3> a{1, 2, 3};
  const auto v = ddp::view(a);
  CHECK(v.data == a.data());
  CHECK(v.count == 3);
  CHECK(v.type == ddp::dtype::i64);
  CHECK(v.where == ddp::device::host());
  CHECK(v.bytes() == 24);
  CHECK(v.slice(1, 2).data == a.data() + 1);
}

TEST_CASE("a user tensor type plugs in through tensor_traits", "[tensor]") {
  std::vector<float> storage(7);
  user::Tensor t{storage.data(), 7, true};
  const auto v = ddp::view(t);
  CHECK(v.data == storage.data());
  CHECK(v.count == 7);
  CHECK(v.where == ddp::device::cuda(1));
  CHECK(v.where.str() == "cuda:1");
}

TEST_CASE("dtype sizes and names", "[dtype]") {
  using ddp::dtype;
  for (auto [t, bytes, name] : {std::tuple{dtype::f16, 2u, "f16"}, {dtype::bf16, 2u, "bf16"}, {dtype::f32, 4u, "f32"},
                                {dtype::f64, 8u, "f64"}, {dtype::i8, 1u, "i8"}, {dtype::u8, 1u, "u8"},
                                {dtype::i32, 4u, "i32"}, {dtype::i64, 8u, "i64"}}) {
    CHECK(ddp::size_of(t) == bytes);
    CHECK(ddp::name_of(t) == std::string_view(name));
  }
}

TEST_CASE("half and bfloat16 round-trip and round to nearest even", "[dtype]") {
  for (float f : {0.0f, 1.0f, -2.5f, 65504.0f, 6.103515625e-05f /*min normal*/, 5.9604645e-08f /*min subnormal*/}) {
    CHECK(static_cast<float>(ddp::half(f)) == f);
  }
  CHECK(ddp::half(1.0f).bits == 0x3c00);
  CHECK(ddp::half(-2.0f).bits == 0xc000);
  CHECK(std::isinf(static_cast<float>(ddp::half(1e6f))));
  CHECK(std::isnan(static_cast<float>(ddp::half(std::nanf("")))));
  // 1 + 2^-11 is halfway between 1 and the next half; ties go to even (1.0)
  CHECK(ddp::half(1.0f + 0.00048828125f).bits == 0x3c00);
  CHECK(ddp::half(1.0f + 3 * 0.00048828125f).bits == 0x3c02);
  for (float f : {0.0f, 1.0f, -3.0f, std::ldexp(1.5f, 100)}) CHECK(static_cast<float>(ddp::bfloat16(f)) == f);
  CHECK(ddp::bfloat16(1.0f).bits == 0x3f80);
  // exhaustive: every finite half converts to float and back to the same bits
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    const auto h = static_cast<std::uint16_t>(b);
    const float f = ddp::half::to_float(h);
    if (std::isnan(f)) continue;
    REQUIRE(ddp::half::from_float(f) == h);
  }
}
