// The one FNV-1a (ddp/detail/fnv1a.hpp) and the hashes built on it. These values are compared
// across processes and kept in files (the stores' frame checksum), so they must never change:
// a failure here means a change of format, not a test to update.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/bucket_layout.hpp>
#include <ddp/detail/fnv1a.hpp>
#include <ddp/stores/codec.hpp>

namespace {

using ddp::detail::fnv1a;
using ddp::detail::fnv1a_object;
using ddp::detail::fnv1a_u64;

// The published FNV-1a 64 test vectors, at compile time too.
static_assert(fnv1a(std::string_view{}) == 0xcbf29ce484222325ull);
static_assert(fnv1a(std::string_view{"a"}) == 0xaf63dc4c8601ec8cull);
static_assert(fnv1a(std::string_view{"foobar"}) == 0x85944171f73967e8ull);

}  // namespace

TEST_CASE("fnv1a: published 64-bit test vectors", "[unit][fnv1a]") {
  CHECK(fnv1a(std::string_view{}) == 0xcbf29ce484222325ull);
  CHECK(fnv1a(std::span<const std::byte>{}) == ddp::detail::fnv1a_offset_basis);
  CHECK(fnv1a(std::string_view{"a"}) == 0xaf63dc4c8601ec8cull);
  CHECK(fnv1a(std::string_view{"foobar"}) == 0x85944171f73967e8ull);
  const std::array<std::byte, 1> a{std::byte{'a'}};
  CHECK(fnv1a(std::span<const std::byte>(a)) == 0xaf63dc4c8601ec8cull);
}

TEST_CASE("fnv1a: continuing from a hash is hashing the concatenation", "[unit][fnv1a]") {
  CHECK(fnv1a(std::string_view{"bar"}, fnv1a(std::string_view{"foo"})) == fnv1a(std::string_view{"foobar"}));
  CHECK(ddp::detail::fnv1a_byte('a') == 0xaf63dc4c8601ec8cull);
}

TEST_CASE("fnv1a: integers hash as their bytes, least significant first", "[unit][fnv1a]") {
  const std::uint64_t v = 0x0123456789abcdefull;
  const std::array<std::byte, 8> le{std::byte{0xef}, std::byte{0xcd}, std::byte{0xab}, std::byte{0x89},
                                    std::byte{0x67}, std::byte{0x45}, std::byte{0x23}, std::byte{0x01}};
  CHECK(fnv1a_u64(v) == fnv1a(std::span<const std::byte>(le)));
  CHECK(fnv1a_u64(v) == 0x37eb3f3347761c55ull);
  CHECK(fnv1a_object(std::int64_t{-2}) ==
        fnv1a(std::as_bytes(std::span<const std::int64_t>(std::array{std::int64_t{-2}}))));
}

TEST_CASE("fnv1a: the values ddp exchanges and stores are unchanged", "[unit][fnv1a]") {
  // The stores' frame: bytes 16..23 are the payload's checksum, little endian.
  const std::string_view payload = "ddp";
  const auto frame = ddp::stores::detail::encode_frame(std::as_bytes(std::span(payload)));
  CHECK(ddp::stores::detail::get_u64(frame.data() + 16) == 0xca9e2e18f465ef9full);

  // The Bucketer's layout fingerprint, compared across ranks and, by the Manager, across replicas.
  const ddp::bucket_layout layout{{{2, 1}, {0}}};
  const std::vector<ddp::gradient_info> grads{{0, 10, ddp::dtype::f32, ddp::device::host()},
                                              {1, 3, ddp::dtype::f16, ddp::device::host()},
                                              {2, 1000, ddp::dtype::bf16, ddp::device::host()}};
  CHECK(ddp::detail::layout_fingerprint(layout, grads) == 0x621ec68d314d5017ull);
}
