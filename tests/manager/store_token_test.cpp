// detail::share_store_token: rank 0's token reaches every rank through a store (how an NCCL
// unique id reaches a quorum), over threads, with the stores the Manager tests use.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstddef>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/detail/store_token.hpp>
#include <ddp/stores/file_store.hpp>
#include <ddp/stores/memory_store.hpp>
#include <ddp/stores/prefix_store.hpp>

using namespace std::chrono_literals;

namespace {

std::vector<std::byte> fake_token(std::size_t n, unsigned seed) {
  std::vector<std::byte> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = static_cast<std::byte>((seed * 31 + i * 7) & 0xff);
  return t;
}

// Runs `ranks` threads sharing a token; returns what each got (or the error it threw).
struct outcome {
  std::vector<std::vector<std::byte>> tokens;
  std::vector<std::string> errors;
};

template <class Body>
outcome run_ranks(int ranks, Body body) {
  outcome o;
  o.tokens.resize(static_cast<std::size_t>(ranks));
  o.errors.resize(static_cast<std::size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        o.tokens[static_cast<std::size_t>(r)] = body(r);
      } catch (const std::exception& e) {
        o.errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return o;
}

}  // namespace

TEST_CASE("share_store_token: rank 0's token reaches every rank, generated once", "[local][manager][store]") {
  const int ranks = GENERATE(3, 4);
  ddp::stores::memory_store store;
  ddp::store_ref base(store);
  ddp::stores::prefix_store<ddp::store_ref> gen(base, "job/g1/comm/");
  std::atomic<int> generated{0};
  const auto o = run_ranks(ranks, [&](int r) {
    // Ranks other than 0 start first: they must wait for the key.
    if (r == 0) std::this_thread::sleep_for(50ms);
    return ddp::detail::share_store_token(
        gen, r, "nccl_unique_id", 128,
        [&] {
          ++generated;
          return fake_token(128, 7);
        },
        5s, "test share");
  });
  CHECK(generated == 1);
  for (int r = 0; r < ranks; ++r) {
    INFO("rank " << r << ": " << o.errors[static_cast<std::size_t>(r)]);
    CHECK(o.errors[static_cast<std::size_t>(r)].empty());
    CHECK(o.tokens[static_cast<std::size_t>(r)] == fake_token(128, 7));
  }
  REQUIRE(store.get("job/g1/comm/nccl_unique_id").has_value());  // under the group's namespace
}

TEST_CASE("share_store_token works through a file store", "[local][manager][store]") {
  std::string pattern = (std::filesystem::temp_directory_path() / "ddp_store_token_XXXXXX").string();
  REQUIRE(::mkdtemp(pattern.data()) != nullptr);  // 0700, a name nobody can take first
  const std::filesystem::path dir = pattern;
  {
    ddp::stores::file_store store(dir);
    const auto o = run_ranks(3, [&](int r) {
      return ddp::detail::share_store_token(
          store, r, "g2/id", 16, [] { return fake_token(16, 3); }, 10s, "test share");
    });
    for (int r = 0; r < 3; ++r) {
      INFO("rank " << r << ": " << o.errors[static_cast<std::size_t>(r)]);
      CHECK(o.tokens[static_cast<std::size_t>(r)] == fake_token(16, 3));
    }
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("share_store_token: a timeout names the rank and the key when rank 0 never publishes",
          "[local][manager][store]") {
  ddp::stores::memory_store store;
  const auto o = run_ranks(3, [&](int r) -> std::vector<std::byte> {
    if (r == 0) return {};  // rank 0 "died" before publishing
    return ddp::detail::share_store_token(
        store, r, "nccl_unique_id", 128, [] { return fake_token(128, 1); }, 100ms, "test share");
  });
  for (int r = 1; r < 3; ++r) {
    const auto& e = o.errors[static_cast<std::size_t>(r)];
    INFO(e);
    CHECK(e.find("rank " + std::to_string(r)) != std::string::npos);
    CHECK(e.find("'nccl_unique_id'") != std::string::npos);
    CHECK(e.find("rank 0 did not publish") != std::string::npos);
    CHECK(e.find("100 ms") != std::string::npos);
  }
  // And it is a timeout_error.
  CHECK_THROWS_AS(ddp::detail::share_store_token(
                      store, 2, "other", 4, [] { return fake_token(4, 1); }, 10ms, "test share"),
                  ddp::timeout_error);
}

TEST_CASE("share_store_token: a value of the wrong size is an error naming both sizes", "[local][manager][store]") {
  ddp::stores::memory_store store;
  const auto bad = fake_token(100, 2);
  store.set("id", bad);
  try {
    (void)ddp::detail::share_store_token(
        store, 1, "id", 128, [] { return fake_token(128, 1); }, 1s, "test share");
    FAIL("no error");
  } catch (const ddp::communication_error& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(e.rank() == 1);
    CHECK(what.find("'id'") != std::string::npos);
    CHECK(what.find("100 bytes") != std::string::npos);
    CHECK(what.find("expected 128") != std::string::npos);
  }
  // Rank 0 refuses to publish a generated token of the wrong size.
  CHECK_THROWS_AS(ddp::detail::share_store_token(
                      store, 0, "id2", 128, [] { return fake_token(5, 1); }, 1s, "test share"),
                  ddp::usage_error);
  CHECK_FALSE(store.get("id2").has_value());
}

TEST_CASE("share_store_token: a failing generator on rank 0 fails the others at once", "[local][manager][store]") {
  ddp::stores::memory_store store;
  const auto start = std::chrono::steady_clock::now();
  const auto o = run_ranks(3, [&](int r) {
    return ddp::detail::share_store_token(
        store, r, "id", 8, []() -> std::vector<std::byte> { throw std::runtime_error("no bootstrap interface"); }, 20s,
        "test share");
  });
  CHECK(std::chrono::steady_clock::now() - start < 10s);
  CHECK(o.errors[0].find("no bootstrap interface") != std::string::npos);
  for (int r = 1; r < 3; ++r) {
    INFO(o.errors[static_cast<std::size_t>(r)]);
    CHECK(o.errors[static_cast<std::size_t>(r)].find("rank 0 could not generate 'id'") != std::string::npos);
  }
}
