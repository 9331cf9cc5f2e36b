// What the NCCL backend can do on any machine, GPU or not: library version, unique ids and their
// distribution over another backend, device discovery, the clear no-device error, tensor checks,
// and the concept check. Cases that depend on whether a GPU is visible check both outcomes.
#include <catch2/catch.hpp>

#include <ddp/local/communicator.hpp>
#include <ddp/nccl.hpp>
#include <ddp/nccl/manager_factory.hpp>
#include <ddp/stores/memory_store.hpp>
#include <ddp/stores/prefix_store.hpp>

#include <algorithm>
#include <mutex>
#include <thread>
#include <vector>

using Catch::Matchers::Contains;

TEST_CASE("ddp::nccl::communicator models ddp::communicator", "[nccl][concept]") {
  STATIC_REQUIRE(ddp::communicator<ddp::nccl::communicator>);
  STATIC_REQUIRE(!std::is_copy_constructible_v<ddp::nccl::communicator>);
  STATIC_REQUIRE(std::is_nothrow_move_constructible_v<ddp::nccl::communicator>);
}

TEST_CASE("the linked NCCL is the release nccl.h describes", "[nccl][runtime]") {
  int version = 0;
  REQUIRE(ncclGetVersion(&version) == ncclSuccess);
  INFO("ncclGetVersion " << version << ", NCCL_VERSION_CODE " << NCCL_VERSION_CODE);
  // Codes of 2.9+ are major * 10000 + minor * 100 + patch; the patch level may differ.
  CHECK(version / 10000 == NCCL_MAJOR);
  CHECK(version / 100 % 100 == NCCL_MINOR);
}

TEST_CASE("unique ids are generated without a GPU and differ between calls", "[nccl][runtime]") {
  const auto a = ddp::nccl::unique_id::generate();
  const auto b = ddp::nccl::unique_id::generate();
  const auto zero = ddp::nccl::unique_id{};
  CHECK_FALSE(a == zero);
  CHECK_FALSE(a == b);
  CHECK(a.bytes().size() == NCCL_UNIQUE_ID_BYTES);
}

TEST_CASE("share_unique_id gives every rank of another backend the root's id", "[nccl][runtime]") {
  for (int root : {0, 2}) {
    std::mutex m;
    std::vector<ddp::nccl::unique_id> ids(3);
    ddp::local::run(3, [&](ddp::local::communicator& c) {
      const auto id = ddp::nccl::share_unique_id(c, root);
      std::lock_guard lock(m);
      ids[static_cast<std::size_t>(c.rank())] = id;
    });
    CHECK_FALSE(ids[0] == ddp::nccl::unique_id{});
    CHECK(ids[0] == ids[1]);
    CHECK(ids[1] == ids[2]);
  }
  CHECK_THROWS_AS(ddp::local::run(2, [](ddp::local::communicator& c) { (void)ddp::nccl::share_unique_id(c, 2); }),
                  ddp::usage_error);
}

TEST_CASE("share_unique_id through a store gives every rank rank 0's id", "[nccl][runtime]") {
  ddp::stores::memory_store store;
  ddp::store_ref base(store);
  ddp::stores::prefix_store<ddp::store_ref> gen(base, "job/g3/comm/");
  std::vector<ddp::nccl::unique_id> ids(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] { ids[static_cast<std::size_t>(r)] = ddp::nccl::share_unique_id(gen, r); });
  }
  for (auto& t : threads) t.join();
  CHECK_FALSE(ids[0] == ddp::nccl::unique_id{});
  CHECK(ids[0] == ids[1]);
  CHECK(ids[1] == ids[2]);
  CHECK(store.get("job/g3/comm/nccl_unique_id").has_value());
  // Nobody publishes: a timeout naming the rank and the key.
  CHECK_THROWS_WITH(ddp::nccl::share_unique_id(gen, 1, "other_id", std::chrono::milliseconds(20)),
                    Contains("rank 1") && Contains("'other_id'"));
}

TEST_CASE("nccl::manager_factory builds a communicator_factory for the Manager", "[nccl][runtime]") {
  const ddp::communicator_factory factory = ddp::nccl::manager_factory(0, {.timeout = std::chrono::seconds(5)});
  REQUIRE(factory);
  ddp::stores::memory_store store;
  ddp::store_ref base(store);
  ddp::stores::prefix_store<ddp::store_ref> comm_store(base, "g1/comm/");
  const ddp::quorum_info q{1, 0, 1, {"solo"}, ddp::store_ref(comm_store)};
  if (ddp::nccl::visible_devices().count == 0) {
    // The id is shared, then creation fails with the clear no-device error.
    CHECK_THROWS_AS(factory(q), ddp::usage_error);
    CHECK(store.get("g1/comm/nccl_unique_id").has_value());
  } else {
    ddp::any_communicator c = factory(q);
    CHECK(c.size() == 1);
    CHECK(c.device_queue().runtime != nullptr);  // the device capability survives the type erasure
    c.abort();
  }
}

