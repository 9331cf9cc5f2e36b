#pragma once
/// @file data/global_batch_sampler.hpp
/// @brief `data::global_batch_sampler`: every sample of every epoch is trained on exactly once,
/// with a constant global batch, while replicas leave and join a fault-tolerant job.
///
/// One seeded stream of samples; each step's global batch is split over the live replicas
/// (`contiguous_share`, as `ReproducibleReducer`), and the cursor, a healed scalar of the
/// training state, advances only in `commit()`, after the Manager committed the step. Usage,
/// the rules and the shuffle: docs/exactly-once.md.

#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <ddp/error.hpp>
#include <ddp/partition.hpp>
#include <ddp/training_state.hpp>

namespace ddp::data {

/// A keyed pseudo-random permutation of `[0, n)`: a 4-round Feistel network on the smallest
/// even number of bits that holds `n`, with cycle walking. Computed per index (no table), the
/// same on every platform.
class permutation {
 public:
  /// The permutation of `[0, n)` for `key` (identity for `n` <= 1).
  permutation(std::uint64_t n, std::uint64_t key) : n_(n) {
    const unsigned bits = n > 1 ? static_cast<unsigned>(std::bit_width(n - 1)) : 0u;
    half_ = (bits + 1) / 2;
    if (half_ == 0) half_ = 1;
    mask_ = (std::uint64_t{1} << half_) - 1;
    for (unsigned r = 0; r < rounds; ++r) keys_[r] = mix(key + 0x9e3779b97f4a7c15ull * (r + 1));
  }

  /// Image of `i` (in `[0, n)`).
  [[nodiscard]] std::uint64_t operator()(std::uint64_t i) const noexcept {
    if (n_ <= 1) return i;
    do {
      i = encrypt(i);
    } while (i >= n_);
    return i;
  }
  /// Size of the permuted range.
  [[nodiscard]] std::uint64_t size() const noexcept { return n_; }

 private:
  static constexpr unsigned rounds = 4;

  static std::uint64_t mix(std::uint64_t x) noexcept {  // splitmix64's finaliser
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  }
  [[nodiscard]] std::uint64_t encrypt(std::uint64_t x) const noexcept {
    std::uint64_t l = x >> half_, r = x & mask_;
    for (unsigned k = 0; k < rounds; ++k) {
      const std::uint64_t next = l ^ (mix(r ^ keys_[k]) & mask_);
      l = r;
      r = next;
    }
    return (l << half_) | r;
  }

  std::uint64_t n_;
  unsigned half_ = 1;
  std::uint64_t mask_ = 1;
  std::uint64_t keys_[rounds]{};
};

/// What a `global_batch_sampler` samples.
struct sampler_options {
  std::uint64_t dataset_size = 0;  ///< N: samples per epoch (ids 0..N-1)
  std::uint64_t global_batch = 0;  ///< B: samples per step, whatever the number of replicas
  std::uint64_t micro_batch = 1;   ///< samples per micro-batch (B must be a multiple)
  std::uint64_t seed = 0;          ///< key of the per-epoch orders
  bool shuffle = true;             ///< false: every epoch in id order
};

/// Hands each live replica its share of each step's global batch (see the file description).
/// Cheap to copy only together with the cursor's storage: it refers to the cursor, it does not own it.
class global_batch_sampler {
 public:
  /// Keeps the cursor in a new scalar of `state`, so that healing carries it to a replacement.
  /// Construct it before the Manager forms its first quorum; `state` must outlive the sampler.
  /// @throws usage_error for invalid options
  global_batch_sampler(sampler_options options, training_state& state)
      : opts_(check(options)),
        cursor_([&state, i = state.add_scalar(0)]() -> std::int64_t& { return state.scalar(i); }) {}
  /// Keeps the cursor in `cursor` (a scalar of your own transferable state); it must outlive the sampler.
  /// @throws usage_error for invalid options
  global_batch_sampler(sampler_options options, std::int64_t& cursor)
      : opts_(check(options)), cursor_([&cursor]() -> std::int64_t& { return cursor; }) {}

  // ---- the next global batch -------------------------------------------------------------------

  /// Stream positions consumed by committed steps.
  [[nodiscard]] std::uint64_t cursor() const { return static_cast<std::uint64_t>(cursor_()); }
  /// Epoch of the next global batch's first sample.
  [[nodiscard]] std::uint64_t epoch() const { return cursor() / opts_.dataset_size; }
  /// Committed steps (cursor / global batch).
  [[nodiscard]] std::uint64_t steps() const { return cursor() / opts_.global_batch; }
  /// M: micro-batches per global batch.
  [[nodiscard]] std::size_t micro_batches() const noexcept {
    return static_cast<std::size_t>(opts_.global_batch / opts_.micro_batch);
  }

