#pragma once
/// @file buffer_reducer/engine.hpp
/// @brief The machinery behind a `BufferReducer` (ddp/buffer_reducer.hpp):
/// `detail::buffer_reducer_state`, which registers buffers, groups them, checks that every rank
/// registered the same ones, and issues each sync's collectives. Not for users.
///
/// The public class is a thin owner of this state: the state is shared with the reducer's join
/// hooks and with the continuations of in-flight syncs, so a moved or destroyed reducer leaves
/// pending work valid.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/buffer_reducer/options.hpp>
#include <ddp/buffer_reducer/stats.hpp>
#include <ddp/communicator.hpp>
#include <ddp/detail/flat_layout.hpp>
#include <ddp/detail/fnv1a.hpp>
#include <ddp/device.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/joinable.hpp>
#include <ddp/strategies/any.hpp>
#include <ddp/strategies/buffer_group.hpp>
#include <ddp/tensor.hpp>
#include <ddp/timeline.hpp>
#include <ddp/work.hpp>

namespace ddp::detail {

/// One registered buffer.
struct buffer_entry {
  tensor_view registered;                   ///< view at registration: count, dtype and device are fixed from then on
  tensor_view (*refresh)(void*) = nullptr;  ///< re-reads the view of a trainer object each sync; null: fixed view
  void* object = nullptr;                   ///< the trainer object `refresh` reads
  std::size_t strategy = 0;                 ///< index in the table of distinct strategies
  bool owned = false;                       ///< lives in the reducer's storage
  std::shared_ptr<void> held;               ///< the reducer's own copy of a handle (`object` points at it)
};

/// The views one group's strategy works on, and the trainer's views its copy path packs from and
/// unpacks to. Built once; trainer views are refreshed before each collective.
struct group_views {
  std::vector<tensor_view> tensors;  ///< what the collective runs on
  std::vector<tensor_view> buffers;  ///< per member, as the collective sees it
  std::vector<std::size_t> indices;  ///< registration indices of the members
  std::vector<std::size_t> copied;   ///< positions (in `buffers`) of members packed and unpacked
  std::vector<tensor_view> targets;  ///< trainer view of each `copied` member
  bool refreshes = false;            ///< some member's view is re-read each sync
  bool flat = false;                 ///< `tensors` is the flat storage
};

/// Everything a reducer owns, shared with its join hooks and with the continuations of in-flight
/// syncs, so that storage a pending collective writes outlives the reducer object.
class buffer_reducer_state : public std::enable_shared_from_this<buffer_reducer_state> {
 public:
  buffer_reducer_state(communicator_ref comm, buffer_reducer_options options) : comm_(comm), options_(options) {
    if (options_.period == 0) {
      throw usage_error(comm_.rank(), "BufferReducer", "options.period must be at least 1");
    }
  }

  [[nodiscard]] communicator_ref comm() const noexcept { return comm_; }
  [[nodiscard]] const buffer_reducer_options& options() const noexcept { return options_; }
  [[nodiscard]] const buffer_reducer_stats& stats() const noexcept { return stats_; }
  [[nodiscard]] bool built() const noexcept { return built_; }
  [[nodiscard]] std::size_t size() const noexcept { return entries_.size(); }
  [[nodiscard]] bool will_communicate() const noexcept { return calls_ % options_.period == 0; }

  /// Registers a trainer-owned buffer.
  std::size_t add(tensor_view v, tensor_view (*refresh)(void*), void* object, strategies::any strategy,
                  std::shared_ptr<void> held = {}) {
    const std::size_t index = entries_.size();
    check_addable("BufferReducer::add", index);
    check_no_overlap(v, index);
    entries_.push_back({v, refresh, object, intern(std::move(strategy)), false, std::move(held)});
    if (v.count > 0) by_address_.emplace(v.byte_data(), index);
    ++stats_.buffers;
    return index;
  }

  /// Registers a buffer that will live in the reducer's host storage.
  std::size_t emplace(dtype t, std::size_t count, strategies::any strategy) {
    const std::size_t index = entries_.size();
    check_addable("BufferReducer::emplace", index);
    entries_.push_back(
        {tensor_view{nullptr, count, t, device::host()}, nullptr, nullptr, intern(std::move(strategy)), true, {}});
    ++stats_.buffers;
    return index;
  }

