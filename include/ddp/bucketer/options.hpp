#pragma once
/// @file bucketer/options.hpp
/// @brief What a `Bucketer` (ddp/bucketer.hpp) is told and what it reports: its knobs
/// (`bucketer_options`), the data path each bucket takes (`bucket_path`), and the statistics of the
/// last iteration (`bucket_stats`, `step_stats`). See docs/bucketer.md.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include <ddp/straggler.hpp>

namespace ddp {

/// Knobs of a Bucketer that are not about the layout (the layout's knobs live in the policy).
struct bucketer_options {
  /// Gradients live inside bucket storage (PyTorch's gradient_as_bucket_view): no copy in or out.
  /// The trainer writes gradient i into `gradient_view(i)` (valid after `build()`), and is told
  /// through `on_rebind` if storage moves (a rebuilding policy moves it once).
  bool zero_copy = false;
  /// Gradients not marked ready by `finalize()` count as zeros instead of being an error. A gradient
  /// unused on every rank is left untouched (copy path) or zero (zero-copy path).
  bool find_unused_parameters = false;
  /// Compare a fingerprint of the gradients and the layout across ranks in `build()` (one allgather).
  /// Over a Manager or GroupManager before its first quorum (`layout_adopting_communicator`) the
  /// check is theirs instead, at every quorum, and this setting is not used.
  bool check_layout = true;
  /// Test the in-flight buckets on every `mark_ready` (docs/bucketer.md, "Progress"). Turn off
  /// only for backends that progress on their own.
  bool progress_on_mark_ready = true;
  /// If non-zero, a helper thread tests the in-flight buckets every `progress_interval` while any
  /// are in flight, so that collectives advance during long gaps between `mark_ready` calls (a
  /// large layer's backward kernel). Costs a thread that wakes at this rate during the backward
  /// pass; needs a backend that accepts calls from several threads (MPI: THREAD_MULTIPLE or
  /// SERIALIZED). Off by default: measure it (bench/overlap_bench) on your machine.
  std::chrono::microseconds progress_interval{0};
  /// Every this many synchronised iterations, `finalize()` ends with one allgather of
  /// `timing_words` int64 per rank, after which every rank knows who was slowest
  /// (`step_stats::straggler`, see straggler.hpp). 0: never. Every rank must use the same value,
  /// and ranks must agree on the iteration count (with a Manager, where a replica may start
  /// later, use 0 or 1).
  std::uint32_t straggler_every = 0;
  /// On a backend that stages its input anyway (`communicator_ref::stages_input()`), hand it the
  /// gradients directly (`bucket_path::direct`): taken with the default hook, the copy path, and
  /// without `find_unused_parameters`; `direct()` says whether it was. false: always copy.
  bool direct_when_staged = true;

  /// Memberwise.
  friend bool operator==(const bucketer_options&, const bucketer_options&) = default;
};

/// How a bucket's gradients reach its collective and the average reaches them. Chosen once per
/// bucket when its layout is installed (`build()`, and a rebuilding policy's one rebuild), from the
/// communicator, the options, the comm hook and where the gradients lie; every path gives the
/// same bits as the copy paths.
enum class bucket_path : std::uint8_t {
  /// Host, default hook: `mark_ready` copies the gradient into the bucket divided by the number of
  /// ranks (fused, as PyTorch's `mul_out`, during the backward pass), the bucket is summed, and
  /// each bucket is copied back as soon as it completes.
  copy_divided,
  /// Host, a registered comm hook: plain copies in, the hook averages the bucket, copies back.
  copy_with_hook,
  /// `bucketer_options::zero_copy` on the host: the gradients live in the bucket; no copies.
  zero_copy,
  /// A backend that stages its input (`stages_input()`) with the default hook: the bucket is one
  /// coalesced call over the gradients themselves, divided by the backend on its way in; no
  /// copies. The average lands in the gradients when the collective completes.
  direct,
  /// Host, default hook, the bucket's gradients back to back in memory in its order (contiguous
  /// gradients): `mark_ready` divides each in place, the sum runs on the trainer's memory, nothing
  /// is copied (if a gradient moved since `build()`, the bucket is copied in at launch and back).
  in_place,
  /// Device buckets: stream-ordered copy in on the communicator's stream, the comm hook, the copy
  /// back enqueued right behind it.
  device,
  /// Device buckets with `zero_copy`: `mark_ready` only orders the comm stream after the gradient.
  device_zero_copy,
};

/// The path's name, for logs: "copy_divided", "in_place", ...
[[nodiscard]] constexpr std::string_view name_of(bucket_path p) noexcept {
  switch (p) {
    case bucket_path::copy_divided: return "copy_divided";
    case bucket_path::copy_with_hook: return "copy_with_hook";
    case bucket_path::zero_copy: return "zero_copy";
    case bucket_path::direct: return "direct";
    case bucket_path::in_place: return "in_place";
    case bucket_path::device: return "device";
    case bucket_path::device_zero_copy: return "device_zero_copy";
  }
  return "unknown";
}

/// What one bucket did in the last synchronised iteration.
struct bucket_stats {
  std::size_t bytes = 0;      ///< size of the bucket's storage
  std::size_t gradients = 0;  ///< gradients grouped in the bucket
  double launched_ms = -1;    ///< since the iteration's first mark_ready (-1: never)
  double completed_ms = -1;   ///< when completion was first observed
  /// The collective ran on the trainer's memory: the bucket's gradients were one block
  /// (contiguous gradients) or were handed to the backend directly (`Bucketer::direct()`).
  bool in_place = false;
  /// The bucket's data path, fixed when the layout was installed.
  bucket_path path = bucket_path::copy_divided;
};

/// What the last synchronised iteration did: read it to see whether communication is hidden.
struct step_stats {
  std::uint64_t iteration = 0;        ///< synchronised iterations so far (including this one)
  std::vector<bucket_stats> buckets;  ///< per bucket, in launch order
  double backward_ms = 0;             ///< first mark_ready to the finalize() call
  double finalize_wait_ms = 0;        ///< time finalize() spent waiting for collectives
  std::size_t collectives = 0;        ///< hook launches plus the Bucketer's own collectives
  bool shadowed = false;              ///< this rank had joined and mirrored the others' collectives
  bool rebuilt = false;               ///< the layout was rebuilt at the end of this iteration
  // ---- straggler attribution (straggler.hpp) ----
  double last_ready_ms = 0;    ///< first to last mark_ready: this rank's backward pass
  double arrival_wait_ms = 0;  ///< last mark_ready to the last bucket's completion (short: others waited for this rank)
  straggler_report straggler;  ///< every rank's timing, when exchanged (`bucketer_options::straggler_every`)
};

}  // namespace ddp
