#pragma once
/// @file ddp.hpp
/// @brief Umbrella header: everything backend-independent. Never includes <mpi.h> or <nccl.h>;
/// backends have their own headers (`<ddp/mpi.hpp>`, `<ddp/nccl.hpp>`, `<ddp/gloo.hpp>`,
/// `<ddp/local.hpp>`).

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
#include <ddp/straggler.hpp>

#include <ddp/buffer_reducer.hpp>
#include <ddp/strategies/allreduce.hpp>
#include <ddp/strategies/any.hpp>
#include <ddp/strategies/broadcast.hpp>
#include <ddp/strategies/custom.hpp>
#include <ddp/strategies/none.hpp>

#include <ddp/joinable.hpp>
#include <ddp/join.hpp>

#include <ddp/any_communicator.hpp>
#include <ddp/training_state.hpp>
#include <ddp/manager.hpp>

#include <ddp/data/global_batch_sampler.hpp>
#include <ddp/partition.hpp>
#include <ddp/reproducible.hpp>

#include <ddp/progress.hpp>
#include <ddp/timeline.hpp>
