// Gradients on the GPU: a Bucketer-free NCCL data-parallel step, one rank per GPU, launched with
// mpirun. MPI only distributes NCCL's unique id (bootstrap); the gradient allreduce runs on the
// communicator's CUDA stream, ordered after the stream that produced the gradients, and the
// optimizer stream waits for it without blocking the host.
//
//   mpiexec -n 2 ./nccl_allreduce
//
// Built wherever CUDA and NCCL are found. On a machine without a GPU it stops with ddp's clear
// "no CUDA device visible" error (exit code 2) instead of crashing inside NCCL.
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include <ddp/mpi.hpp>
#include <ddp/nccl.hpp>

namespace {
// A device buffer as a ddp tensor: the view says where it lives.
ddp::tensor_view device_view(float* p, std::size_t n, int device) {
  return {p, n, ddp::dtype::f32, ddp::device::cuda(device)};
}
}  // namespace

int main(int argc, char** argv) {
  ddp::mpi::environment env(&argc, &argv);
  auto world = ddp::mpi::communicator::world();
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  const int device = devices > 0 ? world.rank() % devices : 0;
  try {
    auto gpu = ddp::nccl::communicator::bootstrap(world, device);
    constexpr std::size_t n = 1 << 20;
    float* grad = nullptr;
    if (cudaSetDevice(device) != cudaSuccess || cudaMalloc(&grad, n * sizeof(float)) != cudaSuccess) {
      std::fprintf(stderr, "rank %d: cudaMalloc failed\n", world.rank());
      return 1;
    }
    std::vector<float> host(n, static_cast<float>(world.rank() + 1));
    cudaStream_t backward = nullptr, optimizer = nullptr;
    cudaStreamCreate(&backward);
    cudaStreamCreate(&optimizer);
    cudaMemcpyAsync(grad, host.data(), n * sizeof(float), cudaMemcpyHostToDevice, backward);  // "backward pass"
    gpu.enqueue_after(backward);  // the allreduce waits for the gradients
    const ddp::tensor_view g = device_view(grad, n, device);
    ddp::work w = ddp::communicator_ref(gpu).allreduce(g, ddp::reduce_op::avg);
    gpu.stream_wait(optimizer);  // the optimizer's kernels run after it
    cudaMemcpyAsync(host.data(), grad, n * sizeof(float), cudaMemcpyDeviceToHost, optimizer);
    cudaStreamSynchronize(optimizer);
    w.wait();
    const float want = static_cast<float>(world.size() + 1) / 2.0f;
    std::printf("rank %d on cuda:%d: averaged %zu floats over %d GPUs: %s\n", world.rank(), device, n, world.size(),
                host[0] == want && host[n - 1] == want ? "correct" : "WRONG");
    cudaFree(grad);
    cudaStreamDestroy(backward);
    cudaStreamDestroy(optimizer);
    return host[0] == want ? 0 : 1;
  } catch (const ddp::usage_error& e) {
    std::fprintf(stderr, "nccl_allreduce: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "nccl_allreduce: %s\n", e.what());
    return 1;
  }
}
