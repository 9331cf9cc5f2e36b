// gloo connect reports which ranks have not published their address while it waits.
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/gloo.hpp>
#include <ddp/stores/file_store.hpp>

using namespace std::chrono_literals;

TEST_CASE("gloo connect: progress names the missing rank", "[gloo][progress]") {
  std::string pattern = (std::filesystem::temp_directory_path() / "ddp-observe-gloo-XXXXXX").string();
  REQUIRE(::mkdtemp(pattern.data()) != nullptr);  // 0700, a name nobody can take first
  const std::filesystem::path dir = pattern;
  ddp::stores::file_store store(dir.string());
  std::mutex mu;
  std::vector<ddp::progress_update> got;
  std::vector<std::string> errors(3);
  auto connect = [&](int r) {
    try {
      ddp::gloo::options o;
      o.connect_timeout = 20s;
      o.progress = [&, r](const ddp::progress_update& u) {
        std::lock_guard lk(mu);
        if (r == 0) got.push_back(u);
      };
      ddp::gloo::communicator c(store, r, 3, o);
      std::vector<float> x{1.0f};
      ddp::communicator_ref(c).allreduce(x, ddp::reduce_op::sum).wait();
      if (x[0] != 3.0f) errors[static_cast<std::size_t>(r)] = "wrong sum";
    } catch (const std::exception& e) {
      errors[static_cast<std::size_t>(r)] = e.what();
    }
  };
  std::vector<std::thread> ts;
  ts.emplace_back(connect, 0);
  ts.emplace_back(connect, 1);
  std::this_thread::sleep_for(1500ms);  // rank 2 is late
  ts.emplace_back(connect, 2);
  for (auto& t : ts) t.join();
  std::filesystem::remove_all(dir);
  for (const auto& e : errors) CHECK(e.empty());
  std::lock_guard lk(mu);
  bool named = false;
  for (const auto& u : got) {
    if (!u.finished && std::find(u.missing.begin(), u.missing.end(), "rank 2") != u.missing.end()) named = true;
  }
  CHECK(named);
  REQUIRE(!got.empty());
  CHECK(got.back().finished);
  CHECK(got.back().arrived == 3);
}
