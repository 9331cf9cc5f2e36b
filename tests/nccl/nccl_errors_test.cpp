// Translation of NCCL and CUDA status codes into ddp exceptions (no GPU needed).
#include <catch2/catch.hpp>

#include <ddp/nccl/error.hpp>
#include <ddp/nccl/group_guard.hpp>

#include <stdexcept>
#include <string>

using Catch::Matchers::Contains;

TEST_CASE("an NCCL failure names the call, NCCL's text, the rank and the operation", "[nccl][errors]") {
  for (ncclResult_t r : {ncclUnhandledCudaError, ncclSystemError, ncclInternalError, ncclInvalidArgument,
                         ncclInvalidUsage, ncclRemoteError}) {
    const ddp::communication_error e = ddp::nccl::make_nccl_error(r, 3, "allreduce #7 (sum, f32 x 4)", "ncclAllReduce");
    const std::string what = e.what();
    INFO(what);
    CHECK_THAT(what, Contains(ncclGetErrorString(r)));
    CHECK_THAT(what, Contains("rank 3"));
    CHECK_THAT(what, Contains("allreduce #7"));
    CHECK_THAT(what, Contains("ncclAllReduce failed"));
    CHECK_THAT(what, Contains("ncclResult_t " + std::to_string(static_cast<int>(r))));
    CHECK(e.rank() == 3);
    CHECK(e.operation() == "allreduce #7 (sum, f32 x 4)");
  }
}

TEST_CASE("check_nccl passes success through and throws communication_error otherwise", "[nccl][errors]") {
  CHECK_NOTHROW(ddp::nccl::check_nccl(ncclSuccess, 0, "barrier #0", "ncclAllReduce"));
  CHECK_THROWS_AS(ddp::nccl::check_nccl(ncclInvalidUsage, 1, "broadcast #2", "ncclBroadcast"),
                  ddp::communication_error);
  CHECK_THROWS_WITH(ddp::nccl::check_nccl(ncclRemoteError, 1, "broadcast #2", "ncclBroadcast"),
                    Contains("rank 1") && Contains("broadcast #2") && Contains(ncclGetErrorString(ncclRemoteError)));
}

TEST_CASE("a CUDA failure names the call, CUDA's error name and text, the rank and the operation", "[nccl][errors]") {
  const ddp::communication_error e =
      ddp::nccl::make_cuda_error(cudaErrorInsufficientDriver, 2, "nccl::communicator::create", "cudaStreamCreate");
  const std::string what = e.what();
  INFO(what);
  CHECK_THAT(what, Contains("rank 2"));
  CHECK_THAT(what, Contains("nccl::communicator::create"));
  CHECK_THAT(what, Contains("cudaStreamCreate failed"));
  CHECK_THAT(what, Contains("cudaErrorInsufficientDriver"));
  CHECK_THAT(what, Contains(cudaGetErrorString(cudaErrorInsufficientDriver)));
  CHECK_NOTHROW(ddp::nccl::check_cuda(cudaSuccess, 0, "x", "cudaFree"));
  CHECK_THROWS_AS(ddp::nccl::check_cuda(cudaErrorMemoryAllocation, 0, "x", "cudaMalloc"), ddp::communication_error);
}

TEST_CASE("group_guard balances ncclGroupStart/End, also when left by an exception", "[nccl][errors]") {
  // An empty group needs no device: NCCL only tracks the per-thread group depth.
  {
    ddp::nccl::group_guard group(0, "allreduce #0");
    CHECK_NOTHROW(group.end());
  }
  CHECK_THROWS_AS(
      [] {
        ddp::nccl::group_guard group(0, "allreduce #1");
        throw std::runtime_error("enqueue failed");
      }(),
      std::runtime_error);
  // If the guard had leaked a group level, this end() would not launch anything and a later
  // communicator call would silently be deferred; NCCL reports the imbalance on the extra end.
  ddp::nccl::group_guard group(0, "allreduce #2");
  CHECK_NOTHROW(group.end());
  CHECK(ncclGroupEnd() != ncclSuccess);  // depth is back to 0: an unmatched end is refused
}
