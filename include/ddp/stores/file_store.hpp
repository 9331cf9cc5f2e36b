#pragma once
/// @file stores/file_store.hpp
/// @brief `file_store`: a rendezvous store in a directory, for the processes of one node or of
/// nodes sharing a file system. The default store: no server to run.
///
/// One file per key. Writes go to a temporary file that is then renamed over the key's file, so
/// readers see the old or the new value, never half of one. Counters are updated under an
/// advisory lock (`flock`) on a per-counter lock file, which the kernel releases if the holder
/// dies; the holder removes the lock file before releasing it, so none is left behind.
/// `wait` polls (a few milliseconds at most between checks).
///
/// File names encode the key: `v.<key>` values, `c.<key>` counters, `l.<key>` counter locks,
/// `t.<key>.<unique>` writes in progress; `/` in keys becomes `%` (which keys cannot contain).
/// A key longer than 192 bytes does not fit a file name with its kind and suffix: its name keeps
/// the first 175 bytes, then `~` and the FNV-1a 64 hash of the key in 16 hex digits, and its file
/// starts with the whole key and a newline, checked on every read (so a hash collision or a
/// file someone else wrote is an error, never another key's value).
///
/// The directory is private: the store creates it 0700 and refuses one owned by another user or
/// writable by group or others (`group_access` allows a group job's shared directory); files are
/// created 0600 and opened with `O_NOFOLLOW`, relative to the directory opened once, so a link
/// planted under a key's name is refused rather than followed. docs/backends-gloo.md, "Hardening".
///
/// Shared file systems: rename is atomic and flock works on NFSv4 and most cluster file systems;
/// another node's writes may become visible a little later, which `wait` absorbs.

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/detail/fnv1a.hpp>
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
  /// For a job whose processes run as different users sharing a group: the directory may be
  /// group-writable and owned by another user, if its group is one of this process's groups; a
  /// directory the store creates is 0770 and its files 0660. Writable by others is refused always.
  bool group_access = false;
};

/// A store in a directory (created 0700 if missing). Copyable: copies use the same directory.
/// Thread-safe, and safe to use from many processes at once.
class file_store {
 public:
  /// Uses (and creates) `directory`.
  /// @throws communication_error if it cannot be used, or if another user owns it or could write
  ///         to it (see `file_store_options::group_access`)
  explicit file_store(std::filesystem::path directory, file_store_options opts = {})
      : dir_(std::move(directory)), opts_(opts), fd_(std::make_shared<dir_handle>(open_directory())) {}

  /// Replaces the value of `key` atomically (write to a temporary file, rename).
  void set(std::string_view key, std::span<const std::byte> value) {
    detail::check_key(key, "store set");
    detail::check_value_size(key, value.size(), opts_.max_value_bytes);
    write_atomically(name_of('v', key), detail::encode_frame(value), key, "store set");
  }

  /// Stores `value` under `key` unless it has a value; returns the value it holds
  /// (`first_write_store`): the complete file is written under a temporary name, then
  /// hard-linked to the key's name, which fails if that name exists (atomic, never follows it).
  store_value set_if_absent(std::string_view key, std::span<const std::byte> value) {
    detail::check_key(key, "store set_if_absent");
    detail::check_value_size(key, value.size(), opts_.max_value_bytes);
    write_atomically(name_of('v', key), detail::encode_frame(value), key, "store set_if_absent", /*replace=*/false);
    auto held = get(key);
    if (!held) {
      throw communication_error(-1, "store set_if_absent '" + std::string(key) + "'",
                                "the key was removed while it was being read (" + where() + ")");
    }
    return std::move(*held);
  }

