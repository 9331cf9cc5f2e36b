#pragma once
/// @file ddp.hpp
/// @brief The core umbrella: the vocabulary (tensors, dtypes, the communicator concept, work,
/// errors), averaging, the checked communicator and the three components (`Bucketer`,
/// `JoinContext`, `BufferReducer`) with their policies, hooks and strategies. Never includes
/// <mpi.h>, <nccl.h> or gloo: backends have their own headers (`<ddp/local.hpp>`,
/// `<ddp/mpi.hpp>`, `<ddp/nccl.hpp>`, `<ddp/gloo.hpp>`, `<ddp/shm.hpp>`).
///
/// The rest has umbrellas of its own: `<ddp/fault_tolerance.hpp>` (the `Manager`, its stores and
/// training state), `<ddp/reproducible.hpp>` (world-size-invariant reduction), `<ddp/data.hpp>`
/// (the exactly-once sampler), `<ddp/observe.hpp>` (straggler attribution, timeline, progress).

#include <ddp/version.hpp>

#include <ddp/device.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/reduce_op.hpp>
#include <ddp/tensor.hpp>

#include <ddp/communicator.hpp>
#include <ddp/work.hpp>
#include <ddp/checked.hpp>
#include <ddp/average.hpp>

#include <ddp/bucket_layout.hpp>
#include <ddp/bucketing/fixed.hpp>
#include <ddp/bucketing/rebuild_once.hpp>
#include <ddp/bucketing/size_capped.hpp>
#include <ddp/comm_hook.hpp>
#include <ddp/gradient_hooks.hpp>
#include <ddp/hooks/allreduce_average.hpp>
#include <ddp/hooks/compress.hpp>
#include <ddp/bucketer.hpp>

#include <ddp/buffer_reducer.hpp>
#include <ddp/strategies/allreduce.hpp>
#include <ddp/strategies/any.hpp>
#include <ddp/strategies/broadcast.hpp>
#include <ddp/strategies/custom.hpp>
#include <ddp/strategies/none.hpp>

#include <ddp/joinable.hpp>
#include <ddp/join.hpp>
