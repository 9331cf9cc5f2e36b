#pragma once
/// @file shm/posix_segment.hpp
/// @brief `posix_segment`: a node's segment in POSIX shared memory (shm_open + mmap), for any
/// wrapped communicator; `open_posix_segment` agrees on its name through that communicator.
///
/// Set-up, collective over the wrapped communicator: each node's leader creates the object
/// (O_EXCL, random name, space reserved with posix_fallocate so a full /dev/shm is an error now
/// rather than a SIGBUS later) and writes the header; one allgather carries the names (and the
/// leaders' errors); every other rank maps its leader's object; a second allgather carries the
/// mapping results; then the leader unlinks the name. From then on the memory lives exactly as
/// long as some rank maps it, and a crash cannot leave a file behind. Any failure on any rank
/// throws `segment_error` on every rank (the same message everywhere).

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
  enum class step : std::int32_t { none, shm_open, ftruncate, fallocate, fstat, mmap, size_mismatch, config_mismatch };

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
    }
    return "?";
  }

  /// Result of creating or opening: the segment, or the failing step and errno.
  struct result {
    std::unique_ptr<posix_segment> segment;
    step failed = step::none;
    int error = 0;
  };

  /// Creates `name` exclusively with `bytes` bytes (zero-filled) and maps it.
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

  /// Opens the existing `name`, checks it has `bytes` bytes, and maps it.
  [[nodiscard]] static result open(const std::string& name, std::size_t bytes) {
    const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) return {nullptr, step::shm_open, errno};
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int e = errno;
      ::close(fd);
      return {nullptr, step::fstat, e};
    }
    if (static_cast<std::size_t>(st.st_size) != bytes) {
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

/// One rank's record in the set-up exchanges (fixed size, so one allgather carries all).
struct posix_setup_record {
  std::int32_t error = 0;
  std::int32_t failed = 0;  // posix_segment::step
  char name[56] = {};
};
static_assert(sizeof(posix_setup_record) == 64);

inline std::string random_segment_name(int node) {
  std::random_device rd;
  const std::uint64_t r = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
  char buf[56];
  std::snprintf(buf, sizeof buf, "/ddp-shm-%lx-%x-%016llx", static_cast<unsigned long>(::getpid()),
                static_cast<unsigned>(node), static_cast<unsigned long long>(r));
  return buf;
}

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
/// Collective over `comm` (two allgathers), including ranks alone on their node, which get null.
/// @throws segment_error on every rank if any rank failed, naming that rank, the call and errno
/// text; usage_error on every rank if the ranks of a node passed different options
template <communicator C>
[[nodiscard]] std::unique_ptr<segment> open_posix_segment(C& comm, const node_topology& topo,
                                                          const segment_layout& layout) {
  using step = posix_segment::step;
  const std::size_t bytes = layout.total_bytes();
  const bool shared = topo.node_size > 1;
  std::unique_ptr<posix_segment> seg;
  detail::posix_setup_record mine;
  std::string name;
  if (shared && topo.is_leader()) {
    for (int attempt = 0; attempt < 4; ++attempt) {  // a name collision is astronomically rare: retry anyway
      name = detail::random_segment_name(topo.node);
      auto r = posix_segment::create(name, bytes);
      mine.failed = static_cast<std::int32_t>(r.failed);
      mine.error = r.error;
      seg = std::move(r.segment);
      if (!(r.failed == step::shm_open && r.error == EEXIST)) break;
    }
    if (seg) layout.initialise(seg->data());
    std::snprintf(mine.name, sizeof mine.name, "%s", name.c_str());
  }
  const auto names = detail::exchange(comm, mine);

  const detail::posix_setup_record& lead = names[static_cast<std::size_t>(topo.leader())];
  if (shared && !topo.is_leader() && lead.failed == 0) {
    name.assign(lead.name, strnlen(lead.name, sizeof lead.name));
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
  if (shared && topo.is_leader() && !name.empty() && mine.failed == 0) ::shm_unlink(name.c_str());

  for (std::size_t r = 0; r < results.size(); ++r) {
    const auto& rec = results[r];
    if (rec.failed == 0) continue;
    const auto s = static_cast<step>(rec.failed);
    std::string what = "rank " + std::to_string(r) +
                       " could not set up its node's shared memory: " + posix_segment::name_of(s) + " failed";
    if (rec.error != 0)
      what += ": " + std::string(std::strerror(rec.error)) + " (errno " + std::to_string(rec.error) + ")";
    if (s == step::config_mismatch || s == step::size_mismatch) {
      throw usage_error(topo.rank, "shm::communicator set-up",
                        what + ": ranks of one node passed different shm::options");
    }
    if (s == step::fallocate || s == step::ftruncate) {
      what += " while reserving " + std::to_string(bytes) + " bytes (is /dev/shm large enough?)";
    }
    throw segment_error(topo.rank, "shm::communicator set-up", what, rec.error);
  }
  return seg;
}

}  // namespace ddp::shm
