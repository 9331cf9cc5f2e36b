#pragma once
/// @file bucketer/buckets.hpp
/// @brief The Bucketer's bucket storage: `detail::bucketer_buckets`, which allocates the buckets
/// of a layout (host memory, or device memory on the communicator's stream), places each gradient
/// in its bucket and copies between buckets and gradients. Not for users.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include <ddp/bucket_layout.hpp>
#include <ddp/bucketer/device.hpp>
#include <ddp/bucketer/gradients.hpp>
#include <ddp/bucketer/options.hpp>
#include <ddp/communicator.hpp>
#include <ddp/detail/aligned_buffer.hpp>
#include <ddp/detail/device_buffer.hpp>
#include <ddp/device_runtime.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp::detail {

/// The buckets of the installed layout; a base of `bucketer_engine`.
class bucketer_buckets : protected bucketer_gradients {
 protected:
  explicit bucketer_buckets(communicator_ref comm) : bucketer_gradients(comm), dev_(comm.device_queue()) {}
  ~bucketer_buckets() = default;

  struct bucket {
    aligned_buffer storage;
    device_buffer device_storage;  // device buckets: the bucket on the communicator's device
    tensor_view data;
    std::vector<std::size_t> members;              // its gradients in slot order (ascending index)
    std::vector<tensor_view> direct;               // direct and in-place paths: the tensors of one launch
    bucket_path path = bucket_path::copy_divided;  // chosen by install_layout
    bool launched_in_place = false;                // this iteration's collective ran on the trainer's memory
    std::size_t gradients = 0;
    work inflight;
    bool launched = false;
    bool completed = false;
  };

  // Allocates bucket storage for `l` and points every entry at its slot; with `keep_values`, the
  // values in the old buckets move to the new ones (zero-copy gradients live there).
  void allocate_buckets(const bucket_layout& l, bool keep_values) {
    std::vector<bucket> fresh(l.buckets.size());
    std::vector<bucketer_entry> moved = entries_;
    for (std::size_t b = 0; b < l.buckets.size(); ++b) {
      // Slots in registration order within the bucket (as PyTorch lays out its bucket views), so a
      // trainer that allocates its gradients in one block in that order gets contiguous buckets.
      fresh[b].members = l.buckets[b];
      std::sort(fresh[b].members.begin(), fresh[b].members.end());
      std::size_t elems = 0;
      for (std::size_t i : fresh[b].members) {
        moved[i].bucket = b;
        moved[i].offset = elems;
        elems += entries_[i].gradient.count;
      }
      const gradient_info first{0, elems, entries_[l.buckets[b].front()].gradient.type, device::host()};
      if (dev_.on_device()) {  // device gradients: the bucket on their device, ordered on the comm stream
        fresh[b].device_storage = dev_.allocate(first.bytes());
        fresh[b].data = {fresh[b].device_storage.data(), elems, first.type, dev_.queue().where};
      } else {
        fresh[b].storage = aligned_buffer(first.bytes());
        fresh[b].data = {fresh[b].storage.data(), elems, first.type, device::host()};
      }
      fresh[b].gradients = l.buckets[b].size();
    }
    if (keep_values) {  // zero-copy gradients live in the old storage: carry them over
      std::vector<copy_region> carried;
      for (std::size_t i = 0; i < entries_.size(); ++i) {
        const tensor_view from = slot(entries_[i]);
        const tensor_view to = fresh[moved[i].bucket].data.slice(moved[i].offset, entries_[i].gradient.count);
        if (from.count) carried.push_back({to.data, from.data, from.bytes()});
      }
      copy_regions(carried);  // before the old storage goes: its release is ordered after these copies
    }
    buckets_ = std::move(fresh);
    entries_ = std::move(moved);
  }

  // ---- buckets -----------------------------------------------------------------------------

  [[nodiscard]] tensor_view slot(const bucketer_entry& e) const {
    return buckets_[e.bucket].data.slice(e.offset, e.gradient.count);
  }

  // Bucket b's non-empty gradients in slot order, adjacent ones merged into one tensor.
  [[nodiscard]] std::vector<tensor_view> bucket_gradients(std::size_t b) const {
    std::vector<tensor_view> out;
    for (const std::size_t i : buckets_[b].members) {
      const tensor_view& g = entries_[i].gradient;
      if (g.count == 0) continue;
      if (!out.empty() && out.back().type == g.type && out.back().where == g.where &&
          out.back().byte_data() + out.back().bytes() == g.byte_data()) {
        out.back().count += g.count;
      } else {
        out.push_back(g);
      }
    }
    return out;
  }

  // Bucket b's slots back into its gradients.
  [[nodiscard]] std::vector<copy_region> copy_back_regions(std::size_t b) const {
    std::vector<copy_region> out;
    for (const std::size_t i : buckets_[b].members) {
      const bucketer_entry& e = entries_[i];
      if (e.gradient.count) out.push_back({e.gradient.data, slot(e).data, e.gradient.bytes()});
    }
    return out;
  }

  // Copies between buckets and gradients: one batch on the comm stream for device buckets,
  // memcpy for host ones.
  void copy_regions(const std::vector<copy_region>& regions) {
    if (regions.empty()) return;
    if (dev_.on_device()) {
      dev_.copy(regions);
      return;
    }
    for (const copy_region& r : regions) std::memcpy(r.dst, r.src, r.bytes);
  }

  bucketer_device dev_;  // the communicator's device stream and the events ordering device buckets
  bucket_layout layout_;
  std::vector<bucket> buckets_;
  std::uint64_t fingerprint_ = 0;
};

}  // namespace ddp::detail
