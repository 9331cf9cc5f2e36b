// ddp::cuda::runtime and the NCCL communicator's device capabilities on any machine, GPU or not:
// the concepts the communicator models, the handle conversions, the batching rule of copies, and
// the runtime's errors where there is no device (or, on a GPU machine, no such device): always a
// ddp exception naming the rank, the operation and the CUDA call, never a crash.
#include <catch2/catch.hpp>

#include <ddp/communicator.hpp>
#include <ddp/cuda/runtime.hpp>
#include <ddp/nccl.hpp>

#include <algorithm>
#include <array>
#include <cstring>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

using Catch::Matchers::Contains;

TEST_CASE("ddp::nccl::communicator has a device queue and a pre-multiplied sum", "[nccl][concept]") {
  STATIC_REQUIRE(ddp::device_communicator<ddp::nccl::communicator>);
  STATIC_REQUIRE(ddp::premul_sum_communicator<ddp::nccl::communicator>);
  STATIC_REQUIRE(!ddp::staging_communicator<ddp::nccl::communicator>);
  STATIC_REQUIRE(
      std::is_same_v<decltype(std::declval<const ddp::nccl::communicator&>().device_queue()), ddp::device_queue>);
}

TEST_CASE("ddp::cuda::runtime is a final device_runtime, neither copyable nor movable", "[nccl][cuda]") {
  STATIC_REQUIRE(std::is_base_of_v<ddp::device_runtime, ddp::cuda::runtime>);
  STATIC_REQUIRE(std::is_final_v<ddp::cuda::runtime>);
  STATIC_REQUIRE(!std::is_copy_constructible_v<ddp::cuda::runtime>);
  STATIC_REQUIRE(!std::is_move_constructible_v<ddp::cuda::runtime>);
  STATIC_REQUIRE(!std::is_convertible_v<int, ddp::cuda::runtime>);  // explicit
  const ddp::cuda::runtime rt(5);                                   // touches no device
  CHECK(rt.name() == "cuda");
  CHECK(rt.rank() == 5);
}

TEST_CASE("CUDA handles convert to device handles and back unchanged", "[nccl][cuda]") {
  // Fake handle values: converted, never used.
  auto* const s = reinterpret_cast<cudaStream_t>(std::uintptr_t{0x1000});
  auto* const e = reinterpret_cast<cudaEvent_t>(std::uintptr_t{0x2000});
  CHECK(ddp::cuda::native(ddp::cuda::stream(s)) == s);
  CHECK(ddp::cuda::native(ddp::cuda::event(e)) == e);
  CHECK(ddp::cuda::stream(s) == ddp::device_stream{reinterpret_cast<void*>(std::uintptr_t{0x1000})});
  CHECK(ddp::cuda::stream(nullptr) == ddp::device_stream{});  // the legacy default stream
  CHECK_FALSE(ddp::cuda::event(nullptr));
  CHECK(ddp::cuda::event(e));
}

TEST_CASE("copies are batched only when they may run in any order", "[nccl][cuda]") {
  std::array<std::byte, 64> a{};
  std::array<std::byte, 64> b{};
  using ddp::copy_region;
  using ddp::cuda::detail::independent;
  // Gathering into one buffer from several sources, and scattering back: independent.
  const std::vector<copy_region> gather{{a.data(), b.data(), 8}, {a.data() + 8, b.data() + 32, 8}};
  CHECK(independent(gather));
  const std::vector<copy_region> sources_overlap{{a.data(), b.data(), 16}, {a.data() + 16, b.data() + 8, 16}};
  CHECK(independent(sources_overlap));  // two reads of the same bytes
  const std::vector<copy_region> same_destination{{a.data(), b.data(), 8}, {a.data() + 4, b.data() + 16, 8}};
  CHECK_FALSE(independent(same_destination));
  const std::vector<copy_region> read_after_write{{a.data(), b.data(), 8}, {b.data() + 32, a.data() + 4, 8}};
  CHECK_FALSE(independent(read_after_write));
  const std::vector<copy_region> write_after_read{{b.data() + 32, a.data() + 4, 8}, {a.data(), b.data(), 8}};
  CHECK_FALSE(independent(write_after_read));
  const std::vector<copy_region> self_overlap{{a.data(), a.data() + 4, 8}};
  CHECK_FALSE(independent(self_overlap));
  const std::vector<copy_region> touching{{a.data(), b.data(), 8}, {a.data() + 8, b.data() + 8, 8}};
  CHECK(independent(touching));
  const std::vector<copy_region> empty_ones{{a.data(), b.data(), 0}, {a.data(), b.data(), 8}, {a.data(), a.data(), 0}};
  CHECK(independent(empty_ones));  // empty regions touch nothing
  CHECK(independent({}));
}