  /// The current view of buffer `index`: its slice of the storage for an emplaced buffer.
  [[nodiscard]] tensor_view view(std::size_t index) const {
    if (index >= entries_.size()) {
      throw usage_error(
          comm_.rank(), "BufferReducer::view",
          "no buffer #" + std::to_string(index) + " (" + std::to_string(entries_.size()) + " registered)");
    }
    const buffer_entry& e = entries_[index];
    if (e.owned) {
      if (!built_) {
        throw usage_error(comm_.rank(), "BufferReducer::view",
                          "buffer #" + std::to_string(index) +
                              " lives in the reducer's storage, which exists once build() (or the first sync) ran");
      }
      return layout_.slice_of(index);
    }
    return e.refresh ? e.refresh(e.object) : e.registered;
  }

  [[nodiscard]] std::vector<buffer_group_info> groups() const {
    std::vector<buffer_group_info> out;
    for (std::size_t g = 0; g < layout_.groups().size(); ++g) {
      const flat_group& grp = layout_.groups()[g];
      const strategies::any& s = strategies_[grp.strategy];
      out.push_back({s.name(), grp.type, grp.where, grp.members, grp.count, views_[g].flat, !views_[g].copied.empty(),
                     s.communicates()});
    }
    return out;
  }

  /// Collective (one small allgather, two if ranks disagree): groups the buffers, checks that every
  /// rank registered the same ones, allocates the flat storage.
  void build() {
    if (built_) return;
    std::vector<flat_member> members;
    members.reserve(entries_.size());
    for (const buffer_entry& e : entries_) {
      members.push_back({e.strategy, e.registered.type, e.registered.where, e.registered.count, e.owned});
    }
    flat_layout layout(members);
    check_same_on_every_rank(layout);

    std::vector<group_views> views(layout.groups().size());
    std::size_t communicating = 0;
    for (std::size_t g = 0; g < views.size(); ++g) {
      const flat_group& grp = layout.groups()[g];
      group_views& gv = views[g];
      gv.indices = grp.members;
      gv.flat = static_cast<bool>(grp.storage);
      if (gv.flat) gv.tensors.push_back(grp.flat());
      for (std::size_t k = 0; k < grp.members.size(); ++k) {
        const buffer_entry& e = entries_[grp.members[k]];
        if (gv.flat) {
          gv.buffers.push_back(grp.slice(k));
          if (!e.owned) {
            gv.copied.push_back(k);
            gv.targets.push_back(e.registered);
          }
        } else {
          gv.buffers.push_back(e.registered);
          gv.tensors.push_back(e.registered);
        }
        gv.refreshes = gv.refreshes || e.refresh != nullptr;
      }
      if (strategies_[grp.strategy].communicates()) ++communicating;
    }
    layout_ = std::move(layout);
    views_ = std::move(views);
    stats_.groups = views_.size();
    stats_.collectives_per_sync = communicating;
    built_ = true;
  }

  /// One sync of a training rank; see BufferReducer::sync_async.
  [[nodiscard]] work sync_async() {
    check_idle("BufferReducer::sync");
    build();
    const bool communicate = will_communicate();
    ++calls_;
    ++stats_.syncs;
    const std::optional<join_round> round = std::exchange(round_, std::nullopt);
    if (!communicate) return work::ready();
    if (round) round->collective_issued();  // the JoinContext learns the order of the joinables' collectives
    ++stats_.communicating_syncs;
    const auto issued_at = rec_ ? clock::now() : clock::time_point{};
    return observed(track(issue(round ? &*round : nullptr, false)), issued_at);
  }

  /// Records syncs in `rec` (track `buffers`; null: stop).
  void set_recorder(timeline::recorder* rec) noexcept { rec_ = rec; }

  /// Remembers a training rank's join round for the next sync.
  void record_round(const join_round& round) { round_ = round; }

  /// A joined rank's half of one sync: the same collectives, neutral data.
  void shadow(const join_round& round) {
    check_idle("BufferReducer join hook");
    build();
    ++stats_.shadowed_syncs;
    const timeline::scoped_span span(rec_, "buffers", "shadow sync");
    issue(&round, true).wait();
  }

