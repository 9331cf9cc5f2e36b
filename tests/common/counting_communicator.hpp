#pragma once
// Test decorator: forwards to another communicator and counts calls per operation and dtype.

#include <map>
#include <string>
#include <utility>

#include <ddp/communicator.hpp>

namespace testing_support {

class counting_communicator {
 public:
  explicit counting_communicator(ddp::communicator_ref inner) : inner_(inner) {}
  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  ddp::work allreduce(std::span<const ddp::tensor_view> ts, ddp::reduce_op op) {
    note("allreduce", ts);
    return inner_.allreduce(ts, op);
  }
  ddp::work broadcast(std::span<const ddp::tensor_view> ts, int root) {
    note("broadcast", ts);
    return inner_.broadcast(ts, root);
  }
  ddp::work allgather(ddp::tensor_view in, ddp::tensor_view out) {
    note("allgather", std::span<const ddp::tensor_view>(&in, 1));
    return inner_.allgather(in, out);
  }
  ddp::work reduce_scatter(ddp::tensor_view in, ddp::tensor_view out, ddp::reduce_op op) {
    note("reduce_scatter", std::span<const ddp::tensor_view>(&in, 1));
    return inner_.reduce_scatter(in, out, op);
  }
  ddp::work barrier() {
    note("barrier", {});
    return inner_.barrier();
  }
  void abort() noexcept { inner_.abort(); }

  /// Calls of `op` whose first tensor has dtype `t` ("barrier" ignores t).
  std::size_t count(const std::string& op, ddp::dtype t = ddp::dtype::f32) const {
    auto it = counts_.find(op == "barrier" ? op : op + "/" + std::string(ddp::name_of(t)));
    return it == counts_.end() ? 0 : it->second;
  }
  std::size_t total() const {
    std::size_t n = 0;
    for (const auto& [k, v] : counts_) n += v;
    return n;
  }
  void reset() { counts_.clear(); }

 private:
  void note(const std::string& op, std::span<const ddp::tensor_view> ts) {
    ++counts_[ts.empty() ? op : op + "/" + std::string(ddp::name_of(ts.front().type))];
  }
  ddp::communicator_ref inner_;
  std::map<std::string, std::size_t> counts_;
};

}  // namespace testing_support