// Runs a plan on the host as scripts/ptx/batched_copy.cu runs it on the device: one block per
// chunk finds its region by binary search over first_chunk and copies its byte range.
void run_plan_on_host(const std::vector<ddp::cuda::detail::kernel_copy_batch>& plan) {
  for (const auto& batch : plan) {
    for (std::uint64_t chunk = 0; chunk < batch.chunks; ++chunk) {
      std::uint32_t lo = 0, hi = batch.count - 1;
      while (lo < hi) {
        const std::uint32_t mid = (lo + hi + 1) / 2;
        if (batch.region[mid].first_chunk <= chunk) {
          lo = mid;
        } else {
          hi = mid - 1;
        }
      }
      const auto& r = batch.region[lo];
      const std::uint64_t begin = (chunk - r.first_chunk) * batch.chunk_bytes;
      const std::uint64_t end = std::min<std::uint64_t>(begin + batch.chunk_bytes, r.bytes);
      REQUIRE(begin < end);  // every block has bytes to copy
      std::memcpy(reinterpret_cast<void*>(r.dst + begin), reinterpret_cast<const void*>(r.src + begin), end - begin);
    }
  }
}

TEST_CASE("the copy kernel's plan covers every byte once, in launches of at most 120 regions", "[nccl][cuda]") {
  using ddp::cuda::detail::kernel_copy_batch_regions;
  using ddp::cuda::detail::plan_kernel_copies;
  std::vector<std::uint8_t> src(1 << 20), dst(1 << 20, 0);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::uint8_t>(i * 7 + 1);
  SECTION("300 small regions at odd offsets, some empty") {
    std::vector<ddp::copy_region> regions;
    std::size_t at = 0;
    for (std::size_t k = 0; k < 300; ++k) {
      const std::size_t bytes = k % 10 == 0 ? 0 : 1 + (k * 37) % 900;
      regions.push_back({dst.data() + at + 3, src.data() + at + 1, bytes});
      at += bytes + 5;
    }
    const auto plan = plan_kernel_copies(regions, 256);
    REQUIRE(plan.size() == 3);  // 270 non-empty regions
    for (const auto& b : plan) CHECK(b.count <= kernel_copy_batch_regions);
    run_plan_on_host(plan);
    for (const auto& r : regions) {
      CHECK(std::memcmp(r.dst, r.src, r.bytes) == 0);
      CHECK(static_cast<std::uint8_t*>(r.dst)[r.bytes] == 0);  // nothing past the end
    }
  }
  SECTION("a region longer than a launch's blocks spans launches") {
    const std::vector<ddp::copy_region> regions{{dst.data(), src.data(), 1000}, {dst.data() + 2000, src.data(), 10000}};
    const auto plan = plan_kernel_copies(regions, 512, 8);  // at most 8 blocks of 512 bytes a launch
    REQUIRE(plan.size() == 3);                              // 2 + 20 chunks: 8, 8, 6
    CHECK(plan[0].chunks == 8);
    CHECK(plan[2].chunks == 6);
    CHECK(plan[1].count == 1);  // the middle of the long region
    run_plan_on_host(plan);
    CHECK(std::memcmp(dst.data(), src.data(), 1000) == 0);
    CHECK(std::memcmp(dst.data() + 2000, src.data(), 10000) == 0);
    CHECK(dst[1000] == 0);
    CHECK(dst[12000] == 0);
  }
  SECTION("nothing to copy: no launch") {
    const std::vector<ddp::copy_region> regions{{dst.data(), src.data(), 0}};
    CHECK(plan_kernel_copies(regions).empty());
  }
}

