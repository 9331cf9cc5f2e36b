#pragma once
/// @file checked.hpp
/// @brief `checked_communicator`: a decorator that makes misaligned collectives a clear error.
///
/// Before every collective, all ranks exchange a fingerprint of the call (sequence number,
/// operation, reduce op, root, dtypes and element counts) with one small allgather on the wrapped
/// communicator, then issue the real collective only if all fingerprints agree. On a mismatch,
/// every rank throws a `mismatch_error` listing what each rank was calling; a rank whose peers
/// never arrive gets a `timeout_error` naming its own pending call. Errors of the exchange itself
/// (a peer died, the wrapped communicator was aborted) name it as "ddp checked-mode fingerprint
/// exchange before <the caller's collective>", never as the internal allgather's own number,
/// which the caller did not issue. This is the "one fingerprint
/// exchange per collective" debug mode (PyTorch's DETAIL mode spends a barrier plus an allgather
/// on a second process group). It blocks per collective, so leave it off for speed.
///
/// Wrap the communicator every component uses: `ddp::checked_communicator checked(comm);
/// ddp::Bucketer grads(checked);`.

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <ddp/communicator.hpp>
#include <ddp/detail/fnv1a.hpp>
#include <ddp/detail/host_reduce.hpp>
#include <ddp/error.hpp>
#include <ddp/work.hpp>

namespace ddp {

/// Settings of a `checked_communicator`.
struct checked_options {
  /// Deadline of each fingerprint exchange: how long a rank waits for its peers to reach the
  /// same collective before reporting them as missing.
  std::chrono::milliseconds timeout = default_timeout;
};

/// Decorator over any communicator that verifies, before each collective, that every rank is
/// issuing the same one (see the file description). Models `communicator`.
class checked_communicator {
 public:
  /// Wraps `inner`, which must outlive this object and carries both the fingerprint exchanges
  /// and the real collectives.
  explicit checked_communicator(communicator_ref inner, checked_options options = {}) : inner_(inner), opts_(options) {}

  /// Rank in the wrapped communicator.
  [[nodiscard]] int rank() const { return inner_.rank(); }
  /// Size of the wrapped communicator.
  [[nodiscard]] int size() const { return inner_.size(); }
  /// The wrapped communicator.
  [[nodiscard]] communicator_ref inner() const noexcept { return inner_; }
  /// Collectives checked so far.
  [[nodiscard]] std::uint64_t checked_calls() const noexcept { return seq_; }

  /// Exchanges this call's fingerprint with every rank (blocking), then forwards the collective
  /// to the wrapped communicator.
  /// @throws mismatch_error if ranks issued different collectives (all ranks throw, listing each
  ///   rank's call); timeout_error if peers did not reach a collective within the timeout;
  ///   communication_error if the exchange itself failed
  work allreduce(std::span<const tensor_view> ts, reduce_op op) {
    verify(kind::allreduce, ts, op, -1);
    return inner_.allreduce(ts, op);
  }
  /// @copydoc allreduce
  work broadcast(std::span<const tensor_view> ts, int root) {
    verify(kind::broadcast, ts, reduce_op::sum, root);
    return inner_.broadcast(ts, root);
  }
  /// @copydoc allreduce
  /// The fingerprint covers `in` only.
  work allgather(tensor_view in, tensor_view out) {
    verify(kind::allgather, std::span<const tensor_view>(&in, 1), reduce_op::sum, -1);
    return inner_.allgather(in, out);
  }
  /// @copydoc allreduce
  /// The fingerprint covers `in` only.
  work reduce_scatter(tensor_view in, tensor_view out, reduce_op op) {
    verify(kind::reduce_scatter, std::span<const tensor_view>(&in, 1), op, -1);
    return inner_.reduce_scatter(in, out, op);
  }
  /// @copydoc allreduce
  work barrier() {
    verify(kind::barrier, {}, reduce_op::sum, -1);
    return inner_.barrier();
  }
  /// Aborts the wrapped communicator (no fingerprint exchange).
  void abort() noexcept { inner_.abort(); }

 private:
  enum class kind : std::int64_t { allreduce = 1, broadcast, allgather, reduce_scatter, barrier };
  static constexpr std::size_t fields = 7;          // seq, kind, op, root, tensors, first dtype, total count
  static constexpr std::size_t words = fields + 1;  // + hash of every (dtype, count)

