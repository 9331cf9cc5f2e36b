#pragma once
// The simulation's communicator: collectives between simulated processes, matched by their
// position in each rank's sequence, computed when the last rank posts, and delivered to each
// rank after its own delay drawn by the scheduler. An abort fails every delivery not made yet,
// so a collective (the commit vote included) can complete on some ranks and fail on others, as
// over a real network. A pair of processes cut apart never completes a collective: it times out.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/communicator.hpp>
#include <ddp/detail/host_reduce.hpp>
#include <ddp/error.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

#include "scheduler.hpp"

namespace sim {

/// What the network does to collectives (shared by every endpoint).
struct comm_faults {
  std::chrono::milliseconds timeout{1000};  ///< a collective's deadline
  int max_delay_ms = 3;                     ///< deliveries are delayed 0..max_delay_ms each
  std::set<std::pair<int, int>> cut;        ///< pairs of process tags that cannot reach each other
};

class fabric {
 public:
  fabric(scheduler& s, comm_faults& faults) : s_(s), faults_(faults) {}

  class endpoint;
  /// Rank `rank` of `size` in group `group` (a new name per communicator), for process `tag`.
  endpoint connect(const std::string& group, int rank, int size, int tag);

 private:
  struct op {
    std::string kind;
    std::size_t bytes = 0;
    ddp::dtype type = ddp::dtype::u8;
    ddp::reduce_op reduce = ddp::reduce_op::sum;
    int root = -1;
    int posted = 0;
    std::vector<std::vector<std::byte>> inputs, results;
    std::vector<clock::time_point> deliver_at;
    bool complete = false;
    std::string mismatch;  // ranks posted different collectives at this position
  };
  struct group {
    int size = 0;
    std::vector<int> tags;
    std::vector<std::uint64_t> next;  // per rank: position of its next collective
    std::map<std::uint64_t, op> ops;
    bool aborted = false;
    clock::time_point aborted_at{};
    std::string abort_reason;
  };

  // Computes every rank's result once the last rank posted.
  void complete(group& g, op& o) {
    const auto n = static_cast<std::size_t>(g.size);
    o.results.assign(n, {});
    if (o.kind == "allreduce") {
      std::vector<std::byte> acc = o.inputs[0];
      const std::size_t count = acc.size() / ddp::size_of(o.type);
      for (std::size_t r = 1; r < n; ++r)
        ddp::detail::reduce_into(o.type, o.reduce, acc.data(), o.inputs[r].data(), count);
      for (auto& res : o.results) res = acc;
    } else if (o.kind == "broadcast") {
      for (auto& res : o.results) res = o.inputs[static_cast<std::size_t>(o.root)];
    } else if (o.kind == "allgather") {
      std::vector<std::byte> all;
      for (const auto& in : o.inputs) all.insert(all.end(), in.begin(), in.end());
      for (auto& res : o.results) res = all;
    }
    o.deliver_at.assign(n, s_.now());
    for (auto& t : o.deliver_at) t += std::chrono::milliseconds(s_.uniform(0, faults_.max_delay_ms));
    o.complete = true;
  }

  [[nodiscard]] bool connected(const group& g) const {
    for (int a : g.tags) {
      for (int b : g.tags) {
        if (faults_.cut.count({a, b})) return false;
      }
    }
    return true;
  }

  scheduler& s_;
  comm_faults& faults_;
  std::map<std::string, group> groups_;

  friend class endpoint;
};

/// One rank's side of a simulated group: models `ddp::communicator`.
class fabric::endpoint {
 public:
  endpoint(fabric& f, group& g, int rank, int size) : f_(&f), g_(&g), rank_(rank), size_(size) {}

  [[nodiscard]] int rank() const { return rank_; }
  [[nodiscard]] int size() const { return size_; }

  ddp::work allreduce(std::span<const ddp::tensor_view> ts, ddp::reduce_op op) {
    return post("allreduce", ts, ts, op, -1);
  }
  ddp::work broadcast(std::span<const ddp::tensor_view> ts, int root) {
    return post("broadcast", ts, ts, ddp::reduce_op::sum, root);
  }
  ddp::work allgather(ddp::tensor_view in, ddp::tensor_view out) {
    return post("allgather", std::span<const ddp::tensor_view>(&in, 1), std::span<const ddp::tensor_view>(&out, 1),
                ddp::reduce_op::sum, -1);
  }
  ddp::work reduce_scatter(ddp::tensor_view, ddp::tensor_view, ddp::reduce_op) {
    throw ddp::usage_error(rank_, "sim::fabric", "reduce_scatter is not simulated");
  }
  ddp::work barrier() { return post("barrier", {}, {}, ddp::reduce_op::sum, -1); }
  void abort() noexcept {
    group& g = *g_;
    if (g.aborted) return;
    g.aborted = true;
    g.aborted_at = f_->s_.now();
    g.abort_reason = "rank " + std::to_string(rank_) + " aborted its communicator";
  }

 private:
  class sim_work final : public ddp::work_state {
   public:
    // `g` and `o` are nodes of std::maps that never erase: they stay where they are.
    sim_work(ddp::op_info info, fabric& f, group& g, op& o, int rank, std::vector<ddp::tensor_view> outputs)
        : work_state(info),
          f_(f),
          g_(g),
          o_(o),
          rank_(rank),
          outputs_(std::move(outputs)),
          deadline_(f.s_.now() + f.faults_.timeout) {}

