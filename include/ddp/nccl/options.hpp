#pragma once
/// @file options.hpp
/// @brief Creation options of an NCCL communicator.

#include <cuda_runtime_api.h>

#include <chrono>
#include <string>

#include <ddp/work.hpp>

namespace ddp::nccl {

/// How an `nccl::communicator` is created. An aggregate: set what you need with designated
/// initialisers, e.g. `{.timeout = std::chrono::seconds(30)}`.
struct options {
  /// Deadline of `work::wait()`. When it passes, the communicator is aborted (`ncclCommAbort`,
  /// which stops kernels still waiting for peers) and the wait throws `timeout_error`.
  std::chrono::milliseconds timeout = default_timeout;
  /// Stream to enqueue collectives on, owned by the caller and on the communicator's device.
  /// Null: the communicator creates its own stream with `cudaStreamCreate`, which (being a
  /// blocking stream) is ordered after work on the legacy default stream; work on any other
  /// stream must be ordered with `communicator::enqueue_after`.
  cudaStream_t stream = nullptr;
  /// Name shown in NCCL's logs (`ncclConfig_t::commName`); empty for none.
  std::string name{};
  /// A set-up that cannot strand this rank: the communicator is created non-blocking
  /// (`ncclConfig_t::blocking = 0`) and polled; if the clique has not formed by `init_timeout`
  /// (a rank never called `create`, or died after the unique id was shared), it is aborted
  /// (`ncclCommAbort`) and `create` throws `timeout_error`. Its later calls are waited for the
  /// same way (`timeout` bounds each). false: NCCL's blocking set-up, which waits forever.
  bool bounded_init = true;
  /// Deadline of the set-up with `bounded_init`; 0: `timeout`.
  std::chrono::milliseconds init_timeout{0};
};

}  // namespace ddp::nccl
