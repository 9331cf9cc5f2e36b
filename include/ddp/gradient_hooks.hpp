#pragma once
/// @file gradient_hooks.hpp
/// @brief Attaching "gradient ready" callbacks to a trainer's own autograd, with RAII removal.
///
/// PyTorch could not re-create DDP after a failure because every new reducer added hooks to the
/// same parameters and nothing removed the old ones, which kept firing into the reducer that was
/// gone (PyTorch issue #21344). Here every hook a component attaches is owned by an
/// `attached_hook`, which removes it when destroyed: destroying the Bucketer leaves the trainer's
/// autograd exactly as it was.
///
/// A registry is any type with
/// @code
///   H add_gradient_hook(std::size_t key, std::function<void()> on_ready);
///   void remove_gradient_hook(H handle) noexcept;   // (may throw: errors are swallowed on removal)
/// @endcode

#include <concepts>
#include <cstddef>
#include <functional>
#include <memory>
#include <utility>

namespace ddp {

/// A registry of "gradient ready" hooks (see the file description).
template <class R>
concept gradient_hook_registry = requires(R& r, std::size_t key, std::function<void()> fn) {
  r.add_gradient_hook(key, std::move(fn));
  r.remove_gradient_hook(r.add_gradient_hook(key, std::move(fn)));
};

/// Owns one attached hook; removes it on destruction. Move-only.
class attached_hook {
 public:
  attached_hook() = default;
  /// Attaches `fn` to gradient `key` of `registry`. `registry` must outlive this object (or
  /// `reset()` must be called before it goes away).
  template <gradient_hook_registry R>
  attached_hook(R& registry, std::size_t key, std::function<void()> fn) {
    auto handle = registry.add_gradient_hook(key, std::move(fn));
    remove_ = [&registry, handle]() mutable { registry.remove_gradient_hook(std::move(handle)); };
  }
  /// Takes over `o`'s hook; `o` is left detached.
  attached_hook(attached_hook&& o) noexcept : remove_(std::exchange(o.remove_, nullptr)) {}
  /// Removes this object's hook, then takes over `o`'s.
  attached_hook& operator=(attached_hook&& o) noexcept {
    if (this != &o) {
      reset();
      remove_ = std::exchange(o.remove_, nullptr);
    }
    return *this;
  }
  attached_hook(const attached_hook&) = delete;
  attached_hook& operator=(const attached_hook&) = delete;
  ~attached_hook() { reset(); }

  /// Removes the hook now (idempotent, never throws).
  void reset() noexcept {
    if (!remove_) return;
    auto remove = std::exchange(remove_, nullptr);
    try {
      remove();
    } catch (...) {  // a registry that fails to remove must not take the trainer down during cleanup
    }
  }
  /// True while this object owns a hook that is still attached.
  [[nodiscard]] bool attached() const noexcept { return static_cast<bool>(remove_); }

 private:
  std::function<void()> remove_;
};

}  // namespace ddp
