#pragma once
/// @file join.hpp
/// @brief `JoinContext<Joinables...>`: training with uneven inputs across ranks.
///
/// A rank that runs out of data calls `finish()` and keeps shadowing the collectives of the
/// ranks still training until all have run out; then every joinable's post hook runs (the
/// Bucketer broadcasts the final parameters from the last rank to join). Training ranks call
/// `notify()` once per iteration, before any joinable's collectives.
///
/// Cost: `notify()` is exactly one int64 sum allreduce of `2 + K + ceil(size / 63)` elements for
/// all K joinables together. It carries how many ranks still train, which of them (the
/// authoritative rank is the highest), and for each joinable how many training ranks run its
/// collectives this iteration (a Bucketer in `no_sync` does not). PyTorch spends up to three
/// float32/int64 allreduces per iteration for the same information. With `enable = false`
/// nothing is communicated.
///
/// Safety: the bookkeeping uses one dtype and a fixed length, so a rank that issues another
/// collective in its place (a `barrier()` inside the loop, seed 004) is caught by the checked
/// communicator (`ddp::checked_communicator`) or the local backend as a mismatch on every rank,
/// or, on an unchecked backend, by the timeout; it never yields a garbage rank. Training ranks
/// that disagree about whether a joinable communicates this iteration get a `mismatch_error`.
/// No collective and nothing that throws runs in the destructor: forgetting `finish()` after
/// `notify()` is reported and terminates the process (like a joinable `std::thread`), because
/// the other ranks would otherwise wait for collectives that never come.

#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ddp/communicator.hpp>
#include <ddp/error.hpp>
#include <ddp/joinable.hpp>

namespace ddp {

/// Settings of a `JoinContext`.
struct join_options {
  /// Off: notify() and finish() do nothing and communicate nothing.
  bool enable = true;
  /// On: as soon as any rank runs out of data, every rank throws `early_termination` in the same
  /// iteration instead of shadowing.
  bool throw_on_early_termination = false;
  /// Forwarded to every joinable's hooks.
  join_hook_options hooks{};

  /// Memberwise.
  friend bool operator==(const join_options&, const join_options&) = default;
};

/// Thrown on every rank, in the same iteration, when `throw_on_early_termination` is set and a
/// rank ran out of data.
class early_termination : public error {
 public:
  /// @param rank       rank that throws
  /// @param iteration  join round in which some rank had run out of data
  /// @param message    which ranks ran out
  early_termination(int rank, std::uint64_t iteration, const std::string& message)
      : error(rank, "JoinContext iteration " + std::to_string(iteration), message), iteration_(iteration) {}
  /// Join round (`join_round::iteration`) in which every rank stopped.
  [[nodiscard]] std::uint64_t iteration() const noexcept { return iteration_; }

 private:
  std::uint64_t iteration_;
};

/// Runs the join protocol over one or more joinables (a Bucketer, a BufferReducer, ...) that
/// share a communicator. One per training loop: training ranks call `notify()` each iteration,
/// every rank calls `finish()` once when it runs out of data. Holds references to the
/// joinables, which must outlive it.
template <joinable... Joinables>
class JoinContext {
  static_assert(sizeof...(Joinables) > 0, "JoinContext needs at least one joinable");

 public:
  /// All joinables must use the same communicator (the bookkeeping runs on it).
  explicit JoinContext(join_options options, Joinables&... joinables)
      : opts_(options),
        joinables_(joinables...),
        comm_(std::get<0>(joinables_).join_communicator()),
        uncaught_at_start_(std::uncaught_exceptions()) {
    bool same = true;
    std::apply([&](auto&... j) { ((same = same && communicator_ref(j.join_communicator()) == comm_), ...); },
               joinables_);
    if (!same) {
      throw usage_error(comm_.rank(), "JoinContext",
                        "all joinables must use the same communicator: the join bookkeeping runs on one");
    }
    words_ = 1 + sizeof...(Joinables) + 1 + bitmap_words();
  }

  JoinContext(const JoinContext&) = delete;
  JoinContext& operator=(const JoinContext&) = delete;

