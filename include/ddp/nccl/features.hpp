#pragma once
/// @file features.hpp
/// @brief Which NCCL features the installed `nccl.h` offers. Each `DDP_NCCL_HAS_*` macro may be
/// predefined (to 0) to switch a feature off, e.g. when headers and library come from different
/// releases.

#include <nccl.h>

// Used unconditionally: ncclAvg and ncclBfloat16 (2.10), ncclGetLastError (2.13),
// ncclCommInitRankConfig and ncclCommFinalize (2.14).
#if !defined(NCCL_VERSION_CODE) || NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "ddp::nccl needs NCCL 2.14 or newer"
#endif

// The fault-tolerance calls are detected by the flag macros nccl.h declares beside them, not by
// version: NCCL 2.28.3 has neither ncclCommRevoke nor NCCL_REVOKE_DEFAULT, 2.28.9 has both.

/// 1 when `ncclCommShrink` exists (NCCL 2.27 and later): rebuild a communicator without failed ranks.
#ifndef DDP_NCCL_HAS_SHRINK
#if defined(NCCL_SHRINK_DEFAULT)
#define DDP_NCCL_HAS_SHRINK 1
#else
#define DDP_NCCL_HAS_SHRINK 0
#endif
#endif

/// 1 when `ncclCommRevoke` exists (some NCCL 2.28 releases: 2.28.9 but not 2.28.3): stop in-flight
/// work without freeing the communicator, so it can be shrunk afterwards.
#ifndef DDP_NCCL_HAS_REVOKE
#if defined(NCCL_REVOKE_DEFAULT)
#define DDP_NCCL_HAS_REVOKE 1
#else
#define DDP_NCCL_HAS_REVOKE 0
#endif
#endif