TEST_CASE("visible_devices never throws and reports 0 with a reason when there is no device", "[nccl][runtime]") {
  const ddp::nccl::device_count visible = ddp::nccl::visible_devices();
  INFO("count " << visible.count << ", status " << cudaGetErrorName(visible.status));
  CHECK(visible.count >= 0);
  if (visible.status != cudaSuccess) CHECK(visible.count == 0);
  // Not checked: cudaGetLastError() afterwards. A failed driver initialisation (error 35 here) is
  // sticky, the runtime reports it again on every call.
}

TEST_CASE("device problems are explained", "[nccl][runtime]") {
  const ddp::nccl::device_count none{0, cudaErrorInsufficientDriver};
  const std::string no_device = ddp::nccl::device_problem(4, 0, none);
  CHECK_THAT(no_device, Contains("no CUDA device visible on rank 4"));
  CHECK_THAT(no_device, Contains("cudaErrorInsufficientDriver"));
  CHECK_THAT(no_device, Contains(cudaGetErrorString(cudaErrorInsufficientDriver)));
  CHECK_THAT(ddp::nccl::device_problem(1, 0, {0, cudaSuccess}), Contains("reports 0 devices"));
  CHECK_THAT(ddp::nccl::device_problem(1, 2, {2, cudaSuccess}), Contains("device 2") && Contains("only 2 device(s)"));
  CHECK(ddp::nccl::device_problem(1, 1, {2, cudaSuccess}).empty());
}

TEST_CASE("creating a communicator where the device is missing fails with a clear usage_error", "[nccl][runtime]") {
  const ddp::nccl::device_count visible = ddp::nccl::visible_devices();
  const auto id = ddp::nccl::unique_id::generate();
  if (visible.count == 0) {
    // This machine: CUDA and NCCL installed, no GPU (cudaGetDeviceCount fails with error 35).
    CHECK_THROWS_AS(ddp::nccl::communicator::create(id, 0, 1, 0), ddp::usage_error);
    CHECK_THROWS_WITH(ddp::nccl::communicator::create(id, 0, 1, 0),
                      Contains("ddp: rank 0, nccl::communicator::create: no CUDA device visible on rank 0: "
                               "cudaGetDeviceCount failed with") ||
                          Contains("ddp: rank 0, nccl::communicator::create: no CUDA device visible on rank 0: "
                                   "cudaGetDeviceCount reports 0 devices"));
  }
  // With or without GPUs: an ordinal past the last device is refused before NCCL is called.
  const int past_last = visible.count;
  CHECK_THROWS_AS(ddp::nccl::communicator::create(id, 0, 1, past_last), ddp::usage_error);
  CHECK_THROWS_AS(ddp::nccl::communicator::create(id, 2, 2, 0), ddp::usage_error);  // rank out of range
}

TEST_CASE("bootstrap over another backend fails on every rank when a device is missing", "[nccl][runtime]") {
  const int past_last = ddp::nccl::visible_devices().count;  // no rank has this device
  std::mutex m;
  std::vector<std::string> errors(2);
  ddp::local::run(2, [&](ddp::local::communicator& c) {
    try {
      (void)ddp::nccl::communicator::bootstrap(c, past_last);
    } catch (const ddp::usage_error& e) {
      std::lock_guard lock(m);
      errors[static_cast<std::size_t>(c.rank())] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r << ": " << errors[static_cast<std::size_t>(r)]);
    CHECK_THAT(errors[static_cast<std::size_t>(r)], Contains("rank " + std::to_string(r)));
    CHECK_THAT(errors[static_cast<std::size_t>(r)], Contains("nccl::communicator::bootstrap"));
    if (past_last == 0) CHECK_THAT(errors[static_cast<std::size_t>(r)], Contains("no CUDA device visible on rank"));
  }
}

TEST_CASE("a tensor not on the communicator's device is a usage_error naming rank, op and devices", "[nccl][runtime]") {
  std::vector<float> host(4);
  ddp::op_info info;
  info.rank = 1;
  info.name = "allreduce";
  info.seq = 5;
  info.count = 4;
  CHECK_THROWS_WITH(ddp::nccl::require_on_device(ddp::view(host), 0, info),
                    Contains("rank 1") && Contains("allreduce #5") && Contains("cuda:0") && Contains("host"));
  const ddp::tensor_view other_gpu{host.data(), 4, ddp::dtype::f32, ddp::device::cuda(1)};
  CHECK_THROWS_WITH(ddp::nccl::require_on_device(other_gpu, 0, info), Contains("got a tensor on cuda:1"));
  const ddp::tensor_view no_data{nullptr, 4, ddp::dtype::f32, ddp::device::cuda(0)};
  CHECK_THROWS_AS(ddp::nccl::require_on_device(no_data, 0, info), ddp::usage_error);
  const ddp::tensor_view right{host.data(), 4, ddp::dtype::f32, ddp::device::cuda(0)};
  CHECK_NOTHROW(ddp::nccl::require_on_device(right, 0, info));
}
