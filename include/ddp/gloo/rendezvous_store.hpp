#pragma once
/// @file gloo/rendezvous_store.hpp
/// @brief gloo's view of a ddp store while a communicator connects.
///
/// gloo's full-mesh connect publishes each rank's addresses and reads the others'. Left alone it
/// waits a fixed 30 s for a missing rank whatever timeout is configured (its `get` blocks for
/// the store's default). Here every wait and every `get` is bounded by the connect deadline,
/// and keys are write-once: finding one already set means this namespace was used by an earlier
/// communicator, whose dead addresses must not be read.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <gloo/rendezvous/store.h>

#include <ddp/error.hpp>
#include <ddp/gloo/errors.hpp>
#include <ddp/progress.hpp>
#include <ddp/store.hpp>

namespace ddp::gloo::detail {

class rendezvous_store final : public ::gloo::rendezvous::Store {
 public:
  rendezvous_store(store_ref store, std::string prefix, int rank, std::chrono::steady_clock::time_point deadline,
                   int size = 0, const progress_sink* progress = nullptr)
      : store_(store),
        prefix_(std::move(prefix)),
        rank_(rank),
        deadline_(deadline),
        size_(size),
        meter_(progress, "gloo connect", rank, 0, {}, std::chrono::milliseconds(500)) {}

  /// Connected: the final progress report (printed only if the wait was reported before).
  void connected() {
    meter_.members(size_, size_);
    meter_.finish();
  }

  void set(const std::string& key, const std::vector<char>& data) override {
    const std::string k = prefix_ + key;
    if (store_.get(k)) {
      throw usage_error(rank_, "gloo connect",
                        "store key '" + k +
                            "' is already set: this namespace was used by an earlier communicator. Build every "
                            "communicator under a fresh generation prefix (stores::generation_store)");
    }
    store_.set(k, std::span<const std::byte>(reinterpret_cast<const std::byte*>(data.data()), data.size()));
    if (key == std::to_string(rank_)) own_addresses_ = data;
  }

  /// Every rank's published gloo addresses (gloo's key "<rank>"), this rank's own as it wrote
  /// them (the store could return something else), for the authentication's binding.
  std::vector<std::vector<char>> addresses(int size) {
    std::vector<std::vector<char>> all;
    all.reserve(static_cast<std::size_t>(size));
    for (int r = 0; r < size; ++r) all.push_back(r == rank_ ? own_addresses_ : get(std::to_string(r)));
    return all;
  }

  std::vector<char> get(const std::string& key) override {
    wait({key}, left());
    auto v = store_.get(prefix_ + key);
    if (!v) throw communication_error(rank_, "gloo connect", "store key '" + prefix_ + key + "' vanished");
    const auto* p = reinterpret_cast<const char*>(v->data());
    return {p, p + v->size()};
  }

  void wait(const std::vector<std::string>& keys) override { wait(keys, left()); }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (const auto& k : keys) full.push_back(prefix_ + k);
    const auto budget = std::min(timeout, left());
    try {
      wait_reporting(full, budget);
    } catch (const timeout_error& e) {
      std::string who;
      for (const auto& k : keys) who += (who.empty() ? "" : ", ") + member_of(k);
      throw timeout_error(rank_, "gloo connect",
                          who + " did not publish its address within the connect timeout (" + e.message() + ")");
    }
  }

 private:
  std::chrono::milliseconds left() const {
    const auto d = std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - std::chrono::steady_clock::now());
    return std::max(d, std::chrono::milliseconds(0));
  }

  // Waits in slices while a progress sink listens, reporting the ranks whose address is missing.
  void wait_reporting(const std::vector<std::string>& full, std::chrono::milliseconds budget) {
    if (size_ <= 0 || !meter_.active()) return store_.wait(full, budget);
    const auto end = std::chrono::steady_clock::now() + budget;
    for (;;) {
      const auto now = std::chrono::steady_clock::now();
      const auto slice =
          std::min(std::chrono::duration_cast<std::chrono::milliseconds>(end - now), std::chrono::milliseconds(500));
      try {
        store_.wait(full, std::max(slice, std::chrono::milliseconds(0)));
        return;
      } catch (const timeout_error&) {
        if (std::chrono::steady_clock::now() >= end) throw;
      }
      std::vector<std::string> missing;
      for (int r = 0; r < size_; ++r) {
        if (r != rank_ && !store_.get(prefix_ + std::to_string(r))) missing.push_back("rank " + std::to_string(r));
      }
      meter_.members(size_ - static_cast<int>(missing.size()), size_, std::move(missing));
    }
  }

  // gloo's keys are "<rank>" (addresses) and "rank_<rank>" (host names), ddp's "peer_<rank>"
  // (gloo/authenticate.hpp): name the member.
  static std::string member_of(const std::string& key) {
    const std::string digits = key.rfind("rank_", 0) == 0 || key.rfind("peer_", 0) == 0 ? key.substr(5) : key;
    const bool numeric = !digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos;
    return numeric ? "rank " + digits : "key '" + key + "'";
  }

  store_ref store_;
  std::string prefix_;
  int rank_;
  std::chrono::steady_clock::time_point deadline_;
  int size_;
  progress_meter meter_;
  std::vector<char> own_addresses_;
};

}  // namespace ddp::gloo::detail
