// SHA-256 and HMAC-SHA256 (detail/hmac_sha256.hpp, over OpenSSL's libcrypto) against the
// published vectors: FIPS 180-4's examples and RFC 4231's HMAC test cases; what the wrapper adds
// (incremental and copied states, parts, empty keys and messages); the job secret's sources
// (job_secret.hpp).

#include <algorithm>
#include <array>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/detail/hmac_sha256.hpp>
#include <ddp/job_secret.hpp>

namespace {

std::vector<std::byte> unhex(std::string_view h) {
  std::vector<std::byte> out;
  for (std::size_t i = 0; i + 1 < h.size(); i += 2) {
    out.push_back(static_cast<std::byte>(std::stoi(std::string(h.substr(i, 2)), nullptr, 16)));
  }
  return out;
}

std::string hex(std::span<const std::byte> d) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s;
  for (std::byte b : d) {
    s += digits[static_cast<unsigned>(b) >> 4];
    s += digits[static_cast<unsigned>(b) & 15];
  }
  return s;
}

std::string sha(std::string_view text) {
  ddp::detail::sha256 h;
  h.update(std::as_bytes(std::span(text)));
  return hex(h.finish());
}

std::string hmac(std::span<const std::byte> key, std::span<const std::byte> data) {
  const std::array<std::span<const std::byte>, 1> parts{data};
  return hex(ddp::detail::hmac_sha256(key, parts));
}

}  // namespace

TEST_CASE("sha256: FIPS 180-4 examples", "[unit][hmac]") {
  CHECK(sha("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(sha("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(sha("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq") ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  // One million 'a', fed in uneven pieces (the block boundary falls inside updates).
  ddp::detail::sha256 h;
  const std::string piece(997, 'a');
  std::size_t left = 1000000;
  while (left > 0) {
    const std::size_t n = std::min(left, piece.size());
    h.update(std::as_bytes(std::span(piece.data(), n)));
    left -= n;
  }
  CHECK(hex(h.finish()) == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // Lengths around the padding boundary (55, 56, 64 bytes) differ from each other.
  CHECK(sha(std::string(55, 'x')) != sha(std::string(56, 'x')));
  CHECK(sha(std::string(64, 'x')) != sha(std::string(63, 'x')));
}

TEST_CASE("sha256: copies and moves carry the state", "[unit][hmac]") {
  const auto bytes = [](std::string_view s) { return std::as_bytes(std::span(s)); };
  ddp::detail::sha256 ab;
  ab.update(bytes("ab"));
  ddp::detail::sha256 copy(ab);
  ab.update(bytes("c"));
  copy.update(bytes("c"));
  const std::string abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
  CHECK(hex(ab.finish()) == abc);
  CHECK(hex(copy.finish()) == abc);
  ddp::detail::sha256 a;
  a.update(bytes("a"));
  ddp::detail::sha256 assigned;
  assigned = a;
  ddp::detail::sha256 moved(std::move(a));
  moved.update(bytes("bc"));
  assigned.update(bytes("b"));
  assigned.update({});
  assigned.update(bytes("c"));
  CHECK(hex(moved.finish()) == abc);
  CHECK(hex(assigned.finish()) == abc);
}

TEST_CASE("hmac_sha256: RFC 4231 test cases", "[unit][hmac]") {
  const auto text = [](std::string_view s) {
    return std::vector<std::byte>(std::as_bytes(std::span(s)).begin(), std::as_bytes(std::span(s)).end());
  };
  // 1: 20-byte key
  CHECK(hmac(unhex("0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b"), text("Hi There")) ==
        "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  // 2: short key
  CHECK(hmac(text("Jefe"), text("what do ya want for nothing?")) ==
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  // 3: 0xdd data
  CHECK(hmac(unhex("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"), std::vector<std::byte>(50, std::byte{0xdd})) ==
        "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
  // 6: a key longer than the block (hashed first)
  CHECK(hmac(std::vector<std::byte>(131, std::byte{0xaa}),
             text("Test Using Larger Than Block-Size Key - Hash Key First")) ==
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  // 7: a key and data longer than the block
  CHECK(hmac(std::vector<std::byte>(131, std::byte{0xaa}),
             text("This is a test using a larger than block-size key and a larger than block-size data. The key "
                  "needs to be hashed before being used by the HMAC algorithm.")) ==
        "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");
  // An empty key and an empty message (Python's hmac agrees), as one empty part or no parts.
  CHECK(hmac({}, {}) == "b613679a0814d9ec772f95d778c35fc5ff1697c493715653c6c712144292c5ad");
  CHECK(hex(ddp::detail::hmac_sha256({}, {})) == "b613679a0814d9ec772f95d778c35fc5ff1697c493715653c6c712144292c5ad");
  CHECK(hmac(text("Jefe"), {}) == "923598ca6d64af2a5dba79dcd021a8a0fe5c5f557519adaaf0ad532d4506dd30");
  // Parts are hashed as their concatenation.
  const auto a = text("what do ya want ");
  const auto b = text("for nothing?");
  const std::array<std::span<const std::byte>, 2> parts{a, b};
  CHECK(hex(ddp::detail::hmac_sha256(text("Jefe"), parts)) ==
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  const std::vector<std::byte> none;
  const std::array<std::span<const std::byte>, 4> with_empty{none, a, none, b};
  CHECK(hex(ddp::detail::hmac_sha256(text("Jefe"), with_empty)) ==
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST_CASE("constant_time_equal compares every byte", "[unit][hmac]") {
  std::vector<std::byte> a(32, std::byte{7}), b(32, std::byte{7});
  CHECK(ddp::detail::constant_time_equal(a, b));
  b[31] = std::byte{8};
  CHECK_FALSE(ddp::detail::constant_time_equal(a, b));
  b[31] = std::byte{7};
  b[0] = std::byte{0};
  CHECK_FALSE(ddp::detail::constant_time_equal(a, b));
  CHECK_FALSE(ddp::detail::constant_time_equal(a, std::span(b).first(31)));
  CHECK(ddp::detail::constant_time_equal({}, {}));
  CHECK_FALSE(ddp::detail::constant_time_equal({}, a));
}

TEST_CASE("job_secret: from the environment, generated, too short", "[unit][hmac]") {
  ::unsetenv("DDP_TEST_SECRET");
  CHECK(ddp::job_secret::from_environment("DDP_TEST_SECRET").empty());
  ::setenv("DDP_TEST_SECRET", "3f9a0c7e51b2d84a6e0f1c93b57d2a8e4c6f0b1d9e3a7c5f2b8d4e6a0c1f3b5d", 1);
  const auto s = ddp::job_secret::from_environment("DDP_TEST_SECRET");
  CHECK(s.bytes().size() == 64);
  ::setenv("DDP_TEST_SECRET", "short", 1);
  CHECK_THROWS_WITH(ddp::job_secret::from_environment("DDP_TEST_SECRET"),
                    Catch::Contains("DDP_TEST_SECRET") && Catch::Contains("at least 32 random bytes"));
  ::unsetenv("DDP_TEST_SECRET");
  const auto g1 = ddp::job_secret::generate();
  const auto g2 = ddp::job_secret::generate();
  CHECK(g1.bytes().size() == 64);
  CHECK_FALSE(ddp::detail::constant_time_equal(g1.bytes(), g2.bytes()));
}
