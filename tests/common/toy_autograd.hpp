#pragma once
// A minimal stand-in for a trainer's own autograd: per-parameter lists of "gradient ready" hooks,
// so tests can attach a Bucketer's hooks, fire them, and count how many are still attached.

#include <cstddef>
#include <functional>
#include <map>
#include <vector>

namespace toy {

class autograd {
 public:
  using handle = std::size_t;

  explicit autograd(std::size_t params) : hooks_(params) {}

  handle add_gradient_hook(std::size_t param, std::function<void()> fn) {
    const handle h = next_++;
    hooks_.at(param).emplace(h, std::move(fn));
    return h;
  }
  void remove_gradient_hook(handle h) noexcept {
    for (auto& per_param : hooks_) per_param.erase(h);
  }

  /// The backward pass computed parameter `param`'s gradient: run its hooks.
  void gradient_ready(std::size_t param) {
    for (auto& [h, fn] : hooks_.at(param)) fn();
  }

  [[nodiscard]] std::size_t live_hooks() const {
    std::size_t n = 0;
    for (const auto& per_param : hooks_) n += per_param.size();
    return n;
  }
  [[nodiscard]] std::size_t hooks_on(std::size_t param) const { return hooks_.at(param).size(); }

 private:
  std::vector<std::map<handle, std::function<void()>>> hooks_;
  handle next_ = 0;
};

}  // namespace toy
