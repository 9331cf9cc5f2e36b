#pragma once
/// @file shm/posix_segment.hpp
/// @brief `posix_segment`: a node's segment in POSIX shared memory (shm_open + mmap), for any
/// wrapped communicator; `open_posix_segment` agrees on its name through that communicator.
///
/// Set-up, collective over the wrapped communicator, in three allgathers, so that no failure
/// and no timeout leaves a name in /dev/shm:
/// 1. each node's leader draws a random name and the first allgather carries it: every rank of
///    the node knows the name before the object exists (nothing to leak if this step fails);
/// 2. the leader creates the object (O_EXCL, mode 0600, space reserved with posix_fallocate so
///    a full /dev/shm is an error now rather than a SIGBUS later) and writes the header; the
///    second allgather carries the result;
/// 3. every other rank maps it, checking owner, mode, size and header; the third allgather
///    carries the results; then every rank of the node unlinks the name.
/// From step 2 on, every rank of the node holds a guard that unlinks the name if it leaves with
/// an exception (a timeout included), so the object goes with the set-up unless every rank of
/// the node dies (SIGKILL) inside those two allgathers. Afterwards the memory lives exactly as
/// long as some rank maps it. Any failure on any rank throws on every rank (the same message
/// everywhere); a malformed record from a peer is a `communication_error` naming it.

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ddp/communicator.hpp>
#include <ddp/shm/layout.hpp>
#include <ddp/shm/segment.hpp>
#include <ddp/shm/topology.hpp>
#include <ddp/tensor.hpp>

namespace ddp::shm {

/// A mapping of a POSIX shared-memory object. Unmaps on destruction (never unlinks: the name
/// is gone once every rank has mapped it).
class posix_segment final : public segment {
 public:
  /// What failed, for errors reported across ranks.
  enum class step : std::int32_t {
    none,
    shm_open,
    ftruncate,
    fallocate,
    fstat,
    mmap,
    size_mismatch,
    config_mismatch,
    foreign_owner,  ///< not owned by this user, or readable/writable by others
  };
  /// The last step; records from peers holding more are malformed.
  static constexpr std::int32_t last_step = static_cast<std::int32_t>(step::foreign_owner);

  /// Name of a step, for messages.
  [[nodiscard]] static const char* name_of(step s) noexcept {
    switch (s) {
      case step::none: return "nothing";
      case step::shm_open: return "shm_open";
      case step::ftruncate: return "ftruncate";
      case step::fallocate: return "posix_fallocate";
      case step::fstat: return "fstat";
      case step::mmap: return "mmap";
      case step::size_mismatch: return "size check";
      case step::config_mismatch: return "options check";
      case step::foreign_owner: return "owner check (the object belongs to another user or others may access it)";
    }
    return "?";
  }

  /// Result of creating or opening: the segment, or the failing step and errno.
  struct result {
    std::unique_ptr<posix_segment> segment;
    step failed = step::none;
    int error = 0;
  };

  /// Creates `name` exclusively (mode 0600) with `bytes` bytes (zero-filled) and maps it. On
  /// failure the name is unlinked again.
  [[nodiscard]] static result create(const std::string& name, std::size_t bytes) {
    const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) return {nullptr, step::shm_open, errno};
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) return fail_and_unlink(fd, name, step::ftruncate, errno);
    // Reserve the pages now: on tmpfs a write to an unreserved page of a full file system is a
    // SIGBUS. File systems that cannot preallocate (EOPNOTSUPP/EINVAL) keep the lazy behaviour.
    if (const int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
        rc != 0 && rc != EOPNOTSUPP && rc != EINVAL) {
      return fail_and_unlink(fd, name, step::fallocate, rc);
    }
    return map(fd, bytes, &name);
  }

  /// Opens the existing `name`, checks that this user owns it, that nobody else may access it
  /// (mode 0600 or stricter) and that it has `bytes` bytes, and maps it. The owner check keeps
  /// another local user from handing this rank memory it can read or write.
  [[nodiscard]] static result open(const std::string& name, std::size_t bytes) {
    const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) return {nullptr, step::shm_open, errno};
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int e = errno;
      ::close(fd);
      return {nullptr, step::fstat, e};
    }
    if (st.st_uid != ::geteuid() || (st.st_mode & 077) != 0) {
      ::close(fd);
      return {nullptr, step::foreign_owner, 0};
    }
    if (st.st_size < 0 || static_cast<std::size_t>(st.st_size) != bytes) {
      ::close(fd);
      return {nullptr, step::size_mismatch, 0};
    }
    return map(fd, bytes, nullptr);
  }

  posix_segment(const posix_segment&) = delete;
  posix_segment& operator=(const posix_segment&) = delete;
  ~posix_segment() override {
    if (data() != nullptr) ::munmap(data(), size());
  }

  /// "posix".
  [[nodiscard]] const char* backing() const noexcept override { return "posix"; }

 private:
  posix_segment(std::byte* data, std::size_t size) noexcept : segment(data, size) {}

  static result fail_and_unlink(int fd, const std::string& name, step s, int e) {
    ::close(fd);
    ::shm_unlink(name.c_str());
    return {nullptr, s, e};
  }

  static result map(int fd, std::size_t bytes, const std::string* unlink_on_failure) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int e = errno;
    ::close(fd);  // the mapping keeps the object alive
    if (p == MAP_FAILED) {
      if (unlink_on_failure != nullptr) ::shm_unlink(unlink_on_failure->c_str());
      return {nullptr, step::mmap, e};
    }
    return {std::unique_ptr<posix_segment>(new posix_segment(static_cast<std::byte*>(p), bytes)), step::none, 0};
  }
};