  ~JoinContext() {
    if (!notified_ || finished_ || failed_ || std::uncaught_exceptions() > uncaught_at_start_) return;
    std::fprintf(stderr,
                 "ddp: rank %d: JoinContext destroyed after notify() without finish(): the other ranks would wait "
                 "forever for this rank's collectives. Call finish() when this rank runs out of data (or "
                 "abandon() after a failure). Terminating.\n",
                 comm_.rank());
    std::terminate();
  }

  /// Training rank, once per iteration, before any joinable's collectives: one int64 allreduce.
  /// Returns what it learned (ranks still training, authoritative rank, ...).
  /// @throws early_termination if `throw_on_early_termination` and some rank has run out
  /// @throws mismatch_error if training ranks disagree whether a joinable communicates
  const join_round& notify() {
    if (finished_) throw usage_error(comm_.rank(), "JoinContext::notify", "called after finish()");
    notified_ = true;
    if (!opts_.enable) return disabled_round();
    std::vector<std::int64_t> words(words_, 0);
    words[0] = 1;
    std::size_t k = 1;
    std::apply([&](auto&... j) { ((words[k++] = detail::join_will_communicate(j) ? 1 : 0), ...); }, joinables_);
    const auto r = static_cast<std::size_t>(comm_.rank());
    words[bitmap_offset() + r / 63] = std::int64_t{1} << (r % 63);
    exchange(words);
    if (round_.training < round_.world_size && opts_.throw_on_early_termination) throw_early_termination();
    std::size_t j = 0;
    std::apply([&](auto&... js) { (notify_one(js, j++), ...); }, joinables_);
    return round_;
  }

  /// This rank ran out of data: shadow the others' collectives until every rank has joined, then
  /// run every joinable's post hook. Collective: every rank calls it exactly once.
  join_summary finish() {
    if (finished_) throw usage_error(comm_.rank(), "JoinContext::finish", "called twice");
    finished_ = true;
    join_summary summary;
    summary.world_size = comm_.size();
    summary.authoritative_rank = comm_.size() - 1;
    summary.options = opts_.hooks;
    if (!opts_.enable) return summary;
    try {
      auto hooks = std::apply([&](auto&... j) { return std::make_tuple(j.join_hook(opts_.hooks)...); }, joinables_);
      for (;;) {
        std::vector<std::int64_t> words(words_, 0);
        exchange(words);
        if (round_.training == 0) break;
        if (opts_.throw_on_early_termination) throw_early_termination();
        std::apply([&](auto&... h) {
          std::size_t j = 0;
          (shadow_one(h, j++), ...);
        }, hooks);
      }
      if (!last_training_.empty()) {
        summary.is_last_joiner = last_training_[static_cast<std::size_t>(comm_.rank())];
        for (int q = comm_.size() - 1; q >= 0; --q) {
          if (last_training_[static_cast<std::size_t>(q)]) {
            summary.authoritative_rank = q;
            break;
          }
        }
      }
      summary.rounds = rounds_ - 1;  // the last exchange found nobody training
      std::apply([&](auto&... h) { (h.post_hook(summary), ...); }, hooks);
    } catch (...) {
      failed_ = true;
      throw;
    }
    return summary;
  }

  /// Gives up on the join protocol after a failure (e.g. a communication error): the destructor
  /// will not complain. Communicates nothing.
  void abandon() noexcept { failed_ = true; }

  /// Bookkeeping rounds so far (training iterations plus shadowed ones).
  [[nodiscard]] std::uint64_t rounds() const noexcept { return rounds_; }
  /// The options the context was built with.
  [[nodiscard]] const join_options& options() const noexcept { return opts_; }

 private:
  [[nodiscard]] std::size_t bitmap_words() const { return (static_cast<std::size_t>(comm_.size()) + 62) / 63; }
  [[nodiscard]] std::size_t bitmap_offset() const { return 1 + sizeof...(Joinables) + 1; }

