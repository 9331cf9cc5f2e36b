#pragma once
/// @file testing/emulated.hpp
/// @brief The host emulation of the device runtime (`ddp::emulated_device::runtime`) and a
/// device communicator over any host communicator (`ddp::emulated_device::communicator`).
///
/// Why: the components' device code paths (buckets per device, copies ordered on streams,
/// events between streams, the no-host-sync contract, their error paths) run and are tested in
/// CI without a GPU, and a user can run the logic of a CUDA trainer on a CPU.
///
/// The model:
/// - **Device memory is host memory** (256-byte aligned) that the runtime allocates and tracks;
///   whoever views it tags it `device::cuda(k)`. Tests may read it directly once the work that
///   writes it completed (after `synchronize`, or a completed `query`). Fresh allocations are
///   filled with 0xA5 bytes, never zero, like uninitialised device memory: a missing zero fill
///   shows.
/// - **A stream is a FIFO queue of steps.** A step is a function that returns true when it is
///   done: a copy, a zero fill, a free, an event's record marker finish in one call; a collective
///   of the emulated communicator returns false until its host collective completed, so nothing
///   ever blocks inside a step. Waiting for an event is a step that is done once that record of
///   the event completed.
/// - **Execution is lazy and deterministic**: enqueuing runs nothing. `query`, `synchronize` and
///   `run_ready` pump: they run the head step of every stream that is not held, in stream
///   creation order, popping the finished ones, until a full pass makes no progress. Steps run in
///   the pumping thread, one thread at a time, never under the lock that guards the queues.
/// - **Events as in CUDA**: an event is complete once the marker of its last record ran; a never
///   recorded event is complete; recording again makes it incomplete until the new marker runs; a
///   wait captures the record current at the time of the call.
/// - **Errors are sticky per stream**: a step that throws fails its stream; the stream's later
///   steps are not run (frees still are), events recorded behind it fail with the error, and so
///   do streams that wait for them; `query` and `synchronize` of a failed event rethrow it.
/// - **A host synchronisation is a call of `synchronize`**, counted by `host_syncs()`: the
///   components' promise that the hot path does not block the host is checked with it. A
///   collective over host tensors through the emulated communicator is one (it is staged through
///   device memory and completes before it returns).
/// - Test hooks (not in the interface): `launch` (a kernel), `hold`/`release` (a held stream runs
///   nothing, so a test can see what has not happened yet), and counters. A `synchronize` that
///   could only complete after a held stream is released throws `usage_error` instead of hanging.
///
/// Not emulated: the legacy default stream's implicit synchronisation (the null stream is an
/// ordinary stream here: stricter, so code correct here is ordered on CUDA too), timing, and
/// concurrency between device work and the host (device work runs only when the host pumps).

#include <ddp/testing/emulated_communicator.hpp>
#include <ddp/testing/emulated_runtime.hpp>
