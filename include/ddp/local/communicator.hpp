#pragma once
/// @file local/communicator.hpp
/// @brief The `local` backend: N ranks as threads of one process, over shared memory.
///
/// For unit tests and for running examples without mpirun. Every rank's call of a collective is
/// seen by the rank that arrives last, which checks that all ranks issued the same collective
/// (operation, dtypes, counts, root) and throws `mismatch_error` on every rank when they did not:
/// the local backend is always in checked mode. Reductions run in rank order, so every rank gets
/// the same bits. Fault injection (`options::faults`) makes a rank fail, stall or leave at a given
/// operation, deterministically.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <ddp/backend_contract.hpp>
#include <ddp/communicator.hpp>
#include <ddp/detail/host_reduce.hpp>
#include <ddp/error.hpp>
#include <ddp/tensor.hpp>
#include <ddp/work.hpp>

namespace ddp::local {

/// A fault injected into one rank at its `at_op`-th collective (counting from 0 on that
/// communicator).
struct fault {
  /// What happens to the rank.
  enum class kind : unsigned char {
    fail,   ///< the rank's call throws; peers' pending and later calls fail with communication_error
    delay,  ///< the rank sleeps `delay` before issuing the call
    leave,  ///< the rank's call throws `rank_left`; peers are not told (they time out)
  };
  kind what = kind::fail;              ///< what happens
  int rank = 0;                        ///< the rank it happens to
  std::uint64_t at_op = 0;             ///< index of the collective it happens at
  std::chrono::milliseconds delay{0};  ///< sleep of a `kind::delay` fault

  /// Rank `rank` fails at its collective number `op`.
  [[nodiscard]] static fault fail_at(int rank, std::uint64_t op) { return {kind::fail, rank, op, {}}; }
  /// Rank `rank` sleeps `d` before issuing its collective number `op`.
  [[nodiscard]] static fault delay_at(int rank, std::uint64_t op, std::chrono::milliseconds d) {
    return {kind::delay, rank, op, d};
  }
  /// Rank `rank` leaves (throws `rank_left`) at its collective number `op`.
  [[nodiscard]] static fault leave_at(int rank, std::uint64_t op) { return {kind::leave, rank, op, {}}; }
};

/// Settings of a local communicator group.
struct options {
  std::chrono::milliseconds timeout = default_timeout;  ///< deadline of every blocking wait
  std::vector<fault> faults;                            ///< faults to inject (none by default)
};

/// Thrown on a rank that leaves by fault injection; `local::run` treats it as a normal exit.
class rank_left : public communication_error {
 public:
  using communication_error::communication_error;
};

namespace detail {

enum class op_kind : unsigned char { allreduce, broadcast, allgather, reduce_scatter, barrier };

/// One rank's side of a collective.
struct call {
  bool present = false;
  op_kind kind = op_kind::barrier;
  op_info info;
  std::vector<tensor_view> views;  // allreduce/broadcast: the tensors; allgather/reduce_scatter: {in, out}
};

enum class failure : unsigned char { none, communication, mismatch };

struct slot {
  std::vector<call> calls;
  int arrived = 0;
  int observed = 0;
  bool done = false;
  failure failed = failure::none;
  std::string why;
};

/// State shared by the ranks of one local communicator.
struct group {
  group(int n, options o) : size(n), opts(std::move(o)), dead(static_cast<std::size_t>(n)) {}
  const int size;
  const options opts;
  std::mutex m;
  std::condition_variable cv;
  std::map<std::uint64_t, slot> slots;
  std::vector<std::string> dead;  ///< non-empty: why that rank is gone

