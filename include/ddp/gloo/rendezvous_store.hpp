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
#include <ddp/store.hpp>

namespace ddp::gloo::detail {

class rendezvous_store final : public ::gloo::rendezvous::Store {
 public:
  rendezvous_store(store_ref store, std::string prefix, int rank, std::chrono::steady_clock::time_point deadline)
      : store_(store), prefix_(std::move(prefix)), rank_(rank), deadline_(deadline) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    const std::string k = prefix_ + key;
    if (store_.get(k)) {
      throw usage_error(rank_, "gloo connect",
                        "store key '" + k +
                            "' is already set: this namespace was used by an earlier communicator. Build every "
                            "communicator under a fresh generation prefix (stores::generation_store)");
    }
    store_.set(k, std::span<const std::byte>(reinterpret_cast<const std::byte*>(data.data()), data.size()));
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
      store_.wait(full, budget);
    } catch (const timeout_error& e) {
      std::string who;
      for (const auto& k : keys) who += (who.empty() ? "" : ", ") + member_of(k);
      throw timeout_error(rank_, "gloo connect",
                          who + " did not publish its address within the connect timeout (" + bare_message(e) + ")");
    }
  }

 private:
  std::chrono::milliseconds left() const {
    const auto d = std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - std::chrono::steady_clock::now());
    return std::max(d, std::chrono::milliseconds(0));
  }

  // gloo's keys are "<rank>" (addresses) and "rank_<rank>" (host names): name the member.
  static std::string member_of(const std::string& key) {
    const std::string digits = key.rfind("rank_", 0) == 0 ? key.substr(5) : key;
    const bool numeric = !digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos;
    return numeric ? "rank " + digits : "key '" + key + "'";
  }

  store_ref store_;
  std::string prefix_;
  int rank_;
  std::chrono::steady_clock::time_point deadline_;
};

}  // namespace ddp::gloo::detail
