// Source of the kernel behind ddp::cuda::runtime::copy for many device regions. Not compiled into
// anything: scripts/ptx/generate.sh turns it into PTX and writes include/ddp/cuda/batched_copy_ptx.hpp,
// which the runtime loads with cudaLibraryLoadData (so ddp's headers never need nvcc). The layout
// of `ddp_copy_batch` must match ddp::cuda::detail::copy_batch in include/ddp/cuda/batched_copy.hpp.
#include <cstdint>

struct ddp_copy_region {
  unsigned long long dst;          // device address
  unsigned long long src;          // device address
  unsigned long long bytes;        // > 0
  unsigned long long first_chunk;  // index of the region's first chunk in the launch
};

constexpr int ddp_copy_batch_regions = 120;  // 120 * 32 + 16 bytes: under the 4 KiB of parameters

struct ddp_copy_batch {
  ddp_copy_region region[ddp_copy_batch_regions];
  unsigned long long chunk_bytes;  // a multiple of 16
  unsigned int count;              // regions used, >= 1
};

template <typename Word>
__device__ void copy_words(char* dst, const char* src, unsigned long long begin, unsigned long long end) {
  const unsigned long long stride = blockDim.x * sizeof(Word);
  for (unsigned long long o = begin + threadIdx.x * sizeof(Word); o + sizeof(Word) <= end; o += stride) {
    *reinterpret_cast<Word*>(dst + o) = *reinterpret_cast<const Word*>(src + o);
  }
}

// One block per chunk: the block finds its region (binary search over first_chunk) and copies its
// part of it in the widest words both addresses allow, the tail byte by byte.
extern "C" __global__ void ddp_batched_copy(const __grid_constant__ ddp_copy_batch batch) {
  const unsigned long long chunk = blockIdx.x;
  unsigned int lo = 0, hi = batch.count - 1;
  while (lo < hi) {
    const unsigned int mid = (lo + hi + 1) / 2;
    if (batch.region[mid].first_chunk <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const ddp_copy_region& r = batch.region[lo];
  const unsigned long long begin = (chunk - r.first_chunk) * batch.chunk_bytes;
  const unsigned long long end = begin + batch.chunk_bytes < r.bytes ? begin + batch.chunk_bytes : r.bytes;
  char* dst = reinterpret_cast<char*>(r.dst);
  const char* src = reinterpret_cast<const char*>(r.src);
  const unsigned long long both = r.dst | r.src;
  unsigned long long words_end = begin;
  if ((both & 15) == 0) {
    words_end = begin + ((end - begin) & ~15ull);
    copy_words<uint4>(dst, src, begin, words_end);
  } else if ((both & 3) == 0) {
    words_end = begin + ((end - begin) & ~3ull);
    copy_words<unsigned int>(dst, src, begin, words_end);
  }
  for (unsigned long long o = words_end + threadIdx.x; o < end; o += blockDim.x) dst[o] = src[o];
}
