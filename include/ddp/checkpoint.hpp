#pragma once
/// @file checkpoint.hpp
/// @brief `ddp::checkpoint_dir`: a replica's training state saved to disk at a committed step and
/// a whole job resumed from the newest valid one (docs/checkpoint.md).
///
/// A checkpoint is one file, `step-<step>.ddpckpt`, holding the step, every tensor and scalar of a
/// `transferable_state` (parameters, optimizer state, schedule counters, DiLoCo's anchor and outer
/// momentum: whatever the trainer registered) and an XXH64 checksum. It is written to a temporary
/// file, flushed (`fsync`), renamed into place and the directory flushed, so a reader sees the
/// whole file or none. Loading reads and checks the whole file before it writes a byte of the
/// state: a truncated, corrupted or foreign file is skipped with its reason, and the one before it
/// is used; nothing is ever loaded half.
///
/// With a Manager: one replica writes (the quorum's rank 0, after `should_commit()`: at most one
/// writer per step); on a restart every replica loads the newest valid checkpoint it can read and
/// calls `Manager::resume(step)` before its first quorum; replicas that found none (or an older
/// one) heal from those with the newest. `data::global_batch_sampler`'s cursor is a scalar of the
/// same state: the data resumes with the step.

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <ddp/checkpoint/format.hpp>
#include <ddp/device_runtime.hpp>
#include <ddp/error.hpp>
#include <ddp/tensor.hpp>
#include <ddp/training_state.hpp>

namespace ddp {

/// What `checkpoint_dir::load_latest` found.
struct loaded_checkpoint {
  std::int64_t step = 0;             ///< the step the state is at
  std::filesystem::path file;        ///< the checkpoint loaded
  std::vector<std::string> skipped;  ///< newer files refused, each "<file> <why>"
};

/// The checkpoints of one job in one directory (shared by its replicas, or each replica's own).
class checkpoint_dir {
 public:
  /// @param dir   created if missing
  /// @param keep  the newest `keep` checkpoints stay after each save (at least 1)
  /// @param rank  named in errors
  /// @throws usage_error if `dir` cannot be created or `keep` < 1
  explicit checkpoint_dir(std::filesystem::path dir, int keep = 2, int rank = -1)
      : dir_(std::move(dir)), keep_(keep), rank_(rank) {
    if (keep_ < 1) throw usage_error(rank_, "checkpoint_dir", "keep must be at least 1");
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    if (ec) throw usage_error(rank_, "checkpoint_dir", "cannot create " + dir_.string() + ": " + ec.message());
    remove_stale_temporaries();
  }

  /// The directory.
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return dir_; }
  /// The file of step `step`.
  [[nodiscard]] std::filesystem::path file_of(std::int64_t step) const {
    return dir_ / ("step-" + std::to_string(step) + ".ddpckpt");
  }

  /// Saves `state` as of `step` (temporary file, fsync, rename, fsync of the directory), then
  /// removes the checkpoints of later steps (a lineage this job's resume left behind) and all but
  /// the newest `keep` of the others; never the one just written. Device tensors are copied to the
  /// host on `q` (one host synchronisation); their writes must be ordered before `q.stream`'s work.
  /// @throws usage_error for a negative step or a device tensor without a queue; error when the
  ///   disk fails
  template <transferable_state State>
  std::filesystem::path save(std::int64_t step, State& state, const device_queue& q = {}) {
    if (step < 0) throw usage_error(rank_, "checkpoint_dir::save", "negative step " + std::to_string(step));
    const std::span<const tensor_view> ts = state.state_tensors();
    check_placement(ts, q, "save");
    const std::span<std::int64_t> scalars = state.state_scalars();
    std::vector<detail::checkpoint_format::tensor_entry> entries;
    for (const tensor_view& t : ts) entries.push_back({t.type, t.count});
    std::vector<std::byte> bytes = detail::checkpoint_format::encode_header(step, entries, scalars);
    std::size_t at = bytes.size();
    std::size_t total = at + 8;
    for (const tensor_view& t : ts) total += t.bytes();
    bytes.resize(total);  // once: copies still queued on a device stream write into it
    copy_all(ts, q, [&](std::size_t i) {
      const std::size_t here = at;
      at += ts[i].bytes();
      return copy_region{bytes.data() + here, ts[i].data, ts[i].bytes()};
    });
    const std::size_t body = total - 8;
    const std::uint64_t sum = detail::checkpoint_format::checksum(std::span<const std::byte>(bytes).first(body));
    std::memcpy(bytes.data() + body, &sum, sizeof(sum));
    const std::filesystem::path final_name = file_of(step);
    write_atomically(final_name, bytes);
    prune(step);
    return final_name;
  }

