#pragma once
// Helpers of the GPU tests: device buffers of any ddp element type, and NCCL ranks as threads of
// this process (one per visible GPU, at most 4; on a single-GPU machine a world of size 1).

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/cuda/runtime.hpp>
#include <ddp/nccl.hpp>
#include <ddp/tensor.hpp>

namespace gpu_test {

/// Throws std::runtime_error naming `what` unless `e` is cudaSuccess.
inline void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

/// `count` elements of T in the memory of CUDA device `device` (cudaMalloc; freed on destruction).
template <class T>
class device_buffer {
 public:
  device_buffer(int device, std::size_t count) : device_(device), count_(count) {
    cuda_ok(cudaSetDevice(device), "cudaSetDevice");
    cuda_ok(cudaMalloc(&data_, std::max<std::size_t>(count, 1) * sizeof(T)), "cudaMalloc");
  }
  device_buffer(int device, const std::vector<T>& values) : device_buffer(device, values.size()) { upload(values); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { (void)cudaFree(data_); }

  /// Synchronous copy in (the legacy default stream).
  void upload(const std::vector<T>& values) {
    cuda_ok(cudaMemcpy(data_, values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  /// Synchronous copy out (the legacy default stream).
  [[nodiscard]] std::vector<T> download() const {
    std::vector<T> out(count_);
    cuda_ok(cudaMemcpy(out.data(), data_, count_ * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
    return out;
  }
  /// The buffer as a ddp tensor.
  [[nodiscard]] ddp::tensor_view view() const { return {data_, count_, ddp::dtype_v<T>, ddp::device::cuda(device_)}; }
  [[nodiscard]] T* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return count_; }

 private:
  int device_;
  std::size_t count_;
  T* data_ = nullptr;
};

/// Number of CUDA devices visible (0 when the runtime reports none or fails).
inline int visible_gpus() { return ddp::nccl::visible_devices().count; }

/// Ranks of the multi-rank cases: one per visible GPU, at most 4.
inline int gpu_ranks() { return std::min(visible_gpus(), 4); }

/// Runs `fn(comms..., rank)` on `n` threads: rank r with `per_rank` NCCL communicators of size
/// n on device r (one clique each, created in the same order on every rank). If a rank fails,
/// the others' communicators are aborted (so nobody waits for it forever) and the first failure
/// is rethrown here.
template <int per_rank, class F>
void on_ranks_with(int n, F&& fn) {
  std::vector<ddp::nccl::unique_id> ids;
  for (int k = 0; k < per_rank; ++k) ids.push_back(ddp::nccl::unique_id::generate());
  std::mutex mutex;
  std::vector<ddp::nccl::communicator*> live;
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      // Registered while alive, so that a failing rank can abort it.
      struct registration {
        std::mutex& mutex;
        std::vector<ddp::nccl::communicator*>& live;
        ddp::nccl::communicator comm;
        registration(std::mutex& m, std::vector<ddp::nccl::communicator*>& l, ddp::nccl::communicator c)
            : mutex(m), live(l), comm(std::move(c)) {
          std::lock_guard lk(mutex);
          live.push_back(&comm);
        }
        registration(const registration&) = delete;
        registration& operator=(const registration&) = delete;
        ~registration() {
          std::lock_guard lk(mutex);
          std::erase(live, &comm);
        }
      };
      try {
        cuda_ok(cudaSetDevice(r), "cudaSetDevice");
        std::vector<std::unique_ptr<registration>> comms;
        for (const ddp::nccl::unique_id& id : ids) {
          comms.push_back(std::make_unique<registration>(
              mutex, live, ddp::nccl::communicator::create(id, r, n, r, {.timeout = std::chrono::seconds(60)})));
        }
        if constexpr (per_rank == 1) {
          fn(comms[0]->comm, r);
        } else {
          fn(comms[0]->comm, comms[1]->comm, r);
        }
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
        std::lock_guard lk(mutex);
        for (ddp::nccl::communicator* c : live) c->abort();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

/// `fn(comm, rank)` on `n` ranks (see on_ranks_with).
template <class F>
void on_ranks(int n, F&& fn) {
  on_ranks_with<1>(n, std::forward<F>(fn));
}

/// `fn(first, second, rank)`: two NCCL communicators per rank, in one process (see on_ranks_with).
template <class F>
void on_ranks_two_comms(int n, F&& fn) {
  on_ranks_with<2>(n, std::forward<F>(fn));
}

/// A CUDA stream of the current device, destroyed with the object.
class stream_holder {
 public:
  stream_holder() { cuda_ok(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"); }
  stream_holder(const stream_holder&) = delete;
  stream_holder& operator=(const stream_holder&) = delete;
  ~stream_holder() { (void)cudaStreamDestroy(s_); }
  [[nodiscard]] cudaStream_t get() const noexcept { return s_; }
  [[nodiscard]] ddp::device_stream handle() const noexcept { return ddp::cuda::stream(s_); }
  void sync() const { cuda_ok(cudaStreamSynchronize(s_), "cudaStreamSynchronize"); }

 private:
  cudaStream_t s_ = nullptr;
};

}  // namespace gpu_test