  std::string dead_peers() const {
    std::string s;
    for (std::size_t r = 0; r < dead.size(); ++r) {
      if (!dead[r].empty()) s += (s.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " " + dead[r];
    }
    return s;
  }

  // Fails every pending slot (caller holds m).
  void fail_pending(const std::string& why) {
    for (auto& [seq, s] : slots) {
      if (!s.done && s.failed == failure::none) {
        s.failed = failure::communication;
        s.why = why;
      }
    }
    cv.notify_all();
  }
};

inline std::string describe_call(int r, const call& c) {
  std::string s = "rank " + std::to_string(r) + " called " + c.info.describe();
  if (c.kind == op_kind::allreduce || c.kind == op_kind::broadcast) {
    if (c.views.size() > 1) {
      s += " [";
      for (std::size_t i = 0; i < c.views.size(); ++i) {
        s += (i ? ", " : "") + std::string(name_of(c.views[i].type)) + " x " + std::to_string(c.views[i].count);
      }
      s += "]";
    }
  }
  return s;
}

inline bool same_call(const call& a, const call& b) {
  if (a.kind != b.kind || a.info.op != b.info.op || a.info.root != b.info.root) return false;
  if (a.views.size() != b.views.size()) return false;
  for (std::size_t i = 0; i < a.views.size(); ++i) {
    if (a.views[i].type != b.views[i].type || a.views[i].count != b.views[i].count) return false;
  }
  return true;
}

// Runs the collective over every rank's buffers (caller holds the group mutex; all calls present).
inline void execute(group& g, slot& s) {
  const auto n = static_cast<std::size_t>(g.size);
  for (std::size_t r = 1; r < n; ++r) {
    if (!same_call(s.calls[0], s.calls[r])) {
      std::string why = "ranks issued different collectives at the same position: ";
      for (std::size_t q = 0; q < n; ++q) why += (q ? "; " : "") + describe_call(static_cast<int>(q), s.calls[q]);
      s.failed = failure::mismatch;
      s.why = std::move(why);
      return;
    }
  }
  const call& c0 = s.calls[0];
  std::vector<std::byte> tmp;
  // Reduces tensor `t` of every rank (views index v, sub-range [off, off + cnt)) into tmp, in rank order.
  auto reduce = [&](std::size_t v, std::size_t off, std::size_t cnt) {
    const tensor_view& first = c0.views[v];
    const dtype t = first.type;
    const bool widen = t == dtype::f16 || t == dtype::bf16;  // accumulate 2-byte floats in f32
    const dtype acc_t = widen ? dtype::f32 : t;
    tmp.assign(cnt * size_of(acc_t), std::byte{0});
    std::vector<std::byte> in(widen ? cnt * 4 : 0);
    for (std::size_t r = 0; r < n; ++r) {
      const std::byte* src = s.calls[r].views[v].byte_data() + off * size_of(t);
      const void* p = src;
      if (widen) {
        ddp::detail::convert(t, src, dtype::f32, in.data(), cnt);
        p = in.data();
      }
      if (r == 0) {
        std::memcpy(tmp.data(), p, cnt * size_of(acc_t));
      } else {
        ddp::detail::reduce_into(acc_t, c0.info.op, tmp.data(), p, cnt);
      }
    }
    if (c0.info.op == reduce_op::avg) ddp::detail::divide_in_place(acc_t, tmp.data(), cnt, g.size);
    if (widen) {
      std::vector<std::byte> narrow(cnt * 2);
      ddp::detail::convert(dtype::f32, tmp.data(), t, narrow.data(), cnt);
      tmp = std::move(narrow);
    }
  };
  switch (c0.kind) {
    case op_kind::barrier: break;
    case op_kind::allreduce:
      for (std::size_t v = 0; v < c0.views.size(); ++v) {
        if (c0.views[v].count == 0) continue;
        reduce(v, 0, c0.views[v].count);
        for (std::size_t r = 0; r < n; ++r) std::memcpy(s.calls[r].views[v].data, tmp.data(), tmp.size());
      }
      break;
    case op_kind::broadcast: {
      const auto root = static_cast<std::size_t>(c0.info.root);
      for (std::size_t v = 0; v < c0.views.size(); ++v) {
        for (std::size_t r = 0; r < n; ++r) {
          if (r != root && c0.views[v].count > 0) {
            std::memmove(s.calls[r].views[v].data, s.calls[root].views[v].data, c0.views[v].bytes());
          }
        }
      }
      break;
    }
    case op_kind::allgather: {
      const std::size_t block = c0.views[0].bytes();
      tmp.resize(block * n);
      for (std::size_t r = 0; r < n; ++r) {
        if (block) std::memcpy(tmp.data() + r * block, s.calls[r].views[0].data, block);
      }
      for (std::size_t r = 0; r < n; ++r) {
        if (!tmp.empty()) std::memcpy(s.calls[r].views[1].data, tmp.data(), tmp.size());
      }
      break;
    }
    case op_kind::reduce_scatter: {
      const std::size_t per = c0.views[1].count;
      for (std::size_t r = 0; r < n; ++r) {
        if (per == 0) break;
        reduce(0, r * per, per);
        std::memcpy(s.calls[r].views[1].data, tmp.data(), tmp.size());
      }
      break;
    }
  }
  s.done = true;
}

inline std::exception_ptr make_error(failure f, const op_info& info, const std::string& why) {
  if (f == failure::mismatch) return std::make_exception_ptr(mismatch_error(info.rank, info.describe(), why));
  return std::make_exception_ptr(communication_error(info.rank, info.describe(), why));
}

class local_work final : public work_state {
 public:
  local_work(std::shared_ptr<group> g, op_info info) : work_state(info), g_(std::move(g)) {}

