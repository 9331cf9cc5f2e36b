#pragma once
/// @file stores/file_store.hpp
/// @brief `file_store`: a rendezvous store in a directory, for the processes of one node or of
/// nodes sharing a file system. The default store: no server to run.
///
/// One file per key. Writes go to a temporary file that is then renamed over the key's file, so
/// readers see the old or the new value, never half of one. Counters are updated under an
/// advisory lock (`flock`) on a per-counter lock file, which the kernel releases if the holder
/// dies. `wait` polls (a few milliseconds at most between checks). File names encode the key:
/// `v.<key>` values, `c.<key>` counters, `l.<key>` counter locks, `t.<key>.<unique>` writes in
/// progress; `/` in keys becomes `%` (which keys cannot contain).
///
/// Shared file systems: rename is atomic and flock works on NFSv4 and most cluster file systems;
/// another node's writes may become visible a little later, which `wait` absorbs.

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/error.hpp>
#include <ddp/store.hpp>
#include <ddp/stores/backoff.hpp>
#include <ddp/stores/codec.hpp>

namespace ddp::stores {

/// Knobs of a `file_store`.
struct file_store_options {
  std::size_t max_value_bytes = default_max_value_bytes;  ///< larger values are rejected both ways
  std::chrono::milliseconds poll_interval{5};             ///< longest sleep between checks in `wait`
  std::chrono::milliseconds lock_timeout{5000};           ///< longest wait for a counter's lock in `add`
};

/// A store in a directory (created if missing). Copyable: copies use the same directory.
/// Thread-safe, and safe to use from many processes at once.
class file_store {
 public:
  /// Uses (and creates) `directory`. @throws communication_error if it cannot be used
  explicit file_store(std::filesystem::path directory, file_store_options opts = {})
      : dir_(std::move(directory)), opts_(opts) {
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    if (ec || !std::filesystem::is_directory(dir_, ec)) {
      throw communication_error(
          -1, "file_store",
          "cannot use directory '" + dir_.string() + "': " + (ec ? ec.message() : std::string("not a directory")));
    }
  }

  /// Replaces the value of `key` atomically (write to a temporary file, rename).
  void set(std::string_view key, std::span<const std::byte> value) {
    detail::check_key(key, "store set");
    detail::check_value_size(key, value.size(), opts_.max_value_bytes);
    write_atomically(path_of('v', key), detail::encode_frame(value), key, "store set");
  }

  /// The value of `key`, or nothing. @throws communication_error for a malformed value
  [[nodiscard]] std::optional<store_value> get(std::string_view key) {
    detail::check_key(key, "store get");
    auto raw = read_file(path_of('v', key), key, opts_.max_value_bytes, "store get");
    if (!raw) return std::nullopt;
    return detail::decode_frame(*raw, key, opts_.max_value_bytes, where());
  }

  /// Returns once every key is set (polls). @throws timeout_error naming the missing keys
  void wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) {
    for (const auto& k : keys) detail::check_key(k, "store wait");
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    detail::backoff pause(opts_.poll_interval);
    for (;;) {
      std::vector<std::string> missing;
      for (const auto& k : keys) {
        struct stat st {};
        if (::stat(path_of('v', k).c_str(), &st) != 0) missing.push_back(k);
      }
      if (missing.empty()) return;
      if (std::chrono::steady_clock::now() >= deadline) {
        throw timeout_error(-1, "store wait",
                            "keys not set within " + std::to_string(timeout.count()) +
                                " ms: " + detail::list_keys(missing) + " (" + where() + ")");
      }
      pause.sleep_until_next(deadline);
    }
  }

  /// Adds `delta` to the counter `key` under its lock; returns the new value.
  std::int64_t add(std::string_view key, std::int64_t delta) {
    detail::check_key(key, "store add");
    const std::string op = "store add '" + std::string(key) + "'";
    const auto lock_path = path_of('l', key);
    const int lock_fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (lock_fd < 0) throw os_error(op, "cannot open lock file " + lock_path.string());
    // Closing the descriptor releases the lock, on every path out of here.
    struct fd_closer {
      int fd;
      ~fd_closer() { ::close(fd); }
    } closer{lock_fd};
    lock(lock_fd, op);
    const auto counter_path = path_of('c', key);
    std::int64_t value = 0;
    if (auto raw = read_file(counter_path, key, 8, op)) value = detail::decode_counter(*raw, key, where());
    // Two's-complement wrap-around instead of signed overflow.
    value = static_cast<std::int64_t>(static_cast<std::uint64_t>(value) + static_cast<std::uint64_t>(delta));
    if (delta != 0) write_atomically(counter_path, detail::encode_counter(value), key, op);
    return value;
  }

