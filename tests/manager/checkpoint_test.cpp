// ddp::checkpoint_dir (issue #46): a state saved at a step loads back bit for bit (host and device
// tensors, scalars); a truncated or corrupted newest checkpoint is skipped with its reason and the
// one before is used; a checkpoint of another model is a usage_error; only the newest `keep` stay;
// a save leaves no temporary file.
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <ddp/checkpoint.hpp>
#include <ddp/testing/emulated.hpp>
#include <ddp/training_state.hpp>

namespace fs = std::filesystem;

namespace {

struct temp_dir {
  fs::path path;
  temp_dir()
      : path(fs::temp_directory_path() / ("ddp-ckpt-" + std::to_string(::getpid()) + "-" + std::to_string(next()))) {
    fs::remove_all(path);
  }
  ~temp_dir() { fs::remove_all(path); }
  static int next() {
    static int n = 0;
    return ++n;
  }
};

struct model {
  std::vector<double> w = std::vector<double>(37);
  std::vector<float> m = std::vector<float>(11);
  ddp::training_state state;
  std::size_t counter = 0;
  explicit model(double seed) {
    for (std::size_t k = 0; k < w.size(); ++k) w[k] = seed + 0.37 * static_cast<double>(k);
    for (std::size_t k = 0; k < m.size(); ++k) m[k] = static_cast<float>(seed) * 0.5f + static_cast<float>(k);
    state.add(w).add(m);
    counter = state.add_scalar(static_cast<std::int64_t>(seed * 10));
  }
};

void chop(const fs::path& f, std::uintmax_t keep_bytes) { fs::resize_file(f, keep_bytes); }

void flip_byte(const fs::path& f, std::streamoff at) {
  std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
  io.seekg(at);
  char c = 0;
  io.read(&c, 1);
  c = static_cast<char>(c ^ 0x40);
  io.seekp(at);
  io.write(&c, 1);
}

}  // namespace

TEST_CASE("checkpoint_dir: a saved state loads back bit for bit, at its step", "[local][checkpoint]") {
  temp_dir d;
  ddp::checkpoint_dir ckpt(d.path);
  model a(3.0);
  const fs::path f = ckpt.save(42, a.state);
  CHECK(f == d.path / "step-42.ddpckpt");
  model b(7.0);
  REQUIRE(b.w != a.w);
  const auto got = ckpt.load_latest(b.state);
  REQUIRE(got);
  CHECK(got->step == 42);
  CHECK(got->skipped.empty());
  CHECK(std::memcmp(a.w.data(), b.w.data(), a.w.size() * sizeof(double)) == 0);
  CHECK(std::memcmp(a.m.data(), b.m.data(), a.m.size() * sizeof(float)) == 0);
  CHECK(b.state.scalar(b.counter) == 30);
  for (const auto& e : fs::directory_iterator(d.path)) {  // no temporary file left
    CHECK(e.path().extension() == ".ddpckpt");
  }
}

TEST_CASE("checkpoint_dir: an empty directory has nothing to load", "[local][checkpoint]") {
  temp_dir d;
  ddp::checkpoint_dir ckpt(d.path);
  model a(1.0);
  const auto before = a.w;
  CHECK_FALSE(ckpt.load_latest(a.state));
  CHECK(a.w == before);
}

TEST_CASE("checkpoint_dir: a truncated or corrupted newest checkpoint is skipped, naming why; the previous one loads",
          "[local][checkpoint]") {
  for (const std::string damage : {"truncated", "one byte flipped", "header truncated", "emptied"}) {
    INFO(damage);
    temp_dir d;
    ddp::checkpoint_dir ckpt(d.path, 3);
    model at10(10.0), at20(20.0);
    ckpt.save(10, at10.state);
    const fs::path newest = ckpt.save(20, at20.state);
    const auto size = fs::file_size(newest);
    if (damage == "truncated") chop(newest, size - 5);
    if (damage == "one byte flipped") flip_byte(newest, static_cast<std::streamoff>(size / 2));
    if (damage == "header truncated") chop(newest, 30);
    if (damage == "emptied") chop(newest, 0);
    model into(99.0);
    const auto got = ckpt.load_latest(into.state);
    REQUIRE(got);
    CHECK(got->step == 10);
    REQUIRE(got->skipped.size() == 1);
    INFO(got->skipped[0]);
    CHECK(got->skipped[0].find("step-20.ddpckpt") != std::string::npos);
    CHECK((got->skipped[0].find("truncated") != std::string::npos ||
           got->skipped[0].find("checksum") != std::string::npos ||
           got->skipped[0].find("shorter than any checkpoint") != std::string::npos));
    CHECK(into.w == at10.w);
    CHECK(into.state.scalar(into.counter) == 100);
  }
}

TEST_CASE("checkpoint_dir: every checkpoint damaged: nothing is loaded, not a byte", "[local][checkpoint]") {
  temp_dir d;
  ddp::checkpoint_dir ckpt(d.path);
  model a(5.0);
  const fs::path f = ckpt.save(5, a.state);
  flip_byte(f, static_cast<std::streamoff>(fs::file_size(f) / 2));
  model into(6.0);
  const auto before = into.w;
  CHECK_FALSE(ckpt.load_latest(into.state));
  CHECK(into.w == before);
  REQUIRE(ckpt.refused().size() == 1);
  CHECK(ckpt.refused()[0].find("checksum") != std::string::npos);
}

TEST_CASE("checkpoint_dir: a checkpoint of another state layout is a usage_error naming the tensor",
          "[local][checkpoint]") {
  temp_dir d;
  ddp::checkpoint_dir ckpt(d.path);
  model a(1.0);
  ckpt.save(3, a.state);
  std::vector<double> w(37), other(12);
  std::vector<float> m(11);
  ddp::training_state s;
  s.add(w).add(other);
  s.add_scalar(0);
  try {
    (void)ckpt.load_latest(s);
    FAIL("no error");
  } catch (const ddp::usage_error& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find("tensor 1 as 11 f32, the state registers 12 f64") != std::string::npos);
  }
}

