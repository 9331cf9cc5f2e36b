#pragma once
/// @file collective_work.hpp
/// @brief (detail) Work state of an NCCL collective: a CUDA event recorded after the enqueue.

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <utility>

#include <ddp/error.hpp>
#include <ddp/nccl/comm_state.hpp>
#include <ddp/nccl/error.hpp>
#include <ddp/nccl/event.hpp>
#include <ddp/work.hpp>

namespace ddp::nccl::detail {

/// "Complete" means the event recorded after the collective has completed on the device: the
/// result is in the buffers and host code may read them after a device-to-host copy. Polling
/// also surfaces NCCL's asynchronous errors (a dead peer, a network failure), which otherwise
/// show up only as a kernel that never finishes.
class collective_work final : public work_state {
 public:
  collective_work(std::shared_ptr<comm_state> state, op_info info, event done)
      : work_state(info), state_(std::move(state)), done_(std::move(done)) {}

  bool poll() override {
    if (std::string why = state_->failure(); !why.empty()) {
      throw communication_error(info().rank, info().describe(), why);
    }
    const cudaError_t status = done_.query();
    if (status == cudaSuccess) return true;
    if (status != cudaErrorNotReady) {
      (void)cudaGetLastError();
      const communication_error e = make_cuda_error(status, info().rank, info().describe(), "cudaEventQuery");
      state_->abort(std::string("after a CUDA error: ") + e.what());
      throw e;
    }
    state_->check_async(info());
    return false;
  }

  /// On the deadline the communicator is aborted before `work` throws timeout_error: a
  /// collective whose peer never arrives would otherwise keep its kernel spinning on the GPU.
  bool wait_until(clock::time_point deadline) override {
    if (work_state::wait_until(deadline)) return true;
    state_->abort("rank " + std::to_string(info().rank) + ": " + info().describe() + " timed out");
    return false;
  }

  /// Nothing to do: the collective is ordered on the communicator's stream, and stream order
  /// (not this handle) protects its buffers. Freeing them with `cudaFreeAsync` on that stream,
  /// or after `stream_wait` on the freeing stream, is safe without waiting on the host.
  void abandon() noexcept override {}

 private:
  std::shared_ptr<comm_state> state_;
  event done_;
};

}  // namespace ddp::nccl::detail
