#pragma once
// The simulation's rendezvous store: one linearizable map (a memory_store) that every simulated
// process reaches through its own `sim_store`, whose every operation is a scheduling point with
// a latency drawn by the scheduler, and may fail (an injected error) or hang until it times out
// (the process is partitioned from the store).
#include <chrono>
#include <functional>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include <ddp/error.hpp>
#include <ddp/store.hpp>
#include <ddp/stores/memory_store.hpp>

#include "scheduler.hpp"

namespace sim {

/// What the store does to the operations of the processes (shared by every `sim_store`).
struct store_faults {
  double error_rate = 0;                                     ///< chance an operation fails with an error
  double slow_rate = 0;                                      ///< chance an operation takes `slow` instead of 0-1 ms
  std::chrono::milliseconds slow{50};                        ///< a slow operation's latency
  std::chrono::milliseconds unreachable{2000};               ///< how long an operation of a cut-off process hangs
  std::vector<bool> cut_off = std::vector<bool>(64, false);  ///< by process tag
  std::function<void(int tag, const std::string&)> watch{};  ///< sees member lists written and erasures
};

class sim_store {
 public:
  sim_store(scheduler& s, ddp::stores::memory_store& shared, store_faults& faults, int tag)
      : s_(s), shared_(shared), faults_(faults), tag_(tag) {}

  void set(std::string_view key, std::span<const std::byte> value) {
    enter("set");
    if (faults_.watch && key.ends_with("members/closed")) {
      std::string text = ddp::to_text(value);
      for (char& c : text) c = c == '\n' ? ';' : c;
      faults_.watch(tag_, "set " + std::string(key) + " = " + text);
    }
    shared_.set(key, value);
  }
  ddp::store_value set_if_absent(std::string_view key, std::span<const std::byte> value) {
    enter("set_if_absent");
    if (faults_.watch && key.ends_with("members/closed")) {
      std::string text = ddp::to_text(value);
      for (char& c : text) c = c == '\n' ? ';' : c;
      faults_.watch(tag_, "set_if_absent " + std::string(key) + " = " + text);
    }
    return shared_.set_if_absent(key, value);
  }
  [[nodiscard]] std::optional<ddp::store_value> get(std::string_view key) {
    enter("get");
    return shared_.get(key);
  }
  std::int64_t add(std::string_view key, std::int64_t delta) {
    enter("add");
    return shared_.add(key, delta);
  }
  std::size_t erase_prefix(std::string_view prefix) {
    enter("erase_prefix");
    if (faults_.watch) faults_.watch(tag_, "erase_prefix " + std::string(prefix));
    return shared_.erase_prefix(prefix);
  }
  void wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) {
    enter("wait");
    const auto present = [&] {
      for (const auto& k : keys) {
        if (!shared_.get(k)) return false;
      }
      return true;
    };
    if (!s_.block_until(present, s_.now() + timeout)) {
      throw ddp::timeout_error(-1, "sim_store::wait", "keys missing after " + std::to_string(timeout.count()) + " ms");
    }
  }

 private:
  // Every operation: a latency (a scheduling point), then maybe a failure.
  void enter(const char* op) {
    s_.yield();
    if (faults_.cut_off[static_cast<std::size_t>(tag_)]) {
      s_.sleep_until(s_.now() + faults_.unreachable);
      throw ddp::communication_error(-1, std::string("sim_store::") + op, "the store is unreachable (partition)");
    }
    const auto latency = s_.chance(faults_.slow_rate) ? faults_.slow : std::chrono::milliseconds(s_.uniform(0, 1));
    s_.sleep_until(s_.now() + latency);
    if (s_.chance(faults_.error_rate)) {
      throw ddp::communication_error(-1, std::string("sim_store::") + op, "injected store error");
    }
  }

  scheduler& s_;
  ddp::stores::memory_store& shared_;
  store_faults& faults_;
  int tag_;
};

static_assert(ddp::first_write_store<sim_store>);

}  // namespace sim