  bool poll() override {
    std::lock_guard lk(g_->m);
    return check(slot_ref());
  }

  bool wait_until(clock::time_point deadline) override {
    std::unique_lock lk(g_->m);
    slot& s = slot_ref();
    g_->cv.wait_until(lk, deadline, [&] { return s.done || s.failed != failure::none; });
    return check(s);
  }

  // Withdraws this rank's call: its buffers must not be touched after this returns.
  void abandon() noexcept override {
    std::lock_guard lk(g_->m);
    auto it = g_->slots.find(info().seq);
    if (it == g_->slots.end() || finished_) return;
    slot& s = it->second;
    if (!s.done && s.failed == failure::none) {
      s.failed = failure::communication;
      s.why = "rank " + std::to_string(info().rank) + " gave up on this collective (timed out or abandoned it)";
      g_->cv.notify_all();
    }
    finish(s);
  }

 private:
  slot& slot_ref() { return g_->slots.at(info().seq); }

  bool check(slot& s) {
    if (s.failed != failure::none) {
      auto e = make_error(s.failed, info(), s.why);
      finish(s);
      std::rethrow_exception(e);
    }
    if (s.done) {
      finish(s);
      return true;
    }
    return false;
  }

  void finish(slot& s) {
    if (finished_) return;
    finished_ = true;
    if (++s.observed == g_->size) g_->slots.erase(info().seq);
  }

  std::shared_ptr<group> g_;
  bool finished_ = false;
};

}  // namespace detail

/// One rank's handle on a local communicator. Move-only; use it from one rank (thread) only,
/// though several threads of that rank may issue calls if they agree on the order.
class communicator {
 public:
  /// Rank `rank` of group `g`; made by `world::rank` and `fabric::connect`.
  communicator(std::shared_ptr<detail::group> g, int rank) : g_(std::move(g)), rank_(rank) {}
  /// Takes over the handle; the source may only be destroyed or assigned to.
  communicator(communicator&&) noexcept = default;
  /// Takes over the handle (the replaced one is dropped, not aborted).
  communicator& operator=(communicator&&) noexcept = default;

  /// This rank.
  [[nodiscard]] int rank() const { return rank_; }
  /// Ranks in the group.
  [[nodiscard]] int size() const { return g_->size; }
  /// Deadline of every blocking wait (`options::timeout`).
  [[nodiscard]] std::chrono::milliseconds timeout() const { return g_->opts.timeout; }

  /// Collective as in the `communicator` contract (communicator.hpp). Host memory only; the rank
  /// that arrives last runs it for all after checking that every rank issued the same call.
  /// @throws usage_error for device memory, a null data pointer, or use after `abort()`; errors
  ///   of the collective (mismatch, peer gone, timeout) come from the returned work
  work allreduce(std::span<const tensor_view> ts, reduce_op op) {
    return issue(detail::op_kind::allreduce, contract::check_allreduce(caller("allreduce"), ts, op),
                 {ts.begin(), ts.end()});
  }
  /// @copydoc allreduce
  /// Also throws `usage_error` if `root` is not a rank of the group.
  work broadcast(std::span<const tensor_view> ts, int root) {
    return issue(detail::op_kind::broadcast, contract::check_broadcast(caller("broadcast"), ts, root),
                 {ts.begin(), ts.end()});
  }
  /// @copydoc allreduce
  /// Also throws `usage_error` if `in` and `out` differ in dtype, `out.count != in.count * size()`,
  /// or they overlap other than in the in-place form (`in` is this rank's block of `out`).
  work allgather(tensor_view in, tensor_view out) {
    return issue(detail::op_kind::allgather, contract::check_allgather(caller("allgather"), in, out), {in, out});
  }
  /// @copydoc allreduce
  /// Also throws `usage_error` if `in` and `out` differ in dtype, `in.count != out.count * size()`,
  /// or they overlap.
  work reduce_scatter(tensor_view in, tensor_view out, reduce_op op) {
    return issue(detail::op_kind::reduce_scatter, contract::check_reduce_scatter(caller("reduce_scatter"), in, out, op),
                 {in, out});
  }
  /// @copydoc allreduce
  work barrier() { return issue(detail::op_kind::barrier, contract::check_barrier(caller("barrier")), {}); }