  /// After every rank joined: everybody adopts the authoritative rank's call count, so that the
  /// period's phase agrees again (joined ranks stopped counting). Costs one broadcast, and only
  /// with a period.
  void after_join(const join_summary& summary) {
    round_.reset();
    if (options_.period <= 1 || summary.authoritative_rank < 0) return;
    check_idle("BufferReducer join hook");
    std::int64_t calls = static_cast<std::int64_t>(calls_);
    const tensor_view v{&calls, 1, dtype::i64, device::host()};
    comm_.broadcast(std::span<const tensor_view>(&v, 1), summary.authoritative_rank).wait();
    calls_ = static_cast<std::uint64_t>(calls);
  }

 private:
  /// Clears the in-flight flag when the last copy of the sync's continuation goes away: when the
  /// work completed, failed, or was dropped unfinished.
  struct flight_guard {
    explicit flight_guard(std::shared_ptr<buffer_reducer_state> s) : state(std::move(s)) {}
    flight_guard(const flight_guard&) = delete;
    flight_guard& operator=(const flight_guard&) = delete;
    ~flight_guard() { state->in_flight_.store(false, std::memory_order_release); }
    std::shared_ptr<buffer_reducer_state> state;
  };

  work track(work w) {
    if (w.done()) return w;
    in_flight_.store(true, std::memory_order_release);
    w.then([guard = std::make_shared<flight_guard>(shared_from_this())] {});
    return w;
  }

  // Timeline: the sync from issue to observed completion (its continuation records it).
  work observed(work w, clock::time_point start) {
    if (!rec_ || !rec_->enabled()) return w;
    w.then([rec = rec_, start, n = stats_.last_sync_collectives] {
      rec->span("buffers", "sync", start, clock::now(), {{"collectives", static_cast<double>(n)}});
    });
    return w;
  }

  void check_idle(const char* op) const {
    if (in_flight_.load(std::memory_order_acquire)) {
      throw usage_error(comm_.rank(), op,
                        "the previous sync_async() has not completed: wait on (or test until done) its work first");
    }
  }

  void check_addable(const char* op, std::size_t index) const {
    if (built_) {
      throw usage_error(
          comm_.rank(), op,
          "buffer #" + std::to_string(index) +
              " registered after build() (or the first sync): register every buffer before, on every rank");
    }
  }

  void check_no_overlap(const tensor_view& v, std::size_t index) const {
    if (v.count == 0) return;
    const std::byte* begin = v.byte_data();
    const std::byte* end = begin + v.bytes();
    auto clash = [&](std::size_t other, const char* how) {
      throw usage_error(comm_.rank(), "BufferReducer::add",
                        "buffer #" + std::to_string(index) + " " + how + " buffer #" + std::to_string(other));
    };
    auto next = by_address_.lower_bound(begin);
    if (next != by_address_.end()) {
      if (next->first == begin) clash(next->second, "has the same data pointer as (registered twice?)");
      if (next->first < end) clash(next->second, "overlaps");
    }
    if (next != by_address_.begin()) {
      const auto prev = std::prev(next);
      const tensor_view& p = entries_[prev->second].registered;
      if (p.byte_data() + p.bytes() > begin) clash(prev->second, "overlaps");
    }
  }

  /// Index of `s` in the table of distinct strategies (equal strategies share one entry).
  std::size_t intern(strategies::any s) {
    for (std::size_t i = 0; i < strategies_.size(); ++i) {
      if (strategies_[i] == s) return i;
    }
    strategies_.push_back(std::move(s));
    return strategies_.size() - 1;
  }

  // --- the cross-rank layout check -------------------------------------------------------------

  /// Per buffer: what must agree across ranks.
  struct fingerprint {
    std::int64_t count, type, device_kind, group, strategy;
  };
  static constexpr std::size_t fingerprint_words = sizeof(fingerprint) / sizeof(std::int64_t);
  static_assert(sizeof(fingerprint) == 5 * sizeof(std::int64_t));