TEST_CASE("cuda::runtime: a missing device is a communication_error naming rank, operation and call", "[nccl][cuda]") {
  const ddp::nccl::device_count visible = ddp::nccl::visible_devices();
  INFO("visible devices: " << visible.count << " (" << cudaGetErrorName(visible.status) << ")");
  ddp::cuda::runtime rt(3);
  // No machine has this device: without a driver cudaGetDevice fails, with one cudaSetDevice does.
  const ddp::device missing = ddp::device::cuda(visible.count);
  // The message of the communication_error `call()` throws ("" if it throws nothing or something else).
  const auto failure = [](auto&& call) -> std::string {
    try {
      call();
    } catch (const ddp::communication_error& e) {
      return e.what();
    } catch (...) {
    }
    return {};
  };
  const auto names = [](const std::string& what, const std::string& operation) {
    INFO(what);
    CHECK_THAT(what, Contains("ddp: rank 3, " + operation + ": "));
    CHECK_THAT(what, Contains(" failed: cuda"));  // "<call> failed: cudaErrorX: <text>"
  };
  names(failure([&] { (void)rt.create_stream(missing); }), "cuda::runtime::create_stream");
  names(failure([&] { (void)rt.create_event(missing); }), "cuda::runtime::create_event");
  names(failure([&] { (void)rt.allocate(missing, 64, {}); }), "cuda::runtime::allocate");
  try {
    (void)rt.allocate(missing, 64, {});
    FAIL("allocating on a missing device did not throw");
  } catch (const ddp::communication_error& e) {
    CHECK(e.rank() == 3);
    CHECK(e.operation() == "cuda::runtime::allocate");
  }

  if (visible.count == 0) {
    // This machine: CUDA installed, no driver. Every call that reaches CUDA fails cleanly.
    std::array<int, 4> host{1, 2, 3, 4};
    std::array<int, 4> other{};
    const ddp::copy_region one{other.data(), host.data(), sizeof(host)};
    const std::string copy = failure([&] { rt.copy({&one, 1}, {}); });
    names(copy, "cuda::runtime::copy");
    CHECK_THAT(copy, Contains("cudaMemcpyAsync"));
    const std::string zero = failure([&] { rt.zero(other.data(), sizeof(other), {}); });
    names(zero, "cuda::runtime::zero");
    CHECK_THAT(zero, Contains("cudaMemsetAsync"));
    names(failure([&] { rt.record({}, {}); }), "cuda::runtime::record");
    names(failure([&] { rt.wait({}, {}); }), "cuda::runtime::wait");
    const std::string query = failure([&] { (void)rt.query({}); });
    names(query, "cuda::runtime::query");
    CHECK_THAT(query, Contains("cudaEventQuery"));
    const std::string synchronize = failure([&] { rt.synchronize({}); });
    names(synchronize, "cuda::runtime::synchronize");
    CHECK_THAT(synchronize, Contains("cudaEventSynchronize"));
  }
}

TEST_CASE("cuda::runtime: host memory as a device is a usage_error; empty work touches no device", "[nccl][cuda]") {
  ddp::cuda::runtime rt(1);
  CHECK_THROWS_AS((void)rt.create_stream(ddp::device::host()), ddp::usage_error);
  CHECK_THROWS_AS((void)rt.create_event(ddp::device::host()), ddp::usage_error);
  CHECK_THROWS_WITH((void)rt.allocate(ddp::device::host(), 8, {}),
                    Contains("rank 1") && Contains("cuda::runtime::allocate") && Contains("got host"));
  // Nothing to do: no CUDA call, so no error even without a device.
  CHECK(rt.allocate(ddp::device::cuda(0), 0, {}) == nullptr);
  CHECK_NOTHROW(rt.zero(nullptr, 0, {}));
  const std::vector<ddp::copy_region> nothing{{nullptr, nullptr, 0}, {nullptr, nullptr, 0}};
  CHECK_NOTHROW(rt.copy(nothing, {}));
  CHECK_NOTHROW(rt.copy({}, {}));
  // Releasing nothing is a no-op; releasing never throws.
  STATIC_REQUIRE(noexcept(rt.deallocate(nullptr, {})));
  STATIC_REQUIRE(noexcept(rt.destroy_stream({})));
  STATIC_REQUIRE(noexcept(rt.destroy_event({})));
  rt.deallocate(nullptr, {});
  rt.destroy_stream({});
  rt.destroy_event({});
}

TEST_CASE("the CUDA error helpers keep their ddp::nccl names", "[nccl][cuda]") {
  const ddp::communication_error e =
      ddp::cuda::make_cuda_error(cudaErrorInvalidValue, 2, "cuda::runtime::copy", "cudaMemcpyAsync");
  CHECK_THAT(std::string(e.what()), Contains("rank 2") && Contains("cuda::runtime::copy") &&
                                        Contains("cudaMemcpyAsync failed") && Contains("cudaErrorInvalidValue"));
  CHECK(std::string(ddp::nccl::make_cuda_error(cudaErrorInvalidValue, 2, "x", "y").what()) ==
        ddp::cuda::make_cuda_error(cudaErrorInvalidValue, 2, "x", "y").what());
  CHECK_THROWS_AS(ddp::nccl::check_cuda(cudaErrorInvalidValue, 0, "x", "y"), ddp::communication_error);
  STATIC_REQUIRE(std::is_same_v<ddp::nccl::device_guard, ddp::cuda::device_guard>);
}

TEST_CASE("a call mixing host and device tensors names both placements", "[nccl][runtime]") {
  // The device-path rule, as a mixed call meets it (the call itself needs a communicator, i.e. a GPU).
  std::vector<float> host(4);
  ddp::op_info info;
  info.rank = 0;
  info.name = "allreduce";
  CHECK_THROWS_WITH(ddp::nccl::require_on_device(ddp::view(host), 0, info),
                    Contains("CUDA memory on cuda:0") && Contains("host memory for every tensor of a call") &&
                        Contains("got a tensor on host"));
}