namespace detail {

/// One rank's record in the set-up exchanges (fixed size, so one allgather carries all). Peers
/// write it: `check_setup_record` validates it before anything in it is used.
struct posix_setup_record {
  std::int32_t error = 0;   ///< errno of the failed step, or 0
  std::int32_t failed = 0;  ///< posix_segment::step
  char name[56] = {};       ///< the segment's name (leaders, first exchange), NUL-terminated
};
static_assert(sizeof(posix_setup_record) == 64);

/// Prefix of every segment name ddp creates (after the leading slash).
inline constexpr std::string_view segment_name_prefix = "/ddp-shm-";

/// A fresh segment name: "/ddp-shm-<pid>-<node>-<64 random bits>", all hexadecimal.
inline std::string random_segment_name(int node) {
  std::random_device rd;
  const std::uint64_t r = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
  char buf[56];
  std::snprintf(buf, sizeof buf, "/ddp-shm-%lx-%x-%016llx", static_cast<unsigned long>(::getpid()),
                static_cast<unsigned>(node), static_cast<unsigned long long>(r));
  return buf;
}

/// True for a name `random_segment_name` can produce (prefix, then hex digits and dashes).
[[nodiscard]] inline bool valid_segment_name(std::string_view name) noexcept {
  if (name.size() <= segment_name_prefix.size() || name.size() >= sizeof(posix_setup_record::name) ||
      name.substr(0, segment_name_prefix.size()) != segment_name_prefix) {
    return false;
  }
  for (char c : name.substr(segment_name_prefix.size())) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || c == '-')) return false;
  }
  return true;
}

/// Checks the record rank `from` sent in a set-up exchange; with `want_name`, returns the name
/// it carries (else empty).
/// @throws communication_error naming `from` if the record is malformed: an unknown step, an
/// errno out of range, or (with `want_name`) a name ddp would not create
inline std::string check_setup_record(const posix_setup_record& rec, int from, bool want_name, int rank) {
  const auto bad = [&](const std::string& what) {
    return communication_error(rank, "shm::communicator set-up",
                               "rank " + std::to_string(from) + " sent a malformed set-up record (" + what +
                                   "): a version-skewed or corrupt peer");
  };
  if (rec.failed < 0 || rec.failed > posix_segment::last_step) {
    throw bad("step " + std::to_string(rec.failed));
  }
  if (rec.error < 0 || rec.error > 4095) throw bad("errno " + std::to_string(rec.error));
  if (!want_name) return {};
  const std::string_view name(rec.name, ::strnlen(rec.name, sizeof rec.name));
  if (!valid_segment_name(name)) throw bad("segment name of " + std::to_string(name.size()) + " bytes");
  return std::string(name);
}

/// Throws, the same on every rank, for the first record of `records` that reports a failure.
/// @throws usage_error when the ranks of a node passed different options; segment_error for a
/// failed system call; communication_error for a malformed record
inline void throw_first_failure(const std::vector<posix_setup_record>& records, int rank, std::size_t bytes) {
  using step = posix_segment::step;
  for (std::size_t r = 0; r < records.size(); ++r) {
    const auto& rec = records[r];
    check_setup_record(rec, static_cast<int>(r), false, rank);
    if (rec.failed == 0) continue;
    const auto s = static_cast<step>(rec.failed);
    std::string what = "rank " + std::to_string(r) +
                       " could not set up its node's shared memory: " + posix_segment::name_of(s) + " failed";
    if (rec.error != 0) {
      what += ": " + std::string(std::strerror(rec.error)) + " (errno " + std::to_string(rec.error) + ")";
    }
    if (s == step::config_mismatch || s == step::size_mismatch) {
      throw usage_error(rank, "shm::communicator set-up", what + ": ranks of one node passed different shm::options");
    }
    if (s == step::fallocate || s == step::ftruncate) {
      what += " while reserving " + std::to_string(bytes) + " bytes (is /dev/shm large enough?)";
    }
    throw segment_error(rank, "shm::communicator set-up", what, rec.error);
  }
}

