#pragma once
/// @file testing/emulated_host_side.hpp
/// @brief `ddp::emulated_device::detail::host_side`: the emulated runtime's host staging, its
/// "page-locked" host memory (plain host memory) and its gates (flags a stream step waits for).

#include <atomic>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <set>

#include <ddp/device_runtime.hpp>
#include <ddp/error.hpp>

namespace ddp::emulated_device::detail {

/// Host allocations and gates of one emulated runtime; thread-safe.
class host_side {
 public:
  /// Allocations aligned to `alignment` bytes.
  explicit host_side(std::size_t alignment) noexcept : alignment_(alignment) {}
  host_side(const host_side&) = delete;
  host_side& operator=(const host_side&) = delete;
  /// Frees what is left.
  ~host_side() {
    for (void* p : allocs_) ::operator delete (p, std::align_val_t{alignment_});
  }

  /// Null for 0 bytes.
  [[nodiscard]] void* allocate(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    void* p = ::operator new (bytes, std::align_val_t{alignment_});
    std::lock_guard lk(m_);
    allocs_.insert(p);
    return p;
  }
  /// False for a pointer that is not a live allocation (left alone); true for null.
  bool deallocate(void* memory) noexcept {
    if (memory == nullptr) return true;
    std::lock_guard lk(m_);
    if (allocs_.erase(memory) == 0) return false;
    ::operator delete (memory, std::align_val_t{alignment_});
    return true;
  }

  /// A closed gate.
  [[nodiscard]] device_gate create_gate() {
    auto g = std::make_shared<std::atomic<bool>>(false);
    std::lock_guard lk(m_);
    gates_.emplace(g.get(), g);
    return {g.get()};
  }
  /// The gate's flag, shared with the step that waits for it. @throws usage_error if not live
  [[nodiscard]] std::shared_ptr<std::atomic<bool>> flag(device_gate gate, int rank) const {
    std::lock_guard lk(m_);
    const auto it = gates_.find(gate.native);
    if (it == gates_.end()) throw usage_error(rank, "emulated_device::wait_gate", "not a live gate of this runtime");
    return it->second;
  }
  /// Opens a live gate; nothing for another.
  void open_gate(device_gate gate) noexcept {
    std::lock_guard lk(m_);
    if (const auto it = gates_.find(gate.native); it != gates_.end()) it->second->store(true);
  }
  /// The gate goes now; a step still waiting for it keeps its flag.
  void destroy_gate(device_gate gate) noexcept {
    std::lock_guard lk(m_);
    gates_.erase(gate.native);
  }

  /// Gates created and not destroyed.
  [[nodiscard]] std::size_t live_gates() const {
    std::lock_guard lk(m_);
    return gates_.size();
  }
  /// Host allocations not freed.
  [[nodiscard]] std::size_t live_allocations() const {
    std::lock_guard lk(m_);
    return allocs_.size();
  }

 private:
  const std::size_t alignment_;
  mutable std::mutex m_;
  std::set<void*> allocs_;
  std::map<void*, std::shared_ptr<std::atomic<bool>>> gates_;
};

}  // namespace ddp::emulated_device::detail
