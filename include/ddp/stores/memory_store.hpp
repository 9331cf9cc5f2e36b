#pragma once
/// @file stores/memory_store.hpp
/// @brief `memory_store`: a store inside one process, for ranks that are threads (the `local`
/// backend, tests of the fault-tolerance Manager). Same contract as the file and Redis stores.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/error.hpp>
#include <ddp/store.hpp>
#include <ddp/stores/codec.hpp>

namespace ddp::stores {

/// A `store` in this process's memory, shared by reference between threads (thread-safe).
/// Neither copyable nor movable.
class memory_store {
 public:
  /// @param max_value_bytes  largest value `set` accepts
  explicit memory_store(std::size_t max_value_bytes = default_max_value_bytes) : limit_(max_value_bytes) {}
  memory_store(const memory_store&) = delete;
  memory_store& operator=(const memory_store&) = delete;

  /// Replaces the value of `key` and wakes every `wait`.
  /// @throws usage_error for an invalid key or a value over the limit
  void set(std::string_view key, std::span<const std::byte> value) {
    detail::check_key(key, "memory_store set");
    detail::check_value_size(key, value.size(), limit_);
    std::lock_guard lk(m_);
    values_[std::string(key)] = store_value(value.begin(), value.end());
    cv_.notify_all();
  }

  /// Stores `value` under `key` unless it has a value; returns the value it holds (`first_write_store`).
  store_value set_if_absent(std::string_view key, std::span<const std::byte> value) {
    detail::check_key(key, "memory_store set_if_absent");
    detail::check_value_size(key, value.size(), limit_);
    std::lock_guard lk(m_);
    const auto [it, fresh] = values_.try_emplace(std::string(key), value.begin(), value.end());
    if (fresh) cv_.notify_all();
    return it->second;
  }

  /// The value of `key`, or nothing if it is not set. Never blocks.
  [[nodiscard]] std::optional<store_value> get(std::string_view key) {
    detail::check_key(key, "memory_store get");
    std::lock_guard lk(m_);
    auto it = values_.find(std::string(key));
    if (it == values_.end()) return std::nullopt;
    return it->second;
  }

  /// Returns once every key is set.
  /// @throws timeout_error naming the keys still missing after `timeout`
  void wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) {
    for (const auto& k : keys) detail::check_key(k, "memory_store wait");
    std::unique_lock lk(m_);
    const bool ok = cv_.wait_for(lk, timeout, [&] {
      for (const auto& k : keys) {
        if (!values_.count(k)) return false;
      }
      return true;
    });
    if (!ok) {
      std::vector<std::string> missing;
      for (const auto& k : keys) {
        if (!values_.count(k)) missing.push_back(k);
      }
      throw timeout_error(
          -1, "memory_store wait",
          "keys not set within " + std::to_string(timeout.count()) + " ms: " + detail::list_keys(missing));
    }
  }

  /// Adds `delta` to the counter `key` (created at 0); returns the new value.
  std::int64_t add(std::string_view key, std::int64_t delta) {
    detail::check_key(key, "memory_store add");
    std::lock_guard lk(m_);
    auto& c = counters_[std::string(key)];
    // Two's-complement wrap-around instead of signed overflow, as the file store does.
    c = static_cast<std::int64_t>(static_cast<std::uint64_t>(c) + static_cast<std::uint64_t>(delta));
    return c;
  }

  /// Removes every value and counter whose key starts with `prefix`; returns how many.
  std::size_t erase_prefix(std::string_view prefix) {
    std::lock_guard lk(m_);
    std::size_t n = 0;
    for (auto it = values_.lower_bound(std::string(prefix)); it != values_.end() && it->first.starts_with(prefix);) {
      it = values_.erase(it);
      ++n;
    }
    for (auto it = counters_.lower_bound(std::string(prefix));
         it != counters_.end() && it->first.starts_with(prefix);) {
      it = counters_.erase(it);
      ++n;
    }
    return n;
  }

 private:
  std::size_t limit_;
  std::mutex m_;
  std::condition_variable cv_;
  std::map<std::string, store_value> values_;
  std::map<std::string, std::int64_t> counters_;
};

static_assert(first_write_store<memory_store>);

}  // namespace ddp::stores
