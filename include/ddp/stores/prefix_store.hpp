#pragma once
/// @file stores/prefix_store.hpp
/// @brief `prefix_store`: a view of a store in which every key is prefixed, and the helpers that
/// give each job and each generation of communicators its own namespace.
///
/// Why generations: gloo publishes each rank's address under fixed keys ("0", "1", ...). A new
/// communicator built after a failure must never read the addresses of the dead one, so every
/// communicator of a job is built in a fresh namespace `<job>/g<generation>/`. Survivors that
/// saw generation g fail all move to g + 1; once the new group is up, the old generation's keys
/// are erased (`retire_generation`).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ddp/store.hpp>
#include <ddp/stores/codec.hpp>

namespace ddp::stores {

/// A store whose keys are `prefix + key` in an underlying store, which must outlive it.
template <store S>
class prefix_store {
 public:
  /// @param inner   the store the keys live in; must outlive this view
  /// @param prefix  key characters; usually ends with '/' so that "a/" never matches "ab/..."
  prefix_store(S& inner, std::string prefix) : inner_(&inner), prefix_(std::move(prefix)) {
    detail::check_key(prefix_, "prefix_store", /*allow_empty=*/true);
  }

  /// Sets `prefix + key`.
  void set(std::string_view key, std::span<const std::byte> value) { inner_->set(full(key), value); }
  /// Gets `prefix + key`.
  [[nodiscard]] std::optional<store_value> get(std::string_view key) { return inner_->get(full(key)); }
  /// Waits for `prefix + key` of every key.
  void wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) {
    std::vector<std::string> full_keys;
    full_keys.reserve(keys.size());
    for (const auto& k : keys) full_keys.push_back(full(k));
    inner_->wait(full_keys, timeout);
  }
  /// Adds to the counter `prefix + key`.
  std::int64_t add(std::string_view key, std::int64_t delta) { return inner_->add(full(key), delta); }
  /// True if the inner store can `set_if_absent`.
  [[nodiscard]] bool has_set_if_absent() const noexcept { return ddp::detail::has_set_if_absent(*inner_); }
  /// The inner store's `set_if_absent` of `prefix + key` (`first_write_store`).
  /// @throws usage_error if it has none
  store_value set_if_absent(std::string_view key, std::span<const std::byte> value) requires first_write_store<S> ||
      requires(S& s) {
    s.has_set_if_absent();
  }
  { return inner_->set_if_absent(full(key), value); }
  /// Erases under `this prefix + prefix`: `erase_prefix("")` empties this view.
  std::size_t erase_prefix(std::string_view prefix) { return inner_->erase_prefix(prefix_ + std::string(prefix)); }

  /// The prefix of every key.
  [[nodiscard]] const std::string& prefix() const noexcept { return prefix_; }
  /// The underlying store.
  [[nodiscard]] S& inner() const noexcept { return *inner_; }

 private:
  std::string full(std::string_view key) const {
    // An empty key would alias the prefix itself; keys are checked again by the inner store.
    if (key.empty()) detail::check_key(key, "prefix_store");
    return prefix_ + std::string(key);
  }

  S* inner_;
  std::string prefix_;
};

/// The namespace of one generation of one job: "<job>/g<generation>/".
[[nodiscard]] inline std::string generation_prefix(std::string_view job, std::uint64_t generation) {
  std::string p = std::string(job) + "/g" + std::to_string(generation) + "/";
  detail::check_key(p, "generation_prefix");
  return p;
}

/// The store as seen by generation `generation` of `job`.
template <store S>
[[nodiscard]] prefix_store<S> generation_store(S& inner, std::string_view job, std::uint64_t generation) {
  return prefix_store<S>(inner, generation_prefix(job, generation));
}

/// Erases every key of generation `generation` of `job`; returns how many. Call it once no
/// member can still be reading them (after the next generation's communicator is up).
template <store S>
std::size_t retire_generation(S& inner, std::string_view job, std::uint64_t generation) {
  return inner.erase_prefix(generation_prefix(job, generation));
}

static_assert(store<prefix_store<store_ref>>);

}  // namespace ddp::stores