  /// Removes the values and counters under `prefix` (and their lock and temporary files).
  std::size_t erase_prefix(std::string_view prefix) {
    detail::check_key(prefix, "store erase_prefix", /*allow_empty=*/true);
    const std::string enc = encode(prefix);
    std::size_t removed = 0;
    std::error_code ec;
    std::filesystem::directory_iterator it(dir_, ec), end;
    if (ec) throw communication_error(-1, "store erase_prefix", "cannot list " + where() + ": " + ec.message());
    for (; it != end; it.increment(ec)) {
      if (ec) break;
      const std::string name = it->path().filename().string();
      if (name.size() < 2 || name[1] != '.' || name.compare(2, enc.size(), enc) != 0) continue;
      const char kind = name[0];
      if (kind != 'v' && kind != 'c' && kind != 'l' && kind != 't') continue;
      if (::unlink(it->path().c_str()) == 0 && (kind == 'v' || kind == 'c')) ++removed;
    }
    return removed;
  }

  /// The store's directory.
  [[nodiscard]] const std::filesystem::path& directory() const noexcept { return dir_; }

 private:
  // '/' is a key character but not a file-name one; '%' is neither a key character nor special.
  static std::string encode(std::string_view key) {
    std::string s(key);
    for (char& c : s) {
      if (c == '/') c = '%';
    }
    return s;
  }

  std::filesystem::path path_of(char kind, std::string_view key) const {
    return dir_ / (std::string(1, kind) + "." + encode(key));
  }

  std::string where() const { return "file store " + dir_.string(); }

  communication_error os_error(const std::string& op, const std::string& what) const {
    const int e = errno;
    return communication_error(-1, op, what + ": " + std::strerror(e) + " (" + where() + ")");
  }

  // Reads a whole file; nothing if it does not exist. Rejects what is not a regular file (a FIFO
  // would block the open and every read) and files larger than any valid frame before reading.
  std::optional<std::vector<std::byte>> read_file(const std::filesystem::path& p, std::string_view key,
                                                  std::size_t limit, const std::string& op) const {
    // O_NONBLOCK: opening a FIFO without a writer returns at once (no effect on regular files).
    const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
      if (errno == ENOENT) return std::nullopt;
      throw os_error(op, "cannot open " + p.string());
    }
    struct fd_closer {
      int fd;
      ~fd_closer() { ::close(fd); }
    } closer{fd};
    struct stat st {};
    if (::fstat(fd, &st) != 0) throw os_error(op, "cannot stat " + p.string());
    if (!S_ISREG(st.st_mode)) {
      throw communication_error(-1, "store get '" + std::string(key) + "'",
                                "malformed value in " + where() + ": " + p.string() + " is not a regular file");
    }
    const auto size = static_cast<std::size_t>(st.st_size);
    if (size > detail::max_frame_bytes(limit)) {
      throw communication_error(-1, "store get '" + std::string(key) + "'",
                                "malformed value in " + where() + ": " + std::to_string(size) +
                                    " bytes on disk, more than the limit of " + std::to_string(limit) + " plus header");
    }
    std::vector<std::byte> buf(size);
    std::size_t got = 0;
    while (got < size) {
      const ssize_t n = ::read(fd, buf.data() + got, size - got);
      if (n < 0) {
        if (errno == EINTR) continue;
        throw os_error(op, "cannot read " + p.string());
      }
      if (n == 0) break;  // shrank under us: decode reports the truncation
      got += static_cast<std::size_t>(n);
    }
    buf.resize(got);
    return buf;
  }

  void write_atomically(const std::filesystem::path& target, const std::vector<std::byte>& bytes, std::string_view key,
                        const std::string& op) const {
    // Unique per process, thread and attempt; O_EXCL catches the improbable collision.
    const auto unique = std::to_string(::getpid()) + "." +
                        std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id())) + "." +
                        std::to_string(std::chrono::steady_clock::now().time_since_epoch().count());
    const auto temp = dir_ / ("t." + encode(key) + "." + unique);
    const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) throw os_error(op, "cannot create " + temp.string());
    std::size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
      if (n < 0) {
        if (errno == EINTR) continue;
        const auto err = os_error(op, "cannot write " + temp.string());
        ::close(fd);
        ::unlink(temp.c_str());
        throw err;
      }
      done += static_cast<std::size_t>(n);
    }
    if (::close(fd) != 0) {
      const auto err = os_error(op, "cannot write " + temp.string());
      ::unlink(temp.c_str());
      throw err;
    }
    if (::rename(temp.c_str(), target.c_str()) != 0) {
      const auto err = os_error(op, "cannot rename into " + target.string());
      ::unlink(temp.c_str());
      throw err;
    }
  }

  // Polls for the lock rather than blocking in flock: a holder that is stopped (SIGSTOP) or stuck
  // on a dead NFS server must turn into a timeout, not a hang.
  void lock(int fd, const std::string& op) const {
    const auto deadline = std::chrono::steady_clock::now() + opts_.lock_timeout;
    detail::backoff pause(std::chrono::milliseconds(2));
    while (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      if (errno != EWOULDBLOCK && errno != EINTR) throw os_error(op, "cannot lock counter");
      if (std::chrono::steady_clock::now() >= deadline) {
        throw timeout_error(-1, op,
                            "counter lock held by another process for more than " +
                                std::to_string(opts_.lock_timeout.count()) + " ms (" + where() + ")");
      }
      pause.sleep_until_next(deadline);
    }
  }

  std::filesystem::path dir_;
  file_store_options opts_;
};

static_assert(store<file_store>);

}  // namespace ddp::stores