  /// The value of `key`, or nothing. @throws communication_error for a malformed value
  [[nodiscard]] std::optional<store_value> get(std::string_view key) {
    detail::check_key(key, "store get");
    auto raw = read_file(name_of('v', key), key, opts_.max_value_bytes, "store get");
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
        // Any entry counts, a link included: `get` then says what is wrong with it.
        struct stat st {};
        if (::fstatat(dir_fd(), name_of('v', k).c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) missing.push_back(k);
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
    const std::string lock_name = name_of('l', key);
    // Removing the lock file while still holding the lock, then closing (which releases it), on
    // every path out of here: a waiter that opened this file sees it is no longer the lock.
    struct lock_holder {
      int dir, fd;
      const std::string& name;
      ~lock_holder() {
        ::unlinkat(dir, name.c_str(), 0);
        ::close(fd);
      }
    } holder{dir_fd(), lock(lock_name, op), lock_name};
    const auto counter_name = name_of('c', key);
    std::int64_t value = 0;
    if (auto raw = read_file(counter_name, key, 8, op)) value = detail::decode_counter(*raw, key, where());
    // Two's-complement wrap-around instead of signed overflow.
    value = static_cast<std::int64_t>(static_cast<std::uint64_t>(value) + static_cast<std::uint64_t>(delta));
    if (delta != 0) write_atomically(counter_name, detail::encode_counter(value), key, op);
    return value;
  }

  /// Removes the values and counters under `prefix` (and their unused lock files and temporary
  /// files).
  std::size_t erase_prefix(std::string_view prefix) {
    detail::check_key(prefix, "store erase_prefix", /*allow_empty=*/true);
    const std::string enc = encode(prefix);
    std::size_t removed = 0;
    for (const auto& name : list_names()) {
      if (name.size() < 3 || name[1] != '.') continue;
      const char kind = name[0];
      if (kind != 'v' && kind != 'c' && kind != 'l' && kind != 't') continue;
      const std::string_view rest = std::string_view(name).substr(2);
      const bool hashed = rest.size() > kept_bytes && rest[kept_bytes] == '~';
      const std::size_t by_name = hashed ? std::min(enc.size(), kept_bytes) : enc.size();
      if (rest.compare(0, by_name, enc, 0, by_name) != 0) continue;
      // A hashed name keeps only the key's start: the whole key is inside the file. A lock file
      // holds no key, but one nobody holds may go whatever its key.
      if (hashed && enc.size() > kept_bytes && kind != 'l') {
        const auto key = stored_key(name);
        if (!key || !key->starts_with(prefix)) continue;
      }
      if (kind == 'l') {
        remove_unused_lock(name);
      } else if (::unlinkat(dir_fd(), name.c_str(), 0) == 0 && (kind == 'v' || kind == 'c')) {
        ++removed;
      }
    }
    return removed;
  }

  /// The store's directory.
  [[nodiscard]] const std::filesystem::path& directory() const noexcept { return dir_; }

 private:
  // Longest encoded key kept whole in a file name; longer ones keep `kept_bytes` and a hash.
  // "t." + 192 + "." + pid + "." + 16 + "." + 16 hex digits stays under 255 bytes.
  static constexpr std::size_t whole_key_bytes = 192;
  static constexpr std::size_t kept_bytes = whole_key_bytes - 17;  // then '~' and 16 hex digits
  static_assert(2 + whole_key_bytes + 1 + 10 + 1 + 16 + 1 + 16 <= 255, "file names over NAME_MAX");

  // The directory, opened once: every file is opened relative to it, so the path is resolved once
  // and a directory renamed or replaced after the checks is never used.
  struct dir_handle {
    int fd;
    explicit dir_handle(int f) noexcept : fd(f) {}
    dir_handle(const dir_handle&) = delete;
    dir_handle& operator=(const dir_handle&) = delete;
    ~dir_handle() { ::close(fd); }
  };

  struct fd_closer {
    int fd;
    ~fd_closer() { ::close(fd); }
  };

  int dir_fd() const noexcept { return fd_->fd; }
  ::mode_t file_mode() const noexcept { return opts_.group_access ? 0660 : 0600; }

  // '/' is a key character but not a file-name one; '%' is neither a key character nor special.
  static std::string encode(std::string_view key) {
    std::string s(key);
    for (char& c : s) {
      if (c == '/') c = '%';
    }
    return s;
  }

  static bool hashed(std::string_view key) noexcept { return key.size() > whole_key_bytes; }

  // The part of a file name after "<kind>.": the encoded key, or its start and hash.
  static std::string stem(std::string_view key) {
    std::string s = encode(key);
    if (!hashed(key)) return s;
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(ddp::detail::fnv1a(key)));
    s.resize(kept_bytes);
    return s + "~" + hex;
  }