/// Unlinks a segment name when it goes (or at `unlink_now()`), so that no path out of set-up,
/// exceptions included, leaves the name behind. Unlinking a name already gone is harmless.
class name_guard {
 public:
  name_guard() = default;
  name_guard(const name_guard&) = delete;
  name_guard& operator=(const name_guard&) = delete;
  ~name_guard() { unlink_now(); }

  /// From now on, unlink `name` (at the latest) when this guard goes.
  void arm(std::string name) { name_ = std::move(name); }
  /// Unlinks the name now (once).
  void unlink_now() noexcept {
    if (!name_.empty()) ::shm_unlink(name_.c_str());
    name_.clear();
  }

 private:
  std::string name_;
};

/// All ranks' records of one set-up exchange (one allgather over `comm`).
template <communicator C>
std::vector<posix_setup_record> exchange(C& comm, const posix_setup_record& mine) {
  std::vector<std::uint8_t> in(sizeof mine);
  std::memcpy(in.data(), &mine, sizeof mine);
  std::vector<std::uint8_t> all(sizeof mine * static_cast<std::size_t>(comm.size()));
  comm.allgather(view(in), view(all)).wait();
  std::vector<posix_setup_record> out(static_cast<std::size_t>(comm.size()));
  std::memcpy(out.data(), all.data(), all.size());
  return out;
}

}  // namespace detail

/// Creates (on each node's leader) and maps (everywhere) the node's segment for `layout`.
/// Collective over `comm` (three allgathers), including ranks alone on their node, which get
/// null. Every path out of it, a timeout included, leaves no name in /dev/shm (file comment).
/// @throws segment_error on every rank if any rank failed, naming that rank, the call and errno
/// text; usage_error on every rank if the ranks of a node passed different options;
/// communication_error for a malformed record from a peer; whatever `comm.allgather` throws
template <communicator C>
[[nodiscard]] std::unique_ptr<segment> open_posix_segment(C& comm, const node_topology& topo,
                                                          const segment_layout& layout) {
  using step = posix_segment::step;
  const std::size_t bytes = layout.total_bytes();
  const bool shared = topo.node_size > 1;
  const auto leader = static_cast<std::size_t>(topo.leader());

  // 1. The name, before the object exists.
  detail::posix_setup_record mine;
  std::string name;
  if (shared && topo.is_leader()) {
    name = detail::random_segment_name(topo.node);
    std::snprintf(mine.name, sizeof mine.name, "%s", name.c_str());
  }
  const auto names = detail::exchange(comm, mine);
  // Every rank checks every record, so that a malformed one fails set-up everywhere alike.
  for (std::size_t r = 0; r < names.size(); ++r) {
    const bool named = names[r].name[0] != '\0' || (shared && r == leader);
    std::string n = detail::check_setup_record(names[r], static_cast<int>(r), named, topo.rank);
    if (shared && r == leader) name = std::move(n);
  }
  detail::name_guard guard;  // declared before the mapping: unlinks even if set-up fails later
  mine = {};

  // 2. The leader creates it. A name collision (EEXIST) is an error: the name has 64 random bits,
  // so one means someone is squatting on our names.
  std::unique_ptr<posix_segment> seg;
  if (shared) {
    guard.arm(name);
    if (topo.is_leader()) {
      auto r = posix_segment::create(name, bytes);
      mine.failed = static_cast<std::int32_t>(r.failed);
      mine.error = r.error;
      seg = std::move(r.segment);
      if (seg) layout.initialise(seg->data());
    }
  }
  detail::throw_first_failure(detail::exchange(comm, mine), topo.rank, bytes);

  // 3. The others map it.
  if (shared && !topo.is_leader()) {
    auto r = posix_segment::open(name, bytes);
    mine.failed = static_cast<std::int32_t>(r.failed);
    mine.error = r.error;
    seg = std::move(r.segment);
    if (seg) {
      try {
        layout.check(seg->data(), topo.rank);
      } catch (const usage_error&) {
        mine.failed = static_cast<std::int32_t>(step::config_mismatch);
        seg.reset();
      }
    }
  }
  const auto results = detail::exchange(comm, mine);
  guard.unlink_now();  // every rank of the node has it mapped (or set-up failed): the name goes
  detail::throw_first_failure(results, topo.rank, bytes);
  return seg;
}

}  // namespace ddp::shm
