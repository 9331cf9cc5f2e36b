#include <array>
#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/error.hpp>
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

namespace fake {
// Models at::Tensor: copies share one storage, data() is const and returns a mutable pointer,
// numel() is signed (and negative when the test says so).
struct handle {
  std::shared_ptr<std::vector<float>> storage = std::make_shared<std::vector<float>>(3);
  std::int64_t numel_override = -1;  // >= 0 or the test's negative value: what numel() reports
  bool override_numel = false;
  [[nodiscard]] float* data() const { return storage->data(); }
  [[nodiscard]] std::int64_t numel() const {
    return override_numel ? numel_override : static_cast<std::int64_t>(storage->size());
  }
};
// The naive traits of the same handle: data() needs a non-const reference.
struct mutable_only {
  std::vector<float> v = std::vector<float>(2);
};
// Other element-count types.
struct int_sized {
  std::vector<double> v = std::vector<double>(5);
};
struct bool_sized {};
struct double_sized {};
}  // namespace fake

template <>
struct ddp::tensor_traits<fake::handle> {
  static constexpr bool is_handle = true;
  static void* data(const fake::handle& t) { return t.data(); }
  static std::int64_t size(const fake::handle& t) { return t.numel(); }
  static ddp::dtype dtype(const fake::handle&) { return ddp::dtype::f32; }
  static ddp::device device(const fake::handle&) { return ddp::device::host(); }
};
template <>
struct ddp::tensor_traits<fake::mutable_only> {
  static void* data(fake::mutable_only& t) { return t.v.data(); }
  static std::size_t size(const fake::mutable_only& t) { return t.v.size(); }
  static ddp::dtype dtype(const fake::mutable_only&) { return ddp::dtype::f32; }
  static ddp::device device(const fake::mutable_only&) { return ddp::device::host(); }
};
template <>
struct ddp::tensor_traits<fake::int_sized> {
  static void* data(fake::int_sized& t) { return t.v.data(); }
  static int size(const fake::int_sized& t) { return static_cast<int>(t.v.size()); }
  static ddp::dtype dtype(const fake::int_sized&) { return ddp::dtype::f64; }
  static ddp::device device(const fake::int_sized&) { return ddp::device::host(); }
};
template <>
struct ddp::tensor_traits<fake::bool_sized> {
  static void* data(fake::bool_sized&) { return nullptr; }
  static bool size(const fake::bool_sized&) { return false; }
  static ddp::dtype dtype(const fake::bool_sized&) { return ddp::dtype::f32; }
  static ddp::device device(const fake::bool_sized&) { return ddp::device::host(); }
};
template <>
struct ddp::tensor_traits<fake::double_sized> {
  static void* data(fake::double_sized&) { return nullptr; }
  static double size(const fake::double_sized&) { return 0.0; }
  static ddp::dtype dtype(const fake::double_sized&) { return ddp::dtype::f32; }
  static ddp::device device(const fake::double_sized&) { return ddp::device::host(); }
};

namespace {
// True if ddp::view accepts an lvalue of T (the concept must accept exactly what compiles).
template <class T>
constexpr bool viewable = requires(T& t) {
  { ddp::view(t) } -> std::same_as<ddp::tensor_view>;
}
&&ddp::tensor<T>;
}  // namespace

TEST_CASE("standard contiguous ranges are tensors with no user code", "[tensor]") {
  STATIC_REQUIRE(ddp::tensor<std::vector<float>>);
  STATIC_REQUIRE(ddp::tensor<std::span<double>>);
  STATIC_REQUIRE(ddp::tensor<std::array<std::int64_t, 4>>);
  STATIC_REQUIRE(ddp::tensor<std::vector<ddp::half>>);
  STATIC_REQUIRE(ddp::tensor<std::vector<ddp::bfloat16>>);
  STATIC_REQUIRE(ddp::tensor<std::vector<long long>>);
  STATIC_REQUIRE(ddp::tensor<user::Tensor>);
  STATIC_REQUIRE_FALSE(ddp::tensor<not_a_tensor>);
  STATIC_REQUIRE_FALSE(ddp::tensor<std::vector<bool>>);         // not contiguous
  STATIC_REQUIRE_FALSE(ddp::tensor<std::vector<std::string>>);  // no dtype
  STATIC_REQUIRE_FALSE(ddp::tensor<std::span<const float>>);    // read-only memory

  std::array<std::int64_t, 3> a{1, 2, 3};
  const auto v = ddp::view(a);
  CHECK(v.data == a.data());
  CHECK(v.count == 3);
  CHECK(v.type == ddp::dtype::i64);
  CHECK(v.where == ddp::device::host());
  CHECK(v.bytes() == 24);
  CHECK(v.slice(1, 2).data == a.data() + 1);
}