  static std::string describe(const fingerprint& f) {
    return std::string(name_of(static_cast<dtype>(f.type))) + " x " + std::to_string(f.count) + " in " +
           (f.device_kind == 0 ? "host" : "device") + " memory, group " + std::to_string(f.group);
  }

  std::vector<std::int64_t> allgather(const std::vector<std::int64_t>& mine) const {
    std::vector<std::int64_t> all(mine.size() * static_cast<std::size_t>(comm_.size()));
    std::vector<std::int64_t> in = mine;  // the communicator takes mutable views
    comm_.allgather(ddp::view(in), ddp::view(all)).wait();
    return all;
  }

  /// Every rank compares every rank's (count, period, hash of the per-buffer fingerprints) and,
  /// only if they differ, the per-buffer fingerprints, to name the first buffer and rank that differ.
  /// Every rank sees the same data, so every rank throws (or none does).
  void check_same_on_every_rank(const flat_layout& layout) const {
    const int rank = comm_.rank();
    const auto size = static_cast<std::size_t>(comm_.size());
    std::vector<std::int64_t> fps;
    fps.reserve(entries_.size() * fingerprint_words);
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      const buffer_entry& e = entries_[i];
      const std::string name = strategies_[e.strategy].name();
      const fingerprint f{static_cast<std::int64_t>(e.registered.count), static_cast<std::int64_t>(e.registered.type),
                          e.registered.where.is_host() ? 0 : 1, static_cast<std::int64_t>(layout.group_of(i)),
                          static_cast<std::int64_t>(fnv1a(name))};
      fps.insert(fps.end(), {f.count, f.type, f.device_kind, f.group, f.strategy});
    }
    const std::vector<std::int64_t> summary{static_cast<std::int64_t>(entries_.size()),
                                            static_cast<std::int64_t>(options_.period),
                                            static_cast<std::int64_t>(fnv1a(std::as_bytes(std::span(fps))))};
    const std::vector<std::int64_t> all = allgather(summary);
    const auto at = [&](std::size_t r, std::size_t k) { return all[r * summary.size() + k]; };
    bool same = true;
    for (std::size_t r = 1; r < size; ++r) {
      if (at(r, 0) != at(0, 0)) {
        throw usage_error(rank, "BufferReducer::build",
                          "rank 0 registered " + std::to_string(at(0, 0)) + " buffers but rank " + std::to_string(r) +
                              " registered " + std::to_string(at(r, 0)) +
                              ": every rank must register the same buffers in the same order");
      }
      if (at(r, 1) != at(0, 1)) {
        throw usage_error(rank, "BufferReducer::build",
                          "rank 0 has period " + std::to_string(at(0, 1)) + " but rank " + std::to_string(r) +
                              " has period " + std::to_string(at(r, 1)) + ": every rank must use the same period");
      }
      same = same && at(r, 2) == at(0, 2);
    }
    if (same) return;