  static const char* name_of_kind(std::int64_t k) {
    switch (static_cast<kind>(k)) {
      case kind::allreduce: return "allreduce";
      case kind::broadcast: return "broadcast";
      case kind::allgather: return "allgather";
      case kind::reduce_scatter: return "reduce_scatter";
      case kind::barrier: return "barrier";
    }
    return "?";
  }

  static std::string describe(const std::int64_t* f) {
    op_info info;
    info.name = name_of_kind(f[1]);
    info.seq = static_cast<std::uint64_t>(f[0]);
    info.op = static_cast<reduce_op>(f[2]);
    info.root = static_cast<int>(f[3]);
    info.type = static_cast<dtype>(f[5]);
    info.count = static_cast<std::size_t>(f[6]);
    std::string s = info.describe();
    if (f[4] > 1) s += " over " + std::to_string(f[4]) + " tensors";
    return s;
  }

  /// "ddp checked-mode fingerprint exchange before allreduce #20 (sum, f32 x 1024)": the
  /// operation of an error in the exchange itself (`f`: this rank's fingerprint).
  static std::string exchange_name(const std::int64_t* f) {
    return "ddp checked-mode fingerprint exchange before " + describe(f);
  }

  /// The message of a wrapped communicator's error without its "ddp: rank R, allgather #N: "
  /// prefix, which names an operation the caller never issued.
  static std::string reason(const error& e) {
    const std::string what = e.what();
    if (!e.operation().empty()) {
      const std::string marker = e.operation() + ": ";
      const auto at = what.find(marker);
      if (at != std::string::npos) return what.substr(at + marker.size());
    }
    return what;
  }

  void verify(kind k, std::span<const tensor_view> ts, reduce_op op, int root) {
    std::vector<std::int64_t> mine(words, 0);
    mine[0] = static_cast<std::int64_t>(seq_++);
    mine[1] = static_cast<std::int64_t>(k);
    mine[2] = static_cast<std::int64_t>(k == kind::allreduce || k == kind::reduce_scatter ? op : reduce_op::sum);
    mine[3] = root;
    mine[4] = static_cast<std::int64_t>(ts.size());
    mine[5] = ts.empty() ? 0 : static_cast<std::int64_t>(ts.front().type);
    // FNV-1a's step over whole words (count and dtype of each tensor), not bytes: ranks of one
    // job compare it, nothing stores it.
    std::uint64_t hash = detail::fnv1a_offset_basis;
    for (const auto& t : ts) {
      mine[6] += static_cast<std::int64_t>(t.count);
      hash = (hash ^ (t.count * 16 + static_cast<std::uint64_t>(t.type))) * detail::fnv1a_prime;
    }
    mine[7] = static_cast<std::int64_t>(hash);

    const auto n = static_cast<std::size_t>(size());
    std::vector<std::int64_t> all(words * n);
    // The exchange is an allgather on the wrapped communicator that the caller never issued: its
    // failures name it as ddp's own check of the caller's collective, not as "allgather #N".
    try {
      work w = inner_.allgather(view(mine), view(all));
      w.wait_for(opts_.timeout);
    } catch (const timeout_error&) {
      throw timeout_error(rank(), exchange_name(mine.data()),
                          "peers did not reach a collective within " + std::to_string(opts_.timeout.count()) +
                              " ms: a rank stopped early (uneven inputs without join?), is slow, or is dead");
    } catch (const mismatch_error& e) {  // the wrapped backend compares calls itself (local)
      throw mismatch_error(rank(), exchange_name(mine.data()), reason(e));
    } catch (const communication_error& e) {  // e.g. a peer that timed out first withdrew, or died
      throw communication_error(rank(), exchange_name(mine.data()),
                                "peers did not reach this collective: " + reason(e));
    } catch (const usage_error& e) {  // e.g. the wrapped communicator was aborted
      throw usage_error(rank(), exchange_name(mine.data()), reason(e));
    }
    bool same = true;
    for (std::size_t r = 0; r < n && same; ++r) {
      for (std::size_t f = 0; f < words; ++f) same = same && all[r * words + f] == mine[f];
    }
    if (same) return;
    std::string calls;
    for (std::size_t r = 0; r < n; ++r) {
      calls += (r ? "; " : "") + std::string("rank ") + std::to_string(r) + " called " + describe(&all[r * words]);
    }
    throw mismatch_error(rank(), "checked " + describe(mine.data()),
                         "ranks issued different collectives at the same position: " + calls);
  }

  communicator_ref inner_;
  checked_options opts_;
  std::uint64_t seq_ = 0;
};

static_assert(communicator<checked_communicator>);

}  // namespace ddp
