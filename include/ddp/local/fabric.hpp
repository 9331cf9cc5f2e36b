#pragma once
/// @file local/fabric.hpp
/// @brief `local::fabric`: builds local (thread) communicators for member sets decided at run
/// time, e.g. by survivors of a failure who met in a store. Ranks of one group ask for the same
/// key and size; the first caller creates the group.

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include <ddp/error.hpp>
#include <ddp/local/communicator.hpp>

namespace ddp::local {

/// Registry of local communicator groups by key, shared by the threads that play ranks
/// (thread-safe). Typically the communicator factory of a fault-tolerance Manager in tests.
class fabric {
 public:
  /// @param opts  options of every group this fabric creates
  explicit fabric(options opts = {}) : opts_(std::move(opts)) {}

  /// Rank `rank` of the group `key` of `size` ranks. Every member must pass the same size.
  [[nodiscard]] communicator connect(const std::string& key, int rank, int size) {
    std::lock_guard lk(m_);
    auto& g = groups_[key];
    if (!g) g = std::make_shared<detail::group>(size, opts_);
    if (g->size != size || rank < 0 || rank >= size) {
      throw usage_error(rank, "local::fabric::connect",
                        "group '" + key + "' has " + std::to_string(g->size) + " ranks; asked for rank " +
                            std::to_string(rank) + " of " + std::to_string(size));
    }
    return communicator(g, rank);
  }

  /// Forgets a group (its communicators stay valid).
  void forget(const std::string& key) {
    std::lock_guard lk(m_);
    groups_.erase(key);
  }

 private:
  options opts_;
  std::mutex m_;
  std::map<std::string, std::shared_ptr<detail::group>> groups_;
};

}  // namespace ddp::local