  /// Marks this rank gone: pending calls of every rank fail with communication_error, later calls
  /// of this rank throw usage_error.
  /// Safe from another thread than the one calling collectives (a staged communicator's owner).
  void abort() noexcept {
    if (!g_ || aborted().exchange(true)) return;
    std::lock_guard lk(g_->m);
    mark_dead("aborted its communicator");
  }

  /// Number of collectives this rank has issued.
  [[nodiscard]] std::uint64_t issued() const noexcept { return seq_; }

 private:
  // The calling rank, for the contract checks (backend_contract.hpp); refuses every call after abort().
  contract::caller caller(const char* name) const {
    if (aborted().load()) throw usage_error(rank_, name, "communicator used after abort()");
    return {rank_, size(), seq_, g_->opts.timeout, contract::memory_rule::host("the local backend")};
  }

  void mark_dead(const std::string& why) {
    g_->dead[static_cast<std::size_t>(rank_)] = why;
    g_->fail_pending("rank " + std::to_string(rank_) + " " + why);
  }

  // Issues a call that passed its contract check (`info`): the rank that arrives last runs it.
  work issue(detail::op_kind kind, const op_info& info, std::vector<tensor_view> views) {
    apply_faults(info);
    ++seq_;

    std::lock_guard lk(g_->m);
    detail::slot& s = g_->slots[info.seq];
    if (s.calls.empty()) s.calls.resize(static_cast<std::size_t>(g_->size));
    auto& c = s.calls[static_cast<std::size_t>(rank_)];
    c.present = true;
    c.kind = kind;
    c.info = info;
    c.views = std::move(views);
    ++s.arrived;
    if (s.failed == detail::failure::none) {
      if (const std::string dead = g_->dead_peers(); !dead.empty()) {
        s.failed = detail::failure::communication;
        s.why = "peer gone: " + dead;
      } else if (s.arrived == g_->size) {
        detail::execute(*g_, s);
      }
    }
    g_->cv.notify_all();
    return work(std::make_unique<detail::local_work>(g_, info));
  }

  void apply_faults(const op_info& info) {
    for (const auto& f : g_->opts.faults) {
      if (f.rank != rank_ || f.at_op != info.seq) continue;
      switch (f.what) {
        case fault::kind::delay: std::this_thread::sleep_for(f.delay); break;
        case fault::kind::fail: {
          aborted().store(true);
          std::lock_guard lk(g_->m);
          mark_dead("failed (injected fault)");
          throw communication_error(rank_, info.describe(), "injected failure");
        }
        case fault::kind::leave: throw rank_left(rank_, info.describe(), "left (injected fault)");
      }
    }
  }

  std::shared_ptr<detail::group> g_;
  int rank_ = 0;
  std::uint64_t seq_ = 0;
  // Atomic through atomic_ref (abort() may come from another thread), a plain bool so that the
  // communicator stays movable.
  alignas(std::atomic_ref<bool>::required_alignment) mutable bool aborted_ = false;
  [[nodiscard]] std::atomic_ref<bool> aborted() const noexcept { return std::atomic_ref<bool>(aborted_); }
};

static_assert(ddp::communicator<communicator>);

/// N ranks sharing one local communicator group. Call `rank(r)` once per rank.
class world {
 public:
  /// A group of `size` ranks.
  /// @throws usage_error if `size` < 1
  explicit world(int size, options opts = {}) : g_(std::make_shared<detail::group>(check(size), std::move(opts))) {}

  /// Ranks in the group.
  [[nodiscard]] int size() const noexcept { return g_->size; }
  /// The communicator of rank `r`, to be used by that rank's thread.
  /// @throws usage_error if `r` is not in [0, size())
  [[nodiscard]] communicator rank(int r) const {
    if (r < 0 || r >= g_->size) {
      throw usage_error(r, "local::world::rank", "rank out of range for a world of size " + std::to_string(g_->size));
    }
    return communicator(g_, r);
  }

 private:
  static int check(int size) {
    if (size < 1) throw usage_error(-1, "local::world", "size must be at least 1, got " + std::to_string(size));
    return size;
  }
  std::shared_ptr<detail::group> g_;
};

/// Runs `fn(communicator&)` on `size` threads, one per rank, and waits for all. Rethrows the
/// first exception (lowest rank) after every thread finished; `rank_left` counts as a normal exit.
template <class F>
void run(int size, F&& fn, options opts = {}) {
  world w(size, std::move(opts));
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(size));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        communicator c = w.rank(r);
        fn(c);
      } catch (const rank_left&) {
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace ddp::local