    bool poll() override {
      f_.s_.yield();
      if (settled()) return finish();
      // Past its deadline a collective has timed out, as a backend that enforces its timeout
      // says. (Returning "not yet" forever let work::wait_all, whose deadline is on the machine's
      // clock, spin without virtual time moving until a real second had passed: a seed's
      // schedule then depended on how fast the machine ran, and such seeds cost a second each.)
      if (f_.s_.now() >= deadline_) {
        throw ddp::timeout_error(
            rank_, info().describe(),
            "did not complete within its " + std::to_string(f_.faults_.timeout.count()) + " ms timeout (virtual time)");
      }
      f_.s_.sleep_until(f_.s_.now() + std::chrono::microseconds(200));  // polling takes time
      return settled() && finish();
    }
    bool wait_until(clock::time_point) override {  // the real deadline means nothing here: ours is virtual
      for (;;) {
        if (settled()) return finish();
        if (f_.s_.now() >= deadline_) return false;
        auto until = deadline_;  // wake at the delivery, if it is scheduled, else at the deadline
        if (the_op().complete) until = std::min(until, the_op().deliver_at[static_cast<std::size_t>(rank_)]);
        f_.s_.block_until([this] { return settled(); }, until);
      }
    }
    void abandon() noexcept override { abandoned_ = true; }

   private:
    [[nodiscard]] const op& the_op() const { return o_; }
    [[nodiscard]] bool delivered() const {
      const op& o = the_op();
      return o.complete && f_.s_.now() >= o.deliver_at[static_cast<std::size_t>(rank_)];
    }
    [[nodiscard]] bool failed() const {
      const group& g = g_;
      if (!the_op().mismatch.empty()) return true;
      if (!g.aborted) return false;
      const op& o = the_op();
      return !(o.complete && o.deliver_at[static_cast<std::size_t>(rank_)] <= g.aborted_at);
    }
    [[nodiscard]] bool settled() const { return failed() || delivered(); }
    bool finish() {
      if (failed()) {
        const group& g = g_;
        const std::string why = !the_op().mismatch.empty() ? the_op().mismatch : g.abort_reason;
        throw ddp::communication_error(rank_, info().describe(), "peer gone: " + why);
      }
      if (abandoned_) return true;
      const std::vector<std::byte>& res = the_op().results[static_cast<std::size_t>(rank_)];
      std::size_t off = 0;
      for (const ddp::tensor_view& t : outputs_) {
        if (t.bytes() > 0) std::memcpy(t.data, res.data() + off, t.bytes());
        off += t.bytes();
      }
      return true;
    }

    fabric& f_;
    const group& g_;
    const op& o_;
    int rank_;
    std::vector<ddp::tensor_view> outputs_;
    clock::time_point deadline_;
    bool abandoned_ = false;
  };

  ddp::work post(const char* kind, std::span<const ddp::tensor_view> in, std::span<const ddp::tensor_view> out,
                 ddp::reduce_op reduce, int root) {
    f_->s_.yield();  // issuing a collective is a scheduling point
    group& g = *g_;
    const std::uint64_t pos = g.next[static_cast<std::size_t>(rank_)]++;
    op& o = g.ops[pos];
    std::vector<std::byte> bytes;
    for (const ddp::tensor_view& t : in) {
      const auto* p = static_cast<const std::byte*>(t.data);
      bytes.insert(bytes.end(), p, p + t.bytes());
    }
    const ddp::dtype type = in.empty() ? ddp::dtype::u8 : in[0].type;
    if (o.posted == 0) {
      o.kind = kind;
      o.bytes = bytes.size();
      o.type = type;
      o.reduce = reduce;
      o.root = root;
      o.inputs.assign(static_cast<std::size_t>(size_), {});
    } else if (o.kind != kind || (o.kind != "allgather" && o.bytes != bytes.size()) || o.root != root ||
               o.reduce != reduce) {
      o.mismatch = "ranks issued different collectives at position " + std::to_string(pos);
    }
    o.inputs[static_cast<std::size_t>(rank_)] = std::move(bytes);
    if (++o.posted == size_ && o.mismatch.empty() && f_->connected(g)) f_->complete(g, o);
    ddp::op_info info;
    info.rank = rank_;
    info.name = kind;
    info.seq = pos;
    info.type = type;
    info.root = root;
    info.op = reduce;
    info.timeout = f_->faults_.timeout;
    return ddp::work(
        std::make_unique<sim_work>(info, *f_, g, o, rank_, std::vector<ddp::tensor_view>(out.begin(), out.end())));
  }

  fabric* f_;
  group* g_;  // a node of groups_, which never erases
  int rank_;
  int size_;
};

inline fabric::endpoint fabric::connect(const std::string& name, int rank, int size, int tag) {
  group& g = groups_[name];
  if (g.size == 0) {
    g.size = size;
    g.tags.assign(static_cast<std::size_t>(size), -1);
    g.next.assign(static_cast<std::size_t>(size), 0);
  }
  if (g.size != size) throw ddp::usage_error(rank, "sim::fabric", "group " + name + " joined with another size");
  g.tags[static_cast<std::size_t>(rank)] = tag;
  return endpoint(*this, g, rank, size);
}

static_assert(ddp::communicator<fabric::endpoint>);

}  // namespace sim