    const std::vector<std::int64_t> every = allgather(fps);
    const auto fp = [&](std::size_t r, std::size_t i) {
      const std::int64_t* p = every.data() + (r * entries_.size() + i) * fingerprint_words;
      return fingerprint{p[0], p[1], p[2], p[3], p[4]};
    };
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      const fingerprint f0 = fp(0, i);
      for (std::size_t r = 1; r < size; ++r) {
        const fingerprint fr = fp(r, i);
        if (fr.count == f0.count && fr.type == f0.type && fr.device_kind == f0.device_kind && fr.group == f0.group &&
            fr.strategy == f0.strategy) {
          continue;
        }
        std::string msg = "buffer #" + std::to_string(i) + " differs across ranks: rank 0 has " + describe(f0) +
                          ", rank " + std::to_string(r) + " has " + describe(fr);
        if (fr.strategy != f0.strategy) {
          msg += "; they give it different strategies (this rank: " + strategies_[entries_[i].strategy].name() + ")";
        }
        throw usage_error(rank, "BufferReducer::build", msg);
      }
    }
    // Equal fingerprints with different hashes cannot happen; stay safe rather than silent.
    throw usage_error(rank, "BufferReducer::build", "ranks disagree on the buffer layout");
  }

  // --- issuing a sync --------------------------------------------------------------------------

  /// Re-reads trainer views that may have moved (a std::vector that reallocated); their count,
  /// dtype and device must not have changed.
  void refresh(group_views& gv) {
    std::size_t copied = 0;
    for (std::size_t k = 0; k < gv.indices.size(); ++k) {
      const buffer_entry& e = entries_[gv.indices[k]];
      const bool is_copied = copied < gv.copied.size() && gv.copied[copied] == k;
      if (e.refresh != nullptr) {
        const tensor_view now = e.refresh(e.object);
        if (now.count != e.registered.count || now.type != e.registered.type || now.where != e.registered.where) {
          throw usage_error(comm_.rank(), "BufferReducer::sync",
                            "buffer #" + std::to_string(gv.indices[k]) + " was " +
                                std::string(name_of(e.registered.type)) + " x " + std::to_string(e.registered.count) +
                                " on " + e.registered.where.str() + " when registered and is now " +
                                std::string(name_of(now.type)) + " x " + std::to_string(now.count) + " on " +
                                now.where.str() + ": a registered buffer must keep its size, dtype and device");
        }
        if (is_copied) {
          gv.targets[copied] = now;
        } else if (!gv.flat) {
          gv.buffers[k] = now;
          gv.tensors[k] = now;
        }
      }
      if (is_copied) ++copied;
    }
  }

  void pack(const group_views& gv) {
    for (std::size_t j = 0; j < gv.copied.size(); ++j) {
      const tensor_view& from = gv.targets[j];
      if (from.count > 0) std::memcpy(gv.buffers[gv.copied[j]].data, from.data, from.bytes());
      stats_.bytes_copied += from.bytes();
    }
  }

  void unpack(std::size_t g) {
    const group_views& gv = views_[g];
    for (std::size_t j = 0; j < gv.copied.size(); ++j) {
      const tensor_view& to = gv.targets[j];
      if (to.count > 0) std::memcpy(to.data, gv.buffers[gv.copied[j]].data, to.bytes());
      stats_.bytes_copied += to.bytes();
    }
  }

  /// Runs every communicating group's strategy, in group order (the same on every rank).
  work issue(const join_round* round, bool joined) {
    std::vector<work> parts;
    parts.reserve(views_.size());
    std::size_t issued = 0;
    for (std::size_t g = 0; g < views_.size(); ++g) {
      const strategies::any& strategy = strategies_[layout_.groups()[g].strategy];
      if (!strategy.communicates()) continue;
      group_views& gv = views_[g];
      if (gv.refreshes) refresh(gv);
      const buffer_group group{comm_, gv.tensors, gv.buffers, gv.indices, round, joined};
      const bool copies = !gv.copied.empty();
      if (copies && strategy.reads_local_data(group)) pack(gv);
      work w = run(strategy, group);
      ++issued;
      stats_.bytes_communicated += group.count() * size_of(group.type());
      if (copies && strategy.writes_local_data(group)) {
        w.then([self = shared_from_this(), g] { self->unpack(g); });
      }
      parts.push_back(std::move(w));
    }
    stats_.collectives += issued;
    stats_.last_sync_collectives = issued;
    return work::all(std::move(parts));
  }

  /// A strategy's usage errors from the backend (device memory, bad root) do not say which
  /// buffers they are about: add that.
  work run(const strategies::any& strategy, const buffer_group& group) const {
    try {
      return strategy.sync(group);
    } catch (const usage_error& e) {
      if (e.operation().rfind("BufferReducer", 0) == 0) throw;
      throw usage_error(comm_.rank(), "BufferReducer::sync",
                        group.describe() + " with strategy " + strategy.name() + ": " + e.what());
    }
  }

  communicator_ref comm_;
  buffer_reducer_options options_;
  std::vector<strategies::any> strategies_;
  std::vector<buffer_entry> entries_;
  std::map<const std::byte*, std::size_t> by_address_;  ///< trainer buffers by start address (overlap check)
  flat_layout layout_;
  std::vector<group_views> views_;
  bool built_ = false;
  std::uint64_t calls_ = 0;
  std::optional<join_round> round_;
  std::atomic<bool> in_flight_{false};
  buffer_reducer_stats stats_;
  timeline::recorder* rec_ = nullptr;  // optional (set_recorder)
};

}  // namespace ddp::detail