TEST_CASE("a temporary handle views what it borrows; a temporary of another type does not compile", "[tensor]") {
  std::vector<float> v(6, 1.0f);
  const auto t = ddp::view(std::span<float>(v).subspan(2));  // a temporary std::span, as components take one
  CHECK(t.data == v.data() + 2);
  CHECK(t.count == 4);
  CHECK(t.type == ddp::dtype::f32);
  CHECK(ddp::view(ddp::view(v)).data == v.data());  // a temporary tensor_view
  // The same call with a temporary std::vector is a static_assert that says the view would dangle.
  STATIC_REQUIRE(ddp::is_tensor_handle_v<std::span<float>>);
  STATIC_REQUIRE_FALSE(ddp::is_tensor_handle_v<std::vector<float>>);
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
  for (auto [t, bytes, name] : {std::tuple{dtype::f16, 2u, "f16"},
                                {dtype::bf16, 2u, "bf16"},
                                {dtype::f32, 4u, "f32"},
                                {dtype::f64, 8u, "f64"},
                                {dtype::i8, 1u, "i8"},
                                {dtype::u8, 1u, "u8"},
                                {dtype::i32, 4u, "i32"},
                                {dtype::i64, 8u, "i64"}}) {
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

TEST_CASE("issue #13 (5): signed element counts are accepted, negative ones are a usage_error", "[tensor][issue13]") {
  STATIC_REQUIRE(ddp::tensor<fake::handle>);     // int64_t, like torch's numel()
  STATIC_REQUIRE(ddp::tensor<fake::int_sized>);  // int
  STATIC_REQUIRE_FALSE(ddp::tensor<fake::bool_sized>);
  STATIC_REQUIRE_FALSE(ddp::tensor<fake::double_sized>);

  fake::int_sized n;
  CHECK(ddp::view(n).count == 5);
  fake::handle h;
  CHECK(ddp::view(h).count == 3);
  h.override_numel = true;
  h.numel_override = -2;
  try {
    (void)ddp::view(h);
    FAIL("a negative element count must be a usage_error");
  } catch (const ddp::usage_error& e) {
    CHECK_THAT(e.what(), Catch::Contains("returned -2") && Catch::Contains("must not be negative"));
  }
  h.numel_override = 0;
  CHECK(ddp::view(h).count == 0);
}

TEST_CASE("issue #13 (5): a const handle whose traits take const T& is a tensor; other const types are not",
          "[tensor][issue13]") {
  STATIC_REQUIRE(ddp::tensor<const fake::handle>);
  STATIC_REQUIRE(ddp::tensor<const fake::handle&>);
  STATIC_REQUIRE(ddp::is_tensor_handle_v<fake::handle>);
  STATIC_REQUIRE(ddp::is_tensor_handle_v<const fake::handle&>);
  STATIC_REQUIRE(ddp::tensor<fake::mutable_only>);
  STATIC_REQUIRE_FALSE(ddp::tensor<const fake::mutable_only>);  // data() takes T&: view() would not compile
  STATIC_REQUIRE_FALSE(ddp::tensor<const std::vector<float>>);
  STATIC_REQUIRE_FALSE(ddp::tensor<const user::Tensor>);
  STATIC_REQUIRE(ddp::tensor<const std::span<float>>);  // a const span still points at mutable floats
  STATIC_REQUIRE_FALSE(ddp::tensor<const std::span<const float>>);
  // The concept accepts exactly what view() compiles for.
  STATIC_REQUIRE(viewable<const fake::handle>);
  STATIC_REQUIRE(viewable<fake::handle>);
  STATIC_REQUIRE(viewable<const std::span<float>>);
  STATIC_REQUIRE(viewable<fake::int_sized>);

  fake::handle h;
  const fake::handle& grad = h;  // what p.grad() returns
  const auto v = ddp::view(grad);
  CHECK(v.data == h.storage->data());
  CHECK(v.count == 3);
  std::vector<float> x(4);
  const std::span<float> s(x);
  CHECK(ddp::view(s).data == x.data());
}

TEST_CASE("issue #13 (7): is_tensor_handle_v says whose copies share storage", "[tensor][issue13]") {
  STATIC_REQUIRE(ddp::is_tensor_handle_v<fake::handle>);
  STATIC_REQUIRE(ddp::is_tensor_handle_v<std::span<float>>);
  STATIC_REQUIRE_FALSE(ddp::is_tensor_handle_v<std::vector<float>>);
  STATIC_REQUIRE_FALSE(ddp::is_tensor_handle_v<std::array<float, 3>>);
  STATIC_REQUIRE_FALSE(ddp::is_tensor_handle_v<user::Tensor>);  // traits without is_handle
  STATIC_REQUIRE_FALSE(ddp::is_tensor_handle_v<not_a_tensor>);
}
