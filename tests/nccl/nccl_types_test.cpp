// dtype and reduce_op mapping of the NCCL backend: every ddp value has its exact NCCL
// counterpart, checked at compile time.
#include <catch2/catch.hpp>

#include <ddp/nccl/types.hpp>

#include <set>

TEST_CASE("every ddp dtype maps to the NCCL type of the same width and kind", "[nccl][types]") {
  using ddp::dtype;
  using ddp::nccl::to_nccl;
  STATIC_REQUIRE(to_nccl(dtype::f16) == ncclFloat16);
  STATIC_REQUIRE(to_nccl(dtype::bf16) == ncclBfloat16);
  STATIC_REQUIRE(to_nccl(dtype::f32) == ncclFloat32);
  STATIC_REQUIRE(to_nccl(dtype::f64) == ncclFloat64);
  STATIC_REQUIRE(to_nccl(dtype::i8) == ncclInt8);
  STATIC_REQUIRE(to_nccl(dtype::u8) == ncclUint8);
  STATIC_REQUIRE(to_nccl(dtype::i32) == ncclInt32);
  STATIC_REQUIRE(to_nccl(dtype::i64) == ncclInt64);
}

TEST_CASE("the dtype mapping is injective", "[nccl][types]") {
  using ddp::dtype;
  std::set<ncclDataType_t> seen;
  for (dtype t : {dtype::f16, dtype::bf16, dtype::f32, dtype::f64, dtype::i8, dtype::u8, dtype::i32, dtype::i64}) {
    INFO("dtype " << t);
    CHECK(ddp::nccl::to_nccl(t) != ncclNumTypes);
    CHECK(seen.insert(ddp::nccl::to_nccl(t)).second);
  }
}

TEST_CASE("every ddp reduce_op maps to its NCCL operator, avg to ncclAvg", "[nccl][types]") {
  using ddp::reduce_op;
  using ddp::nccl::to_nccl;
  STATIC_REQUIRE(to_nccl(reduce_op::sum) == ncclSum);
  STATIC_REQUIRE(to_nccl(reduce_op::avg) == ncclAvg);
  STATIC_REQUIRE(to_nccl(reduce_op::min) == ncclMin);
  STATIC_REQUIRE(to_nccl(reduce_op::max) == ncclMax);
  STATIC_REQUIRE(to_nccl(reduce_op::prod) == ncclProd);
}

TEST_CASE("fault-tolerance features follow the installed nccl.h", "[nccl][types]") {
  // Detected by the flag macros declared beside the calls (the GPU machines' 2.28.3 lacks revoke).
#if defined(NCCL_SHRINK_DEFAULT)
  STATIC_REQUIRE(DDP_NCCL_HAS_SHRINK == 1);
#else
  STATIC_REQUIRE(DDP_NCCL_HAS_SHRINK == 0);
#endif
#if defined(NCCL_REVOKE_DEFAULT)
  STATIC_REQUIRE(DDP_NCCL_HAS_REVOKE == 1);
#else
  STATIC_REQUIRE(DDP_NCCL_HAS_REVOKE == 0);
#endif
  // 2.28.9 (the development machines and CI) declares both.
  STATIC_REQUIRE(NCCL_VERSION_CODE < NCCL_VERSION(2, 28, 9) || (DDP_NCCL_HAS_SHRINK == 1 && DDP_NCCL_HAS_REVOKE == 1));
}