  static std::string name_of(char kind, std::string_view key) { return std::string(1, kind) + "." + stem(key); }

  // What a file of a hashed key starts with: the key itself.
  static std::string key_header(std::string_view key) { return hashed(key) ? std::string(key) + "\n" : std::string(); }

  std::string where() const { return "file store " + dir_.string(); }

  communication_error os_error(const std::string& op, const std::string& what) const {
    const int e = errno;
    return communication_error(-1, op, what + ": " + std::strerror(e) + " (" + where() + ")");
  }

  static bool in_my_groups(::gid_t g) {
    if (g == ::getegid()) return true;
    const int n = ::getgroups(0, nullptr);
    if (n <= 0) return false;
    std::vector<::gid_t> groups(static_cast<std::size_t>(n));
    const int got = ::getgroups(n, groups.data());
    return got > 0 && std::find(groups.begin(), groups.begin() + got, g) != groups.begin() + got;
  }

  // Creates the directory if missing, opens it and checks who can use it. Whoever can write to it
  // can plant values (addresses we would connect to) and links; whoever owns it can also read and
  // chmod everything in it.
  int open_directory() const {
    const auto fail = [&](const std::string& what) {
      return communication_error(-1, "file_store", "cannot use directory '" + dir_.string() + "': " + what);
    };
    std::error_code ec;
    if (dir_.has_parent_path()) std::filesystem::create_directories(dir_.parent_path(), ec);
    const ::mode_t dir_mode = opts_.group_access ? 0770 : 0700;
    const bool created = ::mkdir(dir_.c_str(), dir_mode) == 0;
    if (!created && errno != EEXIST) throw fail(std::strerror(errno));
    // A link is followed only if this user or root made it (as the kernel's protected_symlinks
    // does in /tmp), so a link another user planted under the name is refused.
    struct stat ln {};
    const bool link = ::lstat(dir_.c_str(), &ln) == 0 && S_ISLNK(ln.st_mode);
    if (link && ln.st_uid != ::geteuid() && ln.st_uid != 0) {
      throw fail("it is a symbolic link owned by uid " + std::to_string(ln.st_uid) +
                 ", another user; give the directory itself");
    }
    const int fd = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC | (link ? 0 : O_NOFOLLOW));
    if (fd < 0) throw fail(std::strerror(errno));
    fd_closer closer{fd};
    struct stat st {};
    if (::fstat(fd, &st) != 0) throw fail(std::strerror(errno));
    // mkdir's mode went through the umask: set exactly the mode asked for.
    if (created && ::fchmod(fd, dir_mode) == 0) st.st_mode = (st.st_mode & ~::mode_t{07777}) | dir_mode;
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    const std::string what = "refusing directory '" + dir_.string() + "' (owner uid " + std::to_string(st.st_uid) +
                             ", group gid " + std::to_string(st.st_gid) + ", mode " + mode + "): ";
    const bool our_group = opts_.group_access && in_my_groups(st.st_gid);
    if (st.st_uid != ::geteuid() && !our_group) {
      throw communication_error(
          -1, "file_store",
          what + "owned by another user, who could read and replace the job's rendezvous data; " +
              (opts_.group_access ? "with group_access its group must be one of this process's"
                                  : "use a directory of this user (uid " + std::to_string(::geteuid()) + ")"));
    }
    if ((st.st_mode & S_IWOTH) != 0) {
      throw communication_error(-1, "file_store",
                                what + "writable by other users, who could plant values and links in it; chmod o-w it");
    }
    if ((st.st_mode & S_IWGRP) != 0 && !our_group) {
      throw communication_error(-1, "file_store",
                                what + "writable by its group, who could plant values and links in it; chmod g-w it" +
                                    (opts_.group_access ? ", or give it one of this process's groups"
                                                        : ", or set file_store_options::group_access for a job of "
                                                          "several users sharing that group"));
    }
    closer.fd = -1;
    return fd;
  }

  // Opens a file of the store for reading: nothing if it does not exist. Refuses links (the store
  // never makes one: a link would read whatever file it points to) and what is not a regular file
  // (a FIFO would block the open and every read). O_NONBLOCK: opening a FIFO without a writer
  // returns at once (no effect on regular files).
  std::optional<int> open_to_read(const std::string& name, std::string_view key, const std::string& op) const {
    const int fd = ::openat(dir_fd(), name.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
    if (fd < 0) {
      if (errno == ENOENT) return std::nullopt;
      if (errno == ELOOP) {
        throw communication_error(-1, "store get '" + std::string(key) + "'",
                                  "malformed value in " + where() + ": " + name +
                                      " is a symbolic link, which the store never makes; refused");
      }
      throw os_error(op, "cannot open " + name);
    }
    fd_closer closer{fd};
    struct stat st {};
    if (::fstat(fd, &st) != 0) throw os_error(op, "cannot stat " + name);
    if (!S_ISREG(st.st_mode)) {
      throw communication_error(-1, "store get '" + std::string(key) + "'",
                                "malformed value in " + where() + ": " + name + " is not a regular file");
    }
    closer.fd = -1;
    return fd;
  }

  // Reads up to `limit` bytes of an open file; `size` from fstat. A file that shrank meanwhile is
  // returned short (decode reports the truncation).
  std::vector<std::byte> read_fd(int fd, std::size_t size, const std::string& name, const std::string& op) const {
    std::vector<std::byte> buf(size);
    std::size_t got = 0;
    while (got < size) {
      const ssize_t n = ::read(fd, buf.data() + got, size - got);
      if (n < 0) {
        if (errno == EINTR) continue;
        throw os_error(op, "cannot read " + name);
      }
      if (n == 0) break;
      got += static_cast<std::size_t>(n);
    }
    buf.resize(got);
    return buf;
  }

  // The payload of a key's file (frame bytes; after the key line for a hashed key); nothing if the
  // file does not exist. Files larger than any valid one are rejected before reading.
  std::optional<std::vector<std::byte>> read_file(const std::string& name, std::string_view key, std::size_t limit,
                                                  const std::string& op) const {
    const auto fd = open_to_read(name, key, op);
    if (!fd) return std::nullopt;
    fd_closer closer{*fd};
    const auto fail = [&](const std::string& what) {
      return communication_error(-1, "store get '" + std::string(key) + "'",
                                 "malformed value in " + where() + ": " + what);
    };
    struct stat st {};
    if (::fstat(*fd, &st) != 0) throw os_error(op, "cannot stat " + name);
    const std::string header = key_header(key);
    const auto size = static_cast<std::size_t>(st.st_size);
    if (size > header.size() + detail::max_frame_bytes(limit)) {
      throw fail(std::to_string(size) + " bytes on disk, more than the limit of " + std::to_string(limit) +
                 " plus header");
    }
    auto buf = read_fd(*fd, size, name, op);
    if (!header.empty()) {
      const auto nl = std::find(buf.begin(), buf.end(), std::byte{'\n'});
      const std::string_view stored(reinterpret_cast<const char*>(buf.data()),
                                    static_cast<std::size_t>(nl - buf.begin()));
      if (nl == buf.end() || stored != key) {
        throw fail(name + " holds the key '" + std::string(stored.substr(0, 40)) +
                   "...' (another key with the same hash, or a file the store did not write)");
      }
      buf.erase(buf.begin(), nl + 1);
    }
    return buf;
  }

  // The key a hashed file holds (its first line), or nothing if it cannot be read or holds none.
  std::optional<std::string> stored_key(const std::string& name) const {
    try {
      const auto fd = open_to_read(name, name, "store erase_prefix");
      if (!fd) return std::nullopt;
      fd_closer closer{*fd};
      const auto buf = read_fd(*fd, max_key_bytes + 1, name, "store erase_prefix");
      const auto nl = std::find(buf.begin(), buf.end(), std::byte{'\n'});
      if (nl == buf.end()) return std::nullopt;
      std::string key(reinterpret_cast<const char*>(buf.data()), static_cast<std::size_t>(nl - buf.begin()));
      if (!detail::is_valid_key(key)) return std::nullopt;
      return key;
    } catch (const communication_error&) {
      return std::nullopt;  // a link, a FIFO, ...: not a file of ours, left alone
    }
  }

  std::vector<std::string> list_names() const {
    // A fresh open of the directory: readdir on a dup of ours would share (and move) its offset.
    const int fd = ::openat(dir_fd(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) throw os_error("store erase_prefix", "cannot list the directory");
    DIR* d = ::fdopendir(fd);
    if (d == nullptr) {
      const auto err = os_error("store erase_prefix", "cannot list the directory");
      ::close(fd);
      throw err;
    }
    std::vector<std::string> names;
    while (const dirent* e = ::readdir(d)) names.emplace_back(e->d_name);
    ::closedir(d);
    return names;
  }

  // replace false: the target keeps its entry if it has one (set_if_absent).
  void write_atomically(const std::string& target, const std::vector<std::byte>& bytes, std::string_view key,
                        const std::string& op, bool replace = true) const {
    // Unique per process, thread and attempt; O_EXCL catches the improbable collision (and never
    // follows a link).
    char unique[64];
    std::snprintf(unique, sizeof unique, "%ld.%016llx.%016llx", static_cast<long>(::getpid()),
                  static_cast<unsigned long long>(std::hash<std::thread::id>{}(std::this_thread::get_id())),
                  static_cast<unsigned long long>(std::chrono::steady_clock::now().time_since_epoch().count()));
    const std::string temp = "t." + stem(key) + "." + unique;
    const int fd = ::openat(dir_fd(), temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, file_mode());
    if (fd < 0) throw os_error(op, "cannot create " + temp);
    const auto abandon = [&](const std::string& what) {
      const auto err = os_error(op, what);
      ::unlinkat(dir_fd(), temp.c_str(), 0);
      return err;
    };
    // The umask may have taken the group's bits away.
    if (opts_.group_access && ::fchmod(fd, file_mode()) != 0) {
      const auto err = abandon("cannot chmod " + temp);
      ::close(fd);
      throw err;
    }
    const std::string header = key_header(key);
    std::vector<std::byte> all(header.size() + bytes.size());
    std::memcpy(all.data(), header.data(), header.size());
    if (!bytes.empty()) std::memcpy(all.data() + header.size(), bytes.data(), bytes.size());
    std::size_t done = 0;
    while (done < all.size()) {
      const ssize_t n = ::write(fd, all.data() + done, all.size() - done);
      if (n < 0) {
        if (errno == EINTR) continue;
        const auto err = abandon("cannot write " + temp);
        ::close(fd);
        throw err;
      }
      done += static_cast<std::size_t>(n);
    }
    if (::close(fd) != 0) throw abandon("cannot write " + temp);
    if (!replace) {  // linkat fails on any entry with the name (a link included) and never follows it
      const int linked = ::linkat(dir_fd(), temp.c_str(), dir_fd(), target.c_str(), 0);
      const int err = errno;
      ::unlinkat(dir_fd(), temp.c_str(), 0);
      if (linked != 0 && err != EEXIST) {
        errno = err;
        throw os_error(op, "cannot link " + temp + " to " + target);
      }
      return;
    }
    // rename replaces whatever entry has the name, a link included, and never follows it.
    if (::renameat(dir_fd(), temp.c_str(), dir_fd(), target.c_str()) != 0) {
      throw abandon("cannot rename into " + target);
    }
  }

  // True if `fd` is the file the directory entry `name` refers to now.
  bool is_entry(int fd, const std::string& name) const {
    struct stat held {
    }, named{};
    return ::fstat(fd, &held) == 0 && ::fstatat(dir_fd(), name.c_str(), &named, AT_SYMLINK_NOFOLLOW) == 0 &&
           held.st_ino == named.st_ino && held.st_dev == named.st_dev;
  }

  // Opens (creating it if missing) and locks the lock file `name`; returns its descriptor. Polls
  // for the lock rather than blocking in flock: a holder that is stopped (SIGSTOP) or stuck on a
  // dead NFS server must turn into a timeout, not a hang. O_RDWR: NFS emulates flock with fcntl
  // locks, whose exclusive kind needs a writable descriptor.
  int lock(const std::string& name, const std::string& op) const {
    const auto deadline = std::chrono::steady_clock::now() + opts_.lock_timeout;
    detail::backoff pause(std::chrono::milliseconds(2));
    for (;;) {
      int fd = ::openat(dir_fd(), name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, file_mode());
      if (fd >= 0 && opts_.group_access && ::fchmod(fd, file_mode()) != 0) {
        const auto err = os_error(op, "cannot chmod lock file " + name);
        ::unlinkat(dir_fd(), name.c_str(), 0);
        ::close(fd);
        throw err;
      }
      if (fd < 0 && errno == EEXIST) {
        fd = ::openat(dir_fd(), name.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
        if (fd < 0 && errno == ENOENT) continue;  // its holder just removed it: make a new one
      }
      if (fd < 0 && errno == ELOOP) {
        throw communication_error(-1, op,
                                  "lock file " + name + " in " + where() +
                                      " is a symbolic link, which the store never makes; refused (locking it "
                                      "would create or lock a file elsewhere)");
      }
      if (fd < 0) throw os_error(op, "cannot open lock file " + name);
      fd_closer closer{fd};
      struct stat st {};
      if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        throw communication_error(-1, op, "lock file " + name + " in " + where() + " is not a regular file");
      }
      while (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
        if (errno != EWOULDBLOCK && errno != EINTR) throw os_error(op, "cannot lock counter");
        if (std::chrono::steady_clock::now() >= deadline) {
          throw timeout_error(-1, op,
                              "counter lock held by another process for more than " +
                                  std::to_string(opts_.lock_timeout.count()) + " ms (" + where() + ")");
        }
        pause.sleep_until_next(deadline);
      }
      // The previous holder removes the file before releasing it: a lock on a removed file (or on
      // one since replaced under the name) excludes nobody. Try again with the current one.
      if (is_entry(fd, name)) {
        closer.fd = -1;
        return fd;
      }
    }
  }

  // Removes the lock file `name` if nobody holds it (a holder that died left it): taking the lock
  // first keeps a holder's exclusion intact.
  void remove_unused_lock(const std::string& name) const {
    const int fd = ::openat(dir_fd(), name.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
      if (errno == ELOOP) ::unlinkat(dir_fd(), name.c_str(), 0);  // a planted link: the entry goes
      return;
    }
    fd_closer closer{fd};
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0 && is_entry(fd, name)) ::unlinkat(dir_fd(), name.c_str(), 0);
  }

  std::filesystem::path dir_;
  file_store_options opts_;
  std::shared_ptr<const dir_handle> fd_;
};

static_assert(first_write_store<file_store>);

}  // namespace ddp::stores