  /// Loads the newest checkpoint that checks out into `state` (host tensors directly, device
  /// tensors through `q`), or nothing if there is none. Newer files that do not check out
  /// (truncated, corrupted, another version) are listed in `skipped`.
  /// @throws usage_error if a valid checkpoint holds other tensors or scalars than `state`
  ///   registers (another model: loading an older one would not help)
  template <transferable_state State>
  std::optional<loaded_checkpoint> load_latest(State& state, const device_queue& q = {}) {
    check_placement(state.state_tensors(), q, "load_latest");  // before anything is read or written
    loaded_checkpoint out;
    for (const auto& [step, file] : list()) {
      std::vector<std::byte> bytes;
      std::string why;
      if (!read_file(file, bytes, why)) {
        out.skipped.push_back(file.string() + " " + why);
        continue;
      }
      const auto c = detail::checkpoint_format::decode(bytes, why);
      if (!c) {
        out.skipped.push_back(file.string() + " " + why);
        continue;
      }
      if (c->step != step) {
        out.skipped.push_back(file.string() + " holds step " + std::to_string(c->step) + ", not its name's");
        continue;
      }
      check_matches(*c, state, file);
      const std::span<const tensor_view> ts = state.state_tensors();
      copy_all(ts, q, [&](std::size_t i) {
        return copy_region{ts[i].data, bytes.data() + c->offsets[i], ts[i].bytes()};
      });
      std::copy(c->scalars.begin(), c->scalars.end(), state.state_scalars().begin());
      out.step = c->step;
      out.file = file;
      return out;
    }
    if (!out.skipped.empty()) last_skipped_ = out.skipped;
    return std::nullopt;
  }

  /// What the last `load_latest` that found nothing refused (empty: there was nothing to refuse).
  [[nodiscard]] const std::vector<std::string>& refused() const noexcept { return last_skipped_; }

