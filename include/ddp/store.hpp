#pragma once
/// @file store.hpp
/// @brief The rendezvous `store` concept, and `store_ref`, the non-owning type-erased reference
/// through which communicators and helpers use any store without being templated on it.
///
/// A store is a small key-value service every member of a job can reach (a directory on a shared
/// file system, a Redis server, or a user's model): communicators exchange their addresses
/// through it, and survivors of a failure meet in it to agree on a new member set. The contract
/// of a model (keys, values, set/get/wait/add/erase_prefix, errors): docs/backends-gloo.md
/// ("Rendezvous stores").

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <ddp/error.hpp>

namespace ddp {

/// The bytes of a stored value.
using store_value = std::vector<std::byte>;

/// Largest value a store accepts unless configured otherwise. Rendezvous data is small (a gloo
/// address is 136 bytes per peer); a limit catches a wrong key pointing at something huge.
inline constexpr std::size_t default_max_value_bytes = std::size_t{4} << 20;

/// Longest key, in bytes (keeps file-store names under the usual 255-byte file-name limit).
inline constexpr std::size_t max_key_bytes = 256;

/// A rendezvous store: see the contract at the top of this file.
template <class S>
concept store = requires(S& s, std::string_view key, std::span<const std::byte> value,
                         std::span<const std::string> keys, std::chrono::milliseconds timeout, std::int64_t delta) {
  { s.set(key, value) } -> std::same_as<void>;
  { s.get(key) } -> std::same_as<std::optional<store_value>>;
  { s.wait(keys, timeout) } -> std::same_as<void>;
  { s.add(key, delta) } -> std::same_as<std::int64_t>;
  { s.erase_prefix(key) } -> std::same_as<std::size_t>;
};

/// A store that can also write a key only if it has no value yet: `set_if_absent(key, value)`
/// stores `value` if `key` has none, atomically, and returns the value `key` holds afterwards
/// (the first writer's, whoever that was). With it, a group that forms in the store (the
/// Manager's quorums) closes in one operation; without it, by a counter claim and then a write,
/// which a process that dies between the two leaves unclosed (docs/backends-gloo.md).
template <class S>
concept first_write_store = store<S> && requires(S& s, std::string_view key, std::span<const std::byte> value) {
  { s.set_if_absent(key, value) } -> std::same_as<store_value>;
};

/// Non-owning reference to any store. Cheap to copy; the store must outlive the reference.
class store_ref {
 public:
  /// Refers to `s`, which must outlive the reference.
  template <store S>
  requires(!std::same_as<std::remove_cvref_t<S>, store_ref>) store_ref(S& s)
  noexcept  // NOLINT(google-explicit-constructor): a reference converts implicitly
      : obj_(&s), vt_(&table_for<S>) {}
  template <store S>
  requires(!std::same_as<std::remove_cvref_t<S>, store_ref>) store_ref(S&&)
  = delete;  // would dangle

  /// Replaces the value of `key` atomically.
  void set(std::string_view key, std::span<const std::byte> value) const { vt_->set(obj_, key, value); }
  /// The value of `key`, or nothing if it is not set. Never blocks.
  [[nodiscard]] std::optional<store_value> get(std::string_view key) const { return vt_->get(obj_, key); }
  /// Returns once every key is set. @throws timeout_error naming the missing keys
  void wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) const {
    vt_->wait(obj_, keys, timeout);
  }
  /// Adds `delta` to the counter `key` (created at 0) atomically; returns the new value.
  std::int64_t add(std::string_view key, std::int64_t delta) const { return vt_->add(obj_, key, delta); }
  /// Removes every value and counter whose key starts with `prefix`; returns how many.
  std::size_t erase_prefix(std::string_view prefix) const { return vt_->erase_prefix(obj_, prefix); }
  /// True if the referenced store models `first_write_store`.
  [[nodiscard]] bool has_set_if_absent() const noexcept { return vt_->set_if_absent != nullptr; }
  /// The referenced store's `set_if_absent` (`first_write_store`).
  /// @throws usage_error if it has none (ask `has_set_if_absent()` first)
  store_value set_if_absent(std::string_view key, std::span<const std::byte> value) const {
    if (!vt_->set_if_absent) throw usage_error(-1, "store set_if_absent", "this store has no set_if_absent");
    return vt_->set_if_absent(obj_, key, value);
  }

 private:
  struct vtable {
    void (*set)(void*, std::string_view, std::span<const std::byte>);
    std::optional<store_value> (*get)(void*, std::string_view);
    void (*wait)(void*, std::span<const std::string>, std::chrono::milliseconds);
    std::int64_t (*add)(void*, std::string_view, std::int64_t);
    std::size_t (*erase_prefix)(void*, std::string_view);
    store_value (*set_if_absent)(void*, std::string_view, std::span<const std::byte>);  // null: none
  };

  template <class S>
  static constexpr auto first_set_of() {
    using fn = store_value (*)(void*, std::string_view, std::span<const std::byte>);
    if constexpr (first_write_store<S>) {
      return fn{[](void* o, std::string_view k, std::span<const std::byte> v) {
        return static_cast<S*>(o)->set_if_absent(k, v);
      }};
    } else {
      return fn{nullptr};
    }
  }

  template <class S>
  static constexpr vtable table_for = {
      [](void* o, std::string_view k, std::span<const std::byte> v) { static_cast<S*>(o)->set(k, v); },
      [](void* o, std::string_view k) { return static_cast<S*>(o)->get(k); },
      [](void* o, std::span<const std::string> ks, std::chrono::milliseconds t) { static_cast<S*>(o)->wait(ks, t); },
      [](void* o, std::string_view k, std::int64_t d) { return static_cast<S*>(o)->add(k, d); },
      [](void* o, std::string_view p) { return static_cast<S*>(o)->erase_prefix(p); },
      first_set_of<S>(),
  };

  void* obj_;
  const vtable* vt_;
};

static_assert(store<store_ref>, "store_ref must itself model the concept");

namespace detail {
/// Whether `s` can `set_if_absent`: a `first_write_store`, or a reference to one.
template <ddp::store S>
[[nodiscard]] bool has_set_if_absent(S& s) noexcept {
  if constexpr (requires { s.has_set_if_absent(); }) {
    return s.has_set_if_absent();
  } else {
    return first_write_store<S>;
  }
}
}  // namespace detail

/// The bytes of a string, for `set`.
[[nodiscard]] inline std::span<const std::byte> as_bytes(std::string_view s) noexcept {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

/// A stored value read back as text.
[[nodiscard]] inline std::string to_text(std::span<const std::byte> value) {
  return {reinterpret_cast<const char*>(value.data()), value.size()};
}

/// Waits up to `timeout` for `key`, then returns its value.
/// @throws timeout_error if the key is not set in time
template <store S>
[[nodiscard]] store_value wait_get(S& s, const std::string& key, std::chrono::milliseconds timeout) {
  s.wait(std::span<const std::string>(&key, 1), timeout);
  if (auto v = s.get(key)) return std::move(*v);
  // Only a concurrent erase_prefix gets here: the key existed a moment ago.
  throw communication_error(-1, "store get '" + key + "'", "the key was removed while it was being read");
}

}  // namespace ddp