  // The one bookkeeping collective. Word layout:
  //   [0] ranks training, [1..K] per joinable: training ranks that communicate,
  //   [K+1] length check (every rank adds its word count), [K+2..] bitmap of training ranks.
  void exchange(std::vector<std::int64_t>& words) {
    words[1 + sizeof...(Joinables)] = static_cast<std::int64_t>(words_);
    try {
      comm_.allreduce(words, reduce_op::sum).wait();
    } catch (...) {
      failed_ = true;
      throw;
    }
    const int size = comm_.size();
    if (words[1 + sizeof...(Joinables)] != static_cast<std::int64_t>(words_) * size) {
      failed_ = true;
      throw mismatch_error(comm_.rank(), "JoinContext bookkeeping",
                           "ranks disagree on the bookkeeping layout (different joinables or a misaligned "
                           "collective); received length check " +
                               std::to_string(words[1 + sizeof...(Joinables)]) + ", expected " +
                               std::to_string(words_ * static_cast<std::size_t>(size)));
    }
    round_.iteration = rounds_++;
    round_.world_size = size;
    round_.training = static_cast<int>(words[0]);
    round_.options = opts_.hooks;
    round_.is_training.assign(static_cast<std::size_t>(size), false);
    round_.authoritative_rank = -1;
    int counted = 0;
    for (int q = 0; q < size; ++q) {
      const auto uq = static_cast<std::size_t>(q);
      if ((static_cast<std::uint64_t>(words[bitmap_offset() + uq / 63]) >> (uq % 63)) & 1u) {
        round_.is_training[uq] = true;
        round_.authoritative_rank = q;
        ++counted;
      }
    }
    if (counted != round_.training || round_.training < 0 || round_.training > size) {
      failed_ = true;
      throw mismatch_error(comm_.rank(), "JoinContext bookkeeping",
                           "inconsistent bookkeeping: " + std::to_string(round_.training) +
                               " ranks report training but the rank map holds " + std::to_string(counted) +
                               " (a collective was issued out of step)");
    }
    communicating_.assign(words.begin() + 1, words.begin() + 1 + static_cast<std::ptrdiff_t>(sizeof...(Joinables)));
    for (std::size_t j = 0; j < communicating_.size(); ++j) {
      const auto c = communicating_[j];
      if (c != 0 && c != round_.training) {
        failed_ = true;
        throw mismatch_error(comm_.rank(), "JoinContext iteration " + std::to_string(round_.iteration),
                             "training ranks disagree whether joinable " + std::to_string(j) +
                                 " communicates in this iteration (" + std::to_string(c) + " of " +
                                 std::to_string(round_.training) +
                                 " will); e.g. a Bucketer is in no_sync on some ranks only");
      }
    }
    if (round_.training > 0) last_training_ = round_.is_training;
  }

  template <class J>
  void notify_one(J& j, std::size_t index) {
    round_.communicating = static_cast<int>(communicating_[index]);
    detail::join_notified(j, round_);
  }

  template <class H>
  void shadow_one(H& hook, std::size_t index) {
    if (communicating_[index] == 0) return;
    round_.communicating = static_cast<int>(communicating_[index]);
    hook.main_hook(round_);
  }

  [[noreturn]] void throw_early_termination() {
    failed_ = true;
    std::string gone;
    for (int q = 0; q < round_.world_size; ++q) {
      if (!round_.is_training[static_cast<std::size_t>(q)]) gone += (gone.empty() ? "" : ", ") + std::to_string(q);
    }
    throw early_termination(comm_.rank(), round_.iteration,
                            "rank(s) " + gone + " ran out of data and throw_on_early_termination is set: every rank "
                                                "stops in this iteration");
  }

  const join_round& disabled_round() {
    round_.iteration = rounds_++;
    round_.world_size = comm_.size();
    round_.training = comm_.size();
    round_.is_training.assign(static_cast<std::size_t>(comm_.size()), true);
    round_.authoritative_rank = comm_.size() - 1;
    round_.communicating = comm_.size();
    round_.options = opts_.hooks;
    return round_;
  }

  join_options opts_;
  std::tuple<Joinables&...> joinables_;
  communicator_ref comm_;
  int uncaught_at_start_;
  std::size_t words_ = 0;
  join_round round_;
  std::vector<std::int64_t> communicating_;
  std::vector<bool> last_training_;
  std::uint64_t rounds_ = 0;
  bool notified_ = false;
  bool finished_ = false;
  bool failed_ = false;
};

/// Deduces the joinable types: `ddp::JoinContext join(opts, grads, buffers);`.
template <class... J>
JoinContext(join_options, J&...) -> JoinContext<J...>;

}  // namespace ddp