  /// The checkpoints here, newest first (by the step in their names; temporary files excluded).
  [[nodiscard]] std::vector<std::pair<std::int64_t, std::filesystem::path>> list() const {
    std::vector<std::pair<std::int64_t, std::filesystem::path>> out;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir_, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("step-", 0) != 0 || e.path().extension() != ".ddpckpt") continue;
      const std::string digits = name.substr(5, name.size() - 5 - 8);
      if (digits.empty() || digits.size() > 18 ||
          !std::all_of(digits.begin(), digits.end(), [](char d) { return d >= '0' && d <= '9'; }))
        continue;
      out.emplace_back(std::stoll(digits), e.path());
    }
    std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    return out;
  }

 private:
  // Every device tensor needs a device queue to be copied on.
  void check_placement(std::span<const tensor_view> ts, const device_queue& q, const char* what) const {
    if (q.runtime != nullptr) return;
    for (std::size_t i = 0; i < ts.size(); ++i) {
      if (ts[i].where.is_host()) continue;
      throw usage_error(rank_, std::string("checkpoint_dir::") + what,
                        "state tensor " + std::to_string(i) + " is on " + ts[i].where.str() +
                            ": pass the device queue to copy it on (e.g. the Manager's device_queue())");
    }
  }

  // Copies region(i) for every tensor i: memcpy for host tensors, one batch on `q` for device ones,
  // then one synchronisation; also when a copy fails, so that nothing still queued outlives the
  // memory it writes.
  template <class Region>
  static void copy_all(std::span<const tensor_view> ts, const device_queue& q, Region region) {
    std::vector<copy_region> on_device;
    for (std::size_t i = 0; i < ts.size(); ++i) {
      const copy_region r = region(i);
      if (r.bytes == 0) continue;
      if (ts[i].where.is_host()) {
        std::memcpy(r.dst, r.src, r.bytes);
      } else {
        on_device.push_back(r);
      }
    }
    if (on_device.empty()) return;
    const device_event e = q.runtime->create_event(q.where);
    try {
      q.runtime->copy(on_device, q.stream);
      q.runtime->record(e, q.stream);
      q.runtime->synchronize(e);
    } catch (...) {
      try {
        q.runtime->record(e, q.stream);
        q.runtime->synchronize(e);
      } catch (...) {  // the stream failed: its copies were dropped with it
      }
      q.runtime->destroy_event(e);
      throw;
    }
    q.runtime->destroy_event(e);
  }

  template <transferable_state State>
  void check_matches(const detail::checkpoint_format::contents& c, State& state,
                     const std::filesystem::path& file) const {
    const std::span<const tensor_view> ts = state.state_tensors();
    std::string problem;
    if (c.tensors.size() != ts.size() || c.scalars.size() != state.state_scalars().size()) {
      problem = "holds " + std::to_string(c.tensors.size()) + " tensors and " + std::to_string(c.scalars.size()) +
                " scalars, the state registers " + std::to_string(ts.size()) + " and " +
                std::to_string(state.state_scalars().size());
    }
    for (std::size_t i = 0; problem.empty() && i < ts.size(); ++i) {
      if (c.tensors[i].type != ts[i].type || c.tensors[i].count != ts[i].count) {
        problem = "holds tensor " + std::to_string(i) + " as " + std::to_string(c.tensors[i].count) + " " +
                  std::string(name_of(c.tensors[i].type)) + ", the state registers " + std::to_string(ts[i].count) +
                  " " + std::string(name_of(ts[i].type));
      }
    }
    if (!problem.empty()) {
      throw usage_error(rank_, "checkpoint_dir::load_latest",
                        file.string() + " " + problem + ": a checkpoint of another model or state layout");
    }
  }

  [[nodiscard]] bool read_file(const std::filesystem::path& file, std::vector<std::byte>& bytes,
                               std::string& why) const {
    std::ifstream in(file, std::ios::binary);
    if (!in) {
      why = "cannot be opened";
      return false;
    }
    in.seekg(0, std::ios::end);
    const auto size = in.tellg();
    in.seekg(0);
    if (size < 0) {
      why = "cannot be read";
      return false;
    }
    bytes.resize(static_cast<std::size_t>(size));
    if (!in.read(reinterpret_cast<char*>(bytes.data()), size)) {
      why = "cannot be read";
      return false;
    }
    return true;
  }

  // Temporary file (this process's own name), fsync, rename over `target`, fsync of the directory.
  void write_atomically(const std::filesystem::path& target, std::span<const std::byte> bytes) const {
    std::random_device random;  // unique across processes, containers and hosts sharing the directory
    const std::filesystem::path tmp = target.string() + ".tmp." + std::to_string(random()) + std::to_string(random());
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) {
      const int e = errno;
      fail("open " + tmp.string(), e);
    }
    std::size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int e = errno;
        ::close(fd);
        ::unlink(tmp.c_str());
        fail("write " + tmp.string(), e);
      }
      done += static_cast<std::size_t>(n);
    }
    if (::fsync(fd) != 0) {
      const int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      fail("fsync " + tmp.string(), e);
    }
    ::close(fd);
    if (::rename(tmp.c_str(), target.c_str()) != 0) {
      const int e = errno;
      ::unlink(tmp.c_str());
      fail("rename to " + target.string(), e);
    }
    const int dfd = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      (void)::fsync(dfd);  // the rename itself is durable once the directory is
      ::close(dfd);
    }
  }

  // Removes the checkpoints of steps after `saved` (a lineage the job left when it resumed from an
  // older one: load_latest must not go back to it) and all but the newest `keep_` up to `saved`.
  void prune(std::int64_t saved) const {
    int kept = 0;
    for (const auto& [step, file] : list()) {
      std::error_code ec;
      if (step > saved || (step < saved && ++kept >= keep_)) std::filesystem::remove(file, ec);
    }
  }

  // Temporary files of saves that did not finish (a writer killed mid-save), an hour old or more:
  // a younger one may be another writer's, still being written.
  void remove_stale_temporaries() const {
    std::error_code ec;
    const auto now = std::filesystem::file_time_type::clock::now();
    for (const auto& e : std::filesystem::directory_iterator(dir_, ec)) {
      if (e.path().filename().string().find(".ddpckpt.tmp.") == std::string::npos) continue;
      std::error_code age;
      const auto written = std::filesystem::last_write_time(e.path(), age);
      if (!age && now - written > std::chrono::hours(1)) std::filesystem::remove(e.path(), age);
    }
  }

  [[noreturn]] void fail(const std::string& what, int e) const {
    throw error(rank_, "checkpoint_dir::save", what + ": " + std::strerror(e));
  }

  std::filesystem::path dir_;
  int keep_;
  int rank_;
  std::vector<std::string> last_skipped_;
};

}  // namespace ddp
