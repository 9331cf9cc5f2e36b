#pragma once
/// @file join.hpp
/// @brief `JoinContext<Joinables...>`: training with uneven inputs across ranks.
///
/// A rank that runs out of data calls `finish()` and shadows the collectives of the ranks still
/// training until all have run out; training ranks call `notify()` once per iteration (one
/// int64 allreduce for all joinables), before any joinable's collectives. Without it, ranks
/// with more data wait forever for the collectives of a rank that stopped.
/// Cost, rules, the issue order, safety and the destructor: docs/join.md.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ddp/communicator.hpp>
#include <ddp/error.hpp>
#include <ddp/joinable.hpp>
#include <ddp/timeline.hpp>

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
  static constexpr std::size_t K = sizeof...(Joinables);  // joinables

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
    words_ = bitmap_offset() + bitmap_words();
    log_ = std::make_shared<detail::join_order_log>(K);
    initial_order();
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
  /// @throws mismatch_error if training ranks disagree whether a joinable communicates, or on the
  ///   order in which they issue the joinables' collectives
  const join_round& notify() {
    if (finished_) throw usage_error(comm_.rank(), "JoinContext::notify", "called after finish()");
    notified_ = true;
    if (!opts_.enable) return disabled_round();
    merge(learned_, log_->sequence());  // the order the joinables issued in during the previous iteration
    timeline::scoped_span span(rec_, "join", "notify");
    std::vector<std::int64_t> words(words_, 0);
    words[0] = 1;
    std::size_t k = 1;
    std::apply([&](auto&... j) { ((words[k++] = detail::join_will_communicate(j) ? 1 : 0), ...); }, joinables_);
    for (std::size_t p = 0; p < K; ++p) words[order_offset() + learned_[p]] = static_cast<std::int64_t>(p + 1);
    const auto r = static_cast<std::size_t>(comm_.rank());
    words[bitmap_offset() + r / 63] = std::int64_t{1} << (r % 63);
    exchange(words);
    span.set("training", round_.training);
    if (round_.training < round_.world_size && opts_.throw_on_early_termination) throw_early_termination();
    const std::uint64_t epoch = log_->begin();
    std::size_t j = 0;
    std::apply([&](auto&... js) { (notify_one(js, j++, epoch), ...); }, joinables_);
    round_.order_token = {};
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
    log_->close();  // tokens the joinables still hold record nothing from now on
    try {
      auto hooks = std::apply([&](auto&... j) { return std::make_tuple(j.join_hook(opts_.hooks)...); }, joinables_);
      for (;;) {
        timeline::scoped_span span(rec_, "join", "shadow round");
        std::vector<std::int64_t> words(words_, 0);
        exchange(words);
        span.set("training", round_.training);
        if (round_.training == 0) break;
        if (opts_.throw_on_early_termination) throw_early_termination();
        shadow_in_order(hooks, std::make_index_sequence<K>{});
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
      const timeline::scoped_span post(rec_, "join", "post hooks");
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
  /// The order in which a rank that ran out of data shadows the joinables (indices in the order
  /// they were given to the constructor). Between iterations on a training rank: the order
  /// learned so far, this iteration included (what the next `notify()` will carry); after
  /// `finish()`: the order of the last round anyone trained in.
  [[nodiscard]] std::array<std::size_t, sizeof...(Joinables)> shadow_order() const {
    if (finished_) return carried_;
    std::array<std::size_t, K> order = learned_;
    merge(order, log_->sequence());
    return order;
  }
  /// Records the bookkeeping rounds in `rec` (track `join`; null: stop). `rec` must outlive
  /// the context or be unset first.
  void set_recorder(timeline::recorder* rec) noexcept { rec_ = rec; }

 private:
  [[nodiscard]] std::size_t bitmap_words() const { return (static_cast<std::size_t>(comm_.size()) + 62) / 63; }
  [[nodiscard]] static constexpr std::size_t order_offset() { return 1 + K; }
  [[nodiscard]] static constexpr std::size_t length_index() { return 1 + 2 * K; }
  [[nodiscard]] static constexpr std::size_t bitmap_offset() { return 2 + 2 * K; }

  // Registration order, with the joinables that give a phase hint arranged by phase (stable) in
  // the places they occupy.
  void initial_order() {
    for (std::size_t p = 0; p < K; ++p) learned_[p] = p;
    std::vector<std::pair<join_phase, std::size_t>> hinted;
    std::size_t j = 0;
    std::apply(
        [&](auto&... js) {
          (
              (void)[&](auto& one) {
                if (const auto phase = detail::join_issue_phase(one)) hinted.emplace_back(*phase, j);
                ++j;
              }(js),
              ...);
        },
        joinables_);
    std::stable_sort(hinted.begin(), hinted.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<std::size_t> sequence;
    for (const auto& h : hinted) sequence.push_back(h.second);
    merge(learned_, sequence);
    carried_ = learned_;
  }

  // Merges an observed issue order (the joinables that reported, first issue first) into the
  // learned order: the places those joinables occupy receive them in the observed order; the
  // others stay where they are. So an iteration in which only some joinables communicate does
  // not forget where the others go.
  static void merge(std::array<std::size_t, K>& order, const std::vector<std::size_t>& sequence) {
    if (sequence.size() < 2) return;
    std::array<std::size_t, K> place{};
    for (std::size_t p = 0; p < K; ++p) place[order[p]] = p;
    std::vector<std::size_t> places;
    places.reserve(sequence.size());
    for (std::size_t j : sequence) places.push_back(place[j]);
    std::sort(places.begin(), places.end());
    for (std::size_t i = 0; i < sequence.size(); ++i) order[places[i]] = sequence[i];
  }

  static std::string order_text(const std::array<std::size_t, K>& order) {
    std::string text;
    for (std::size_t j : order) text += (text.empty() ? "" : ", ") + std::to_string(j);
    return text;
  }

  // The one bookkeeping collective. Word layout (K joinables):
  //   [0] ranks training, [1..K] per joinable: training ranks that communicate,
  //   [K+1..2K] per joinable: sum over training ranks of its 1-based place in their learned
  //   issue order (joined ranks add 0), [2K+1] length check (every rank adds its word count),
  //   [2K+2..] bitmap of training ranks.
  void exchange(std::vector<std::int64_t>& words) {
    words[length_index()] = static_cast<std::int64_t>(words_);
    try {
      comm_.allreduce(words, reduce_op::sum).wait();
    } catch (...) {
      failed_ = true;
      throw;
    }
    const int size = comm_.size();
    if (words[length_index()] != static_cast<std::int64_t>(words_) * size) {
      failed_ = true;
      throw mismatch_error(comm_.rank(), "JoinContext bookkeeping",
                           "ranks disagree on the bookkeeping layout (different joinables or a misaligned "
                           "collective); received length check " +
                               std::to_string(words[length_index()]) + ", expected " +
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
    if (round_.training > 0) {
      check_order(words);
      last_training_ = round_.is_training;
    }
  }

  // Every training rank added the places of the joinables in its learned order, each a
  // permutation of 1..K. All such vectors have the same length, so their average is itself a
  // permutation (every sum divisible by the training count, the quotients 1..K once each) only if
  // all ranks added the same one: this check is exact. Every rank sees the same sums, so every
  // rank throws, or none.
  void check_order(const std::vector<std::int64_t>& words) {
    const std::int64_t t = round_.training;
    std::array<bool, K> taken{};
    std::array<std::size_t, K> order{};
    bool agreed = true;
    for (std::size_t j = 0; j < K && agreed; ++j) {
      const std::int64_t sum = words[order_offset() + j];
      const std::int64_t place = sum / t;
      agreed = sum % t == 0 && place >= 1 && place <= static_cast<std::int64_t>(K) &&
               !taken[static_cast<std::size_t>(place - 1)];
      if (agreed) {
        taken[static_cast<std::size_t>(place - 1)] = true;
        order[static_cast<std::size_t>(place - 1)] = j;
      }
    }
    if (agreed) {
      carried_ = order;
      return;
    }
    failed_ = true;
    std::string sums;
    for (std::size_t j = 0; j < K; ++j) sums += (j ? ", " : "") + std::to_string(words[order_offset() + j]);
    throw mismatch_error(
        comm_.rank(), "JoinContext iteration " + std::to_string(round_.iteration),
        "training ranks disagree on the order in which the joinables issue their collectives (summed places per "
        "joinable: " +
            sums + " over " + std::to_string(t) + " training ranks, which is not " + std::to_string(t) +
            " times one order); " +
            (finished_ ? std::string("this rank has joined")
                       : "this rank issued them in the order " + order_text(learned_) +
                             " (joinables numbered as given to the context)") +
            ". Every rank must issue the joinables' collectives in the same order, each joinable's contiguously");
  }

  template <class J>
  void notify_one(J& j, std::size_t index, std::uint64_t epoch) {
    round_.communicating = static_cast<int>(communicating_[index]);
    round_.order_token = detail::make_join_order_token(log_, epoch, index);
    detail::join_notified(j, round_);
  }

  // Runs the round's main hooks in the carried order: a table of one function per joinable.
  template <class Hooks, std::size_t... I>
  void shadow_in_order(Hooks& hooks, std::index_sequence<I...>) {
    using shadow_fn = void (*)(JoinContext&, Hooks&);
    static constexpr std::array<shadow_fn, K> table{&JoinContext::shadow_at<Hooks, I>...};
    for (std::size_t j : carried_) table[j](*this, hooks);
  }
  template <class Hooks, std::size_t I>
  static void shadow_at(JoinContext& context, Hooks& hooks) {
    context.shadow_one(std::get<I>(hooks), I);
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
                            "rank(s) " + gone +
                                " ran out of data and throw_on_early_termination is set: every rank "
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
  std::shared_ptr<detail::join_order_log> log_;  // what the joinables issued, this iteration
  std::array<std::size_t, K> learned_{};         // learned issue order (joinable indices), what notify() carries
  std::array<std::size_t, K> carried_{};         // the order agreed in the last round, what finish() shadows in
  std::vector<bool> last_training_;
  std::uint64_t rounds_ = 0;
  bool notified_ = false;
  bool finished_ = false;
  bool failed_ = false;
  timeline::recorder* rec_ = nullptr;  // optional (set_recorder)
};

namespace detail {
/// `J`, or a readable error when `J` is not a joinable (the deduction guide's argument check:
/// a failed constraint there reads as "no viable deduction guide" under some compilers).
template <class J>
struct deduced_joinable {
  static_assert(joinable<J>,
                "every argument of JoinContext must model ddp::joinable: join_hook(const join_hook_options&) "
                "returning a join_hook, and join_communicator() (ddp/joinable.hpp)");
  using type = J;
};
}  // namespace detail

/// Deduces the joinable types: `ddp::JoinContext join(opts, grads, buffers);`.
template <class... J>
JoinContext(join_options, J&...) -> JoinContext<typename detail::deduced_joinable<J>::type...>;

}  // namespace ddp