TEST_CASE("checkpoint_dir: a save removes later steps' checkpoints (a lineage left behind), never its own",
          "[local][checkpoint]") {
  temp_dir d;
  ddp::checkpoint_dir ckpt(d.path, 2);
  model a(1.0);
  for (std::int64_t s : {10, 15}) ckpt.save(s, a.state);
  const fs::path five = ckpt.save(5, a.state);  // a job that resumed from step 5 (or from nothing)
  CHECK(fs::exists(five));
  const auto all = ckpt.list();
  REQUIRE(all.size() == 1);
  CHECK(all[0].first == 5);
  try {
    ckpt.save(-1, a.state);
    FAIL("no error");
  } catch (const ddp::usage_error& e) {
    CHECK(std::string(e.what()).find("negative step -1") != std::string::npos);
  }
}

TEST_CASE("checkpoint_dir: only the newest `keep` checkpoints stay", "[local][checkpoint]") {
  temp_dir d;
  ddp::checkpoint_dir ckpt(d.path, 2);
  model a(1.0);
  for (std::int64_t s : {5, 10, 15, 20}) ckpt.save(s, a.state);
  const auto all = ckpt.list();
  REQUIRE(all.size() == 2);
  CHECK(all[0].first == 20);
  CHECK(all[1].first == 15);
}

TEST_CASE("checkpoint_dir: device tensors are saved and loaded through the device queue",
          "[local][checkpoint][device]") {
  temp_dir d;
  ddp::checkpoint_dir ckpt(d.path);
  ddp::emulated_device::runtime rt(0);
  const ddp::device gpu = ddp::device::cuda(0);
  const ddp::device_stream stream = rt.create_stream(gpu);
  const ddp::device_queue q{&rt, stream, gpu};
  constexpr std::size_t n = 19;
  auto* dev = static_cast<float*>(rt.allocate(gpu, n * sizeof(float), {}));
  for (std::size_t k = 0; k < n; ++k) dev[k] = 1.5f * static_cast<float>(k);  // emulated device memory is host memory
  ddp::training_state s;
  s.add(ddp::tensor_view{dev, n, ddp::dtype::f32, gpu});
  try {
    ckpt.save(1, s);
    FAIL("no error");
  } catch (const ddp::usage_error& e) {
    CHECK(std::string(e.what()).find("state tensor 0 is on cuda:0") != std::string::npos);
  }
  const std::size_t syncs = rt.host_syncs();
  ckpt.save(7, s, q);
  CHECK(rt.host_syncs() == syncs + 1);
  for (std::size_t k = 0; k < n; ++k) dev[k] = -1.0f;
  const auto got = ckpt.load_latest(s, q);
  REQUIRE(got);
  CHECK(got->step == 7);
  for (std::size_t k = 0; k < n; ++k) CHECK(dev[k] == 1.5f * static_cast<float>(k));
  rt.deallocate(dev, {});
  rt.destroy_stream(stream);
}

TEST_CASE(
    "checkpoint_dir: device and host tensors mixed: every byte saved and loaded, in order; a device tensor "
    "without a queue stops a load before any byte is written",
    "[local][checkpoint][device]") {
  temp_dir d;
  ddp::checkpoint_dir ckpt(d.path);
  ddp::emulated_device::runtime rt(0);
  const ddp::device gpu = ddp::device::cuda(0);
  const ddp::device_stream stream = rt.create_stream(gpu);
  const ddp::device_queue q{&rt, stream, gpu};
  std::vector<std::size_t> sizes{1000, 3, 4097};
  std::vector<double*> dev;
  for (std::size_t n : sizes) dev.push_back(static_cast<double*>(rt.allocate(gpu, n * sizeof(double), {})));
  std::vector<double> host(77);
  ddp::training_state s;
  s.add(ddp::tensor_view{dev[0], sizes[0], ddp::dtype::f64, gpu}).add(host);  // host after device
  s.add(ddp::tensor_view{dev[1], sizes[1], ddp::dtype::f64, gpu});
  s.add(ddp::tensor_view{dev[2], sizes[2], ddp::dtype::f64, gpu});
  const auto fill = [&](double base) {
    for (std::size_t t = 0; t < dev.size(); ++t) {
      for (std::size_t k = 0; k < sizes[t]; ++k) dev[t][k] = base + static_cast<double>(t * 10000 + k);
    }
    for (std::size_t k = 0; k < host.size(); ++k) host[k] = -base - static_cast<double>(k);
  };
  fill(1.0);
  ckpt.save(3, s, q);
  fill(2.0);
  model other(4.0);  // a host tensor first, then device ones: refused before any write
  ddp::training_state mixed;
  mixed.add(host).add(ddp::tensor_view{dev[1], sizes[1], ddp::dtype::f64, gpu});
  CHECK_THROWS_AS(ckpt.load_latest(mixed), ddp::usage_error);
  CHECK(host[5] == -7.0);  // untouched
  const auto got = ckpt.load_latest(s, q);
  REQUIRE(got);
  for (std::size_t t = 0; t < dev.size(); ++t) {
    for (std::size_t k = 0; k < sizes[t]; ++k) REQUIRE(dev[t][k] == 1.0 + static_cast<double>(t * 10000 + k));
  }
  for (std::size_t k = 0; k < host.size(); ++k) REQUIRE(host[k] == -1.0 - static_cast<double>(k));
  for (double* p : dev) rt.deallocate(p, {});
  rt.destroy_stream(stream);
}
