// Configure-time probe: prints the number of visible CUDA devices (0 when the runtime fails;
// cudaGetDeviceCount leaves its output untouched then, hence the initialisation).
#include <cuda_runtime_api.h>

#include <cstdio>

int main() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  std::printf("%d", count);
  return 0;
}