  /// The sample id at stream position `position`.
  [[nodiscard]] std::uint64_t sample_at(std::uint64_t position) const {
    const std::uint64_t n = opts_.dataset_size;
    const std::uint64_t e = position / n, off = position % n;
    if (!opts_.shuffle) return off;
    return permutation(n, opts_.seed * 0x2545f4914f6cdd1dull + e)(off);
  }
  /// Sample ids of micro-batch `j` (in `[0, micro_batches())`) of the next global batch.
  /// @throws usage_error if `j` is out of range
  [[nodiscard]] std::vector<std::uint64_t> micro_batch(std::size_t j) const {
    if (j >= micro_batches()) {
      throw usage_error(-1, "global_batch_sampler::micro_batch",
                        "micro-batch " + std::to_string(j) + " of " + std::to_string(micro_batches()));
    }
    std::vector<std::uint64_t> out;
    const std::uint64_t base = cursor() + j * opts_.micro_batch;
    for (std::uint64_t k = 0; k < opts_.micro_batch; ++k) out.push_back(sample_at(base + k));
    return out;
  }
  /// Every sample id of the next global batch, in order.
  [[nodiscard]] std::vector<std::uint64_t> global_batch() const {
    std::vector<std::uint64_t> out;
    for (std::uint64_t k = 0; k < opts_.global_batch; ++k) out.push_back(sample_at(cursor() + k));
    return out;
  }

  /// Micro-batches of the next global batch for replica `rank` of `size` participating replicas.
  [[nodiscard]] item_range share(int rank, int size) const { return contiguous_share(micro_batches(), size, rank); }
  /// The same for a Manager (or any communicator): the share of its participant rank among the
  /// step's participants (a Manager's hot spares, and with `healed_replicas_participate = false`
  /// the replicas healed in this step, contribute zeros: their share is empty), else of its rank
  /// in the group.
  template <class Group>
  requires requires(const Group& g) {
    { g.rank() } -> std::convertible_to<int>;
    { g.size() } -> std::convertible_to<int>;
  }
  [[nodiscard]] item_range share(const Group& g) const { return contributor_share(micro_batches(), g); }
  /// Micro-batches of the next global batch for rank `index` of a replica group of `group_size`
  /// ranks: its contiguous part of the group's share, the group counted once among the replicas
  /// (`replica`: a GroupManager, docs/replica-groups.md).
  /// @throws usage_error if `index` is not in `[0, group_size)`
  template <class Group>
  requires requires(const Group& g) {
    { g.rank() } -> std::convertible_to<int>;
    { g.size() } -> std::convertible_to<int>;
  }
  [[nodiscard]] item_range share(const Group& replica, int index, int group_size) const {
    const item_range whole = share(replica);
    const item_range part = contiguous_share(whole.size(), group_size, index);
    return {whole.first + part.first, whole.first + part.last};
  }
  /// Sample ids of replica `rank`'s share, micro-batch after micro-batch.
  [[nodiscard]] std::vector<std::uint64_t> samples(int rank, int size) const {
    std::vector<std::uint64_t> out;
    const item_range r = share(rank, size);
    for (std::size_t j = r.first; j < r.last; ++j) {
      const auto mb = micro_batch(j);
      out.insert(out.end(), mb.begin(), mb.end());
    }
    return out;
  }

  // ---- commit ----------------------------------------------------------------------------------

  /// The step committed (call it exactly when `Manager::should_commit()` returned true): the
  /// cursor moves past its global batch.
  void commit() { cursor_() += static_cast<std::int64_t>(opts_.global_batch); }

  /// The options.
  [[nodiscard]] const sampler_options& options() const noexcept { return opts_; }

 private:
  static sampler_options check(const sampler_options& o) {
    const char* op = "global_batch_sampler";
    if (o.dataset_size == 0) throw usage_error(-1, op, "dataset_size must be positive");
    if (o.global_batch == 0 || o.micro_batch == 0)
      throw usage_error(-1, op, "global_batch and micro_batch must be positive");
    if (o.global_batch % o.micro_batch != 0) {
      throw usage_error(-1, op,
                        "global_batch " + std::to_string(o.global_batch) + " is not a multiple of micro_batch " +
                            std::to_string(o.micro_batch));
    }
    return o;
  }

  sampler_options opts_;
  std::function<std::int64_t&()> cursor_;
};

}  // namespace ddp::data
