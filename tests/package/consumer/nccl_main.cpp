// Consumer of an installed ddp's nccl component: what works without a GPU.
#include <ddp/nccl.hpp>

#include <cstdio>

int main() {
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess) return 1;
  const auto id = ddp::nccl::unique_id::generate();
  if (id == ddp::nccl::unique_id{}) return 1;
  const ddp::nccl::device_count visible = ddp::nccl::visible_devices();
  std::printf("NCCL %d (header %d), unique id ok, %d CUDA device(s) visible\n", version, NCCL_VERSION_CODE,
              visible.count);
  return 0;
}
