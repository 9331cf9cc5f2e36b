#pragma once
/// @file stores/redis_store.hpp
/// @brief `redis_store`: a rendezvous store on a Redis server, for jobs spanning nodes without a
/// shared file system. Link `ddp::redis` (hiredis).
///
/// Talks to Redis through hiredis directly rather than through gloo's RedisStore, for three
/// reasons: every command has a timeout (a stopped server is an error, not a hang); a lost
/// connection is re-established on the next call (gloo's store object is dead for good once the
/// server restarts); and counters (INCRBY) and prefix deletion (SCAN + DEL) are available.
/// Values are `v:<key>` strings holding framed bytes (see stores/codec.hpp); counters are
/// `c:<key>` integers (an ACL user restricted to one job needs `~v:<job>/* ~c:<job>/*`). Connects to
/// 127.0.0.1:6379 unless told otherwise.
///
/// Authentication: the password comes from a file only its owner may read, or from the
/// environment, never from an option a program would fill from its command line (visible to
/// every user of the host). Every (re)connection authenticates (AUTH, as an ACL user if one is
/// named) and selects the database. No TLS: hiredis 0.14 has none, and TLS through hiredis_ssl
/// (hiredis 1.x) is not implemented here, so `tls = true` is refused; reach a remote server
/// through a TLS tunnel (stunnel, spiped) listening on loopback.

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include <hiredis/hiredis.h>

#include <ddp/error.hpp>
#include <ddp/store.hpp>
#include <ddp/stores/backoff.hpp>
#include <ddp/stores/codec.hpp>
#include <ddp/stores/sigpipe.hpp>

namespace ddp::stores {

namespace detail {

// What comes back from the server, decoded. Separate from the store so that it can be tested and
// fuzzed without a server (tests/fuzz/redis_reply_fuzz.cpp feeds hiredis's parser arbitrary bytes).

/// Throws communication_error naming the server's message if `r` is an error reply.
inline void throw_if_error_reply(const redisReply& r, const std::string& op, const std::string& where) {
  if (r.type == REDIS_REPLY_ERROR) {
    throw communication_error(-1, op, where + " replied: " + std::string(r.str, r.len));
  }
}

/// Throws communication_error unless `r` is of `type` (REDIS_REPLY_*).
inline void expect_reply(const redisReply& r, int type, const std::string& op, const std::string& where) {
  if (r.type != type) {
    throw communication_error(-1, op, "unexpected reply type " + std::to_string(r.type) + " from " + where);
  }
}

/// The value in the reply to `GET v:<key>`: nothing for nil, else the payload of the frame.
/// @throws communication_error for another reply type or a malformed or oversized frame
[[nodiscard]] inline std::optional<store_value> decode_get_reply(const redisReply& r, std::string_view key,
                                                                 std::size_t limit, const std::string& where) {
  const std::string op = "store get '" + std::string(key) + "'";
  if (r.type == REDIS_REPLY_NIL) return std::nullopt;
  expect_reply(r, REDIS_REPLY_STRING, op, where);
  if (r.len > max_frame_bytes(limit)) {
    throw communication_error(-1, op,
                              "malformed value in " + where + ": " + std::to_string(r.len) +
                                  " bytes, more than the limit of " + std::to_string(limit) + " plus header");
  }
  const auto* p = reinterpret_cast<const std::byte*>(r.str);
  return decode_frame(std::span<const std::byte>(p, r.len), key, limit, where);
}

/// The counter in the reply to `GET c:<key>`: 0 for nil, else the integer it holds, in the
/// canonical decimal form Redis itself requires of a value INCRBY can add to.
/// @throws communication_error for another reply type or text that is not such an integer
[[nodiscard]] inline std::int64_t decode_counter_reply(const redisReply& r, const std::string& op,
                                                       const std::string& where) {
  if (r.type == REDIS_REPLY_NIL) return 0;
  expect_reply(r, REDIS_REPLY_STRING, op, where);
  const auto v = parse_decimal<std::int64_t>(std::string_view(r.str, r.len));
  if (!v) throw communication_error(-1, op, "malformed counter in " + where + ": not an integer");
  return *v;
}

/// One page of `SCAN`: the next cursor ("0" at the end) and the keys found.
struct scan_page {
  std::string cursor;             ///< where the next SCAN starts; "0" when done
  std::vector<std::string> keys;  ///< keys of this page
};

/// The page in the reply to `SCAN <cursor> MATCH [vc]:<prefix>*`: the cursor must be a decimal
/// number and every key a value or counter key (`v:` or `c:`, then a valid key) under `prefix`,
/// so that nothing but the store's own keys under the prefix is ever deleted.
/// @throws communication_error for anything else
[[nodiscard]] inline scan_page decode_scan_reply(const redisReply& r, std::string_view prefix,
                                                 const std::string& where) {
  const auto fail = [&](const std::string& what) {
    return communication_error(-1, "store erase_prefix", "unexpected SCAN reply from " + where + ": " + what);
  };
  expect_reply(r, REDIS_REPLY_ARRAY, "store erase_prefix", where);
  if (r.elements != 2 || r.element[0]->type != REDIS_REPLY_STRING || r.element[1]->type != REDIS_REPLY_ARRAY) {
    throw fail("not a [cursor, keys] pair");
  }
  scan_page page;
  page.cursor.assign(r.element[0]->str, r.element[0]->len);
  if (!parse_decimal<std::uint64_t>(page.cursor)) throw fail("the cursor is not a decimal number");
  const redisReply& found = *r.element[1];
  page.keys.reserve(found.elements);
  for (std::size_t i = 0; i < found.elements; ++i) {
    const redisReply& k = *found.element[i];
    if (k.type != REDIS_REPLY_STRING) throw fail("a key that is not a string");
    std::string_view key(k.str, k.len);
    if (key.size() < 2 || (key[0] != 'v' && key[0] != 'c') || key[1] != ':' || !is_valid_key(key.substr(2)) ||
        !key.substr(2).starts_with(prefix)) {
      throw fail("a key that is not the store's under '" + std::string(prefix) + "'");
    }
    page.keys.emplace_back(key);
  }
  return page;
}

/// Most array elements one reply may announce, over all its (nested) arrays. hiredis allocates
/// an array's element vector from the count in its header, before the elements arrive: without
/// a cap, 13 bytes from a broken or hostile server ("*2000000000\r\n") cost 16 GB. A SCAN page
/// (COUNT 1000) is far below.
inline constexpr std::size_t max_reply_elements = std::size_t{1} << 20;

/// hiredis's createArray wrapped to enforce max_reply_elements (`Fn` is the type of
/// redisReplyObjectFunctions::createArray: its count is an int in 0.14, a size_t in 1.x).
template <class Fn>
struct capped_array_factory;

/// @copydoc capped_array_factory
template <class Task, class Count>
struct capped_array_factory<void* (*)(const Task*, Count)> {
  /// hiredis's own createArray.
  static inline void* (*base)(const Task*, Count) = nullptr;
  /// Refuses (nullptr: hiredis reports out of memory) once the reply's arrays announce more
  /// than max_reply_elements elements in all.
  static void* create(const Task* task, Count elements) {
    // Elements announced so far by the arrays of the reply being parsed (one parse at a time per
    // thread; the outermost array starts a new reply).
    thread_local std::size_t announced = 0;
    if constexpr (std::is_signed_v<Count>) {
      if (elements < 0) return nullptr;
    }
    if (task->parent == nullptr) announced = 0;
    const auto n = static_cast<unsigned long long>(elements);
    if (n > max_reply_elements - announced) return nullptr;
    announced += static_cast<std::size_t>(n);
    return base(task, elements);
  }
};

/// Makes `reader` refuse (as out of memory: the command fails, the connection is dropped) a
/// reply whose arrays announce more than max_reply_elements elements in all.
inline void cap_reply_arrays(redisReader& reader) {
  using capped = capped_array_factory<decltype(redisReplyObjectFunctions::createArray)>;
  // One table for every reader: hiredis's default functions with createArray wrapped.
  static redisReplyObjectFunctions* const table = [&reader]() -> redisReplyObjectFunctions* {
    if (reader.fn == nullptr) return nullptr;
    static redisReplyObjectFunctions t = *reader.fn;
    capped::base = t.createArray;
    t.createArray = &capped::create;
    return &t;
  }();
  if (table != nullptr && reader.fn != nullptr && reader.fn->createArray == capped::base) reader.fn = table;
}

/// Largest password file read: a password is one line, anything larger is the wrong file.
inline constexpr std::size_t max_password_file_bytes = 64 * 1024;

/// The password in the file at `path`: its one line, without the final newline. Like ssh with a
/// private key (and job_secret::from_file), refuses a file group or others may access (they would
/// hold the password too) or that another user owns.
/// @throws usage_error naming the file and what is wrong with it, never its content
[[nodiscard]] inline std::string read_password_file(const std::filesystem::path& path, const std::string& op) {
  const auto fail = [&](const std::string& what) {
    return usage_error(-1, op, "password file '" + path.string() + "' " + what);
  };
  const auto errno_text = [](int e) { return std::generic_category().message(e); };
  // O_NONBLOCK: a FIFO put in its place must not block the open. The checks are fstat's, on the
  // file opened, so the file read is the file checked.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) throw fail("cannot be opened: " + errno_text(errno));
  struct fd_closer {
    int fd;
    ~fd_closer() { ::close(fd); }
  } const closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw fail("cannot be examined: " + errno_text(errno));
  if (!S_ISREG(st.st_mode)) throw fail("is not a regular file");
  if (st.st_uid != ::geteuid()) {  // its owner could change the password under us (as job_secret::from_file)
    throw fail("belongs to uid " + std::to_string(st.st_uid) + ", not to this user (uid " +
               std::to_string(::geteuid()) + ")");
  }
  if ((st.st_mode & 077) != 0) {
    char mode[8] = {};
    (void)std::to_chars(mode, mode + sizeof(mode) - 1, st.st_mode & 07777, 8);
    throw fail("may be accessed by group or others (mode 0" + std::string(mode) +
               "): they could read the password; make it 0600 or 0400 (chmod 600)");
  }
  if (static_cast<std::uint64_t>(st.st_size) > max_password_file_bytes) {
    throw fail("is larger than " + std::to_string(max_password_file_bytes) + " bytes: not a password file");
  }
  std::string text(max_password_file_bytes + 1, '\0');
  std::size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw fail("cannot be read: " + errno_text(errno));
    if (n == 0) break;
    got += static_cast<std::size_t>(n);
  }
  if (got > max_password_file_bytes) throw fail("grew past " + std::to_string(max_password_file_bytes) + " bytes");
  text.resize(got);
  if (text.ends_with('\n')) text.pop_back();
  if (text.ends_with('\r')) text.pop_back();
  if (text.empty()) throw fail("is empty");
  if (text.find_first_of(std::string_view("\r\n\0", 3)) != std::string::npos) {
    throw fail("holds more than one line (or a NUL byte): a password is one line, a final newline is fine");
  }
  return text;
}

}  // namespace detail

/// Where the Redis server is and how long to wait for it.
struct redis_options {
  std::string host = "127.0.0.1";                         ///< loopback unless an address is given
  int port = 6379;                                        ///< server port
  std::chrono::milliseconds connect_timeout{2000};        ///< one connection attempt
  std::chrono::milliseconds command_timeout{5000};        ///< one command's round trip
  std::chrono::milliseconds poll_interval{5};             ///< longest sleep between checks in `wait`
  std::size_t max_value_bytes = default_max_value_bytes;  ///< larger values are rejected both ways
  /// ACL user to authenticate as (Redis 6+); empty: the one in `$<username_env>`, if any, else
  /// the default user. Needs a password.
  std::string username{};
  /// Environment variable read for the ACL user when `username` is empty; empty: none.
  std::string username_env = "DDP_REDIS_USERNAME";
  /// File holding the password: one line, in a regular file of this user's no one else may access (0600 or
  /// 0400, as ssh requires of a private key); read once, by the constructor. Wins over
  /// `password_env`. There is deliberately no option holding the password itself: programs fill
  /// options from their command line, which every user of the host can read (ps, /proc).
  std::filesystem::path password_file{};
  /// Environment variable read for the password when `password_file` is empty (unset or empty:
  /// no password); empty: none.
  std::string password_env = "DDP_REDIS_PASSWORD";
  /// Database number (SELECT), on every connection; the server's `databases` setting bounds it.
  int database = 0;
  /// TLS to the server. Not available in this store (see the file comment): true is a
  /// usage_error pointing at a TLS tunnel, rather than a silently plaintext connection.
  bool tls = false;
};

/// A store on a Redis server. Move-only; thread-safe (one connection, used under a lock).
class redis_store {
 public:
  /// Reads the credentials, then connects, authenticates and selects the database at once, so
  /// that a wrong address or password fails here.
  /// @throws usage_error for unusable options (a password file others may read, TLS, ...)
  /// @throws communication_error if the server cannot be reached or refuses the credentials
  explicit redis_store(redis_options opts = {}) : opts_(std::move(opts)), m_(std::make_unique<std::mutex>()) {
    configure("redis_store");
    std::lock_guard lk(*m_);
    connect("redis_store");
  }

  /// Replaces the value of `key` (one SET: atomic).
  void set(std::string_view key, std::span<const std::byte> value) {
    detail::check_key(key, "store set");
    detail::check_value_size(key, value.size(), opts_.max_value_bytes);
    const std::string k = "v:" + std::string(key);
    const auto framed = detail::encode_frame(value);
    reply r = command("store set '" + std::string(key) + "'",
                      {"SET", k, std::string_view(reinterpret_cast<const char*>(framed.data()), framed.size())});
    expect(r, REDIS_REPLY_STATUS, "store set '" + std::string(key) + "'");
  }

  /// Stores `value` under `key` unless it has a value (SETNX); returns the value it holds
  /// (`first_write_store`). A value, once set, is only ever replaced by `set`, which the callers
  /// of this never use on the same key.
  store_value set_if_absent(std::string_view key, std::span<const std::byte> value) {
    detail::check_key(key, "store set_if_absent");
    detail::check_value_size(key, value.size(), opts_.max_value_bytes);
    const std::string op = "store set_if_absent '" + std::string(key) + "'";
    const auto framed = detail::encode_frame(value);
    reply r = command(op, {"SETNX", "v:" + std::string(key),
                           std::string_view(reinterpret_cast<const char*>(framed.data()), framed.size())});
    expect(r, REDIS_REPLY_INTEGER, op);
    if (r->integer == 1) return store_value(value.begin(), value.end());
    auto held = get(key);
    if (!held) throw communication_error(-1, op, "the key was removed while it was being read (" + where() + ")");
    return std::move(*held);
  }

  /// The value of `key`, or nothing. @throws communication_error for a malformed value
  [[nodiscard]] std::optional<store_value> get(std::string_view key) {
    detail::check_key(key, "store get");
    const std::string op = "store get '" + std::string(key) + "'";
    reply r = command(op, {"GET", "v:" + std::string(key)});
    return detail::decode_get_reply(*r, key, opts_.max_value_bytes, where());
  }

  /// Returns once every key is set (polls EXISTS). @throws timeout_error naming the missing keys
  void wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) {
    for (const auto& k : keys) detail::check_key(k, "store wait");
    // EXISTS counts every existing argument: one round trip checks all keys, once duplicates
    // are gone (a duplicate would be counted twice).
    std::vector<std::string> unique(keys.begin(), keys.end());
    std::sort(unique.begin(), unique.end());
    unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
    if (unique.empty()) return;
    std::vector<std::string> args{"EXISTS"};
    for (const auto& k : unique) args.push_back("v:" + k);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    detail::backoff pause(opts_.poll_interval);
    for (;;) {
      reply r = command("store wait", to_views(args));
      expect(r, REDIS_REPLY_INTEGER, "store wait");
      if (r->integer >= static_cast<long long>(unique.size())) return;
      if (std::chrono::steady_clock::now() >= deadline) {
        throw timeout_error(-1, "store wait",
                            "keys not set within " + std::to_string(timeout.count()) +
                                " ms: " + detail::list_keys(missing(unique)) + " (" + where() + ")");
      }
      pause.sleep_until_next(deadline);
    }
  }

  /// Adds `delta` to the counter `key` (INCRBY); returns the new value.
  std::int64_t add(std::string_view key, std::int64_t delta) {
    detail::check_key(key, "store add");
    const std::string op = "store add '" + std::string(key) + "'";
    if (delta == 0) return read_counter(key, op);  // INCRBY 0 would create the key
    reply r = command(op, {"INCRBY", "c:" + std::string(key), std::to_string(delta)});
    expect(r, REDIS_REPLY_INTEGER, op);
    return static_cast<std::int64_t>(r->integer);
  }

  /// Removes the values and counters under `prefix` (SCAN + DEL; not atomic as a whole).
  /// @throws usage_error for an empty prefix: on a shared server it would erase other jobs' keys
  std::size_t erase_prefix(std::string_view prefix) {
    if (prefix.empty()) {
      throw usage_error(-1, "store erase_prefix",
                        "refusing an empty prefix: it would erase every ddp key on " + where() +
                            ", other jobs' too where the server is shared; name the job's prefix "
                            "(through a prefix_store, erase_prefix(\"\") erases the view only)");
    }
    detail::check_key(prefix, "store erase_prefix");
    // Keys are restricted to characters that are not glob syntax, so the pattern needs no escaping.
    const std::string pattern = "[vc]:" + std::string(prefix) + "*";
    std::string cursor = "0";
    std::size_t removed = 0;
    do {
      reply r = command("store erase_prefix", {"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"});
      detail::scan_page page = detail::decode_scan_reply(*r, prefix, where());
      cursor = std::move(page.cursor);
      if (!page.keys.empty()) {
        std::vector<std::string> del{"DEL"};
        for (auto& k : page.keys) del.push_back(std::move(k));
        reply d = command("store erase_prefix", to_views(del));
        expect(d, REDIS_REPLY_INTEGER, "store erase_prefix");
        removed += static_cast<std::size_t>(std::max<long long>(d->integer, 0));
      }
    } while (cursor != "0");
    return removed;
  }

  /// Where the server is and the limits in use.
  [[nodiscard]] const redis_options& options() const noexcept { return opts_; }

 private:
  struct context_deleter {
    void operator()(redisContext* c) const noexcept { redisFree(c); }
  };
  struct reply_deleter {
    void operator()(redisReply* r) const noexcept { freeReplyObject(r); }
  };
  using reply = std::unique_ptr<redisReply, reply_deleter>;

  static timeval to_timeval(std::chrono::milliseconds ms) {
    timeval tv{};
    tv.tv_sec = static_cast<decltype(tv.tv_sec)>(ms.count() / 1000);
    tv.tv_usec = static_cast<decltype(tv.tv_usec)>((ms.count() % 1000) * 1000);
    return tv;
  }

  std::string where() const { return "redis " + opts_.host + ":" + std::to_string(opts_.port); }

  std::string user() const { return username_.empty() ? "the default user" : "user '" + username_ + "'"; }

  // Checks the options and reads the credentials, once: a password file removed after the start
  // does not break reconnections, and getenv runs before any thread of ours could race a setenv.
  void configure(const std::string& op) {
    if (opts_.tls) {
      throw usage_error(-1, op,
                        "TLS was requested for " + where() + ", but redis_store has no TLS (hiredis " +
                            std::to_string(HIREDIS_MAJOR) + "." + std::to_string(HIREDIS_MINOR) + "." +
                            std::to_string(HIREDIS_PATCH) +
                            " here; hiredis_ssl is not used): reach the server through a TLS tunnel (stunnel "
                            "or spiped) listening on loopback, point host and port at it, and leave tls false");
    }
    if (opts_.database < 0) {
      throw usage_error(-1, op,
                        "database " + std::to_string(opts_.database) + " for " + where() +
                            " is negative: Redis numbers its databases from 0");
    }
    const auto from_env = [](const std::string& name) -> std::string {
      const char* v = name.empty() ? nullptr : std::getenv(name.c_str());
      return v != nullptr ? std::string(v) : std::string();
    };
    username_ = !opts_.username.empty() ? opts_.username : from_env(opts_.username_env);
    if (!opts_.password_file.empty()) {
      password_ = detail::read_password_file(opts_.password_file, op);
      password_source_ = "password file '" + opts_.password_file.string() + "'";
    } else if (password_ = from_env(opts_.password_env); !password_.empty()) {
      password_source_ = "$" + opts_.password_env;
    }
    if (!username_.empty() && password_.empty()) {
      throw usage_error(-1, op, "ACL user '" + username_ + "' for " + where() + " has no password: " + password_hint());
    }
  }

  std::string password_hint() const {
    return "name a file holding it in redis_options::password_file (mode 0600)" +
           (opts_.password_env.empty() ? std::string() : ", or set $" + opts_.password_env);
  }

  // The server's error reply to a step of the handshake, explained. Never the password: the
  // server does not echo it, and a reply that contains it anyway is not shown.
  [[noreturn]] void refused(const std::string& op, const std::string& step, const redisReply& r) const {
    std::string said(r.str, r.len);
    if (!password_.empty() && said.find(password_) != std::string::npos)
      said = "(reply not shown: it holds the password)";
    if (said.starts_with("NOAUTH")) {
      throw communication_error(
          -1, op, where() + " requires a password, and none was given (" + said + "): " + password_hint());
    }
    if (said.starts_with("WRONGPASS")) {
      throw communication_error(
          -1, op, where() + " refused " + user() + " with the password from " + password_source_ + " (" + said + ")");
    }
    throw communication_error(-1, op, where() + " refused " + step + " (" + said + ")");
  }

  // Caller holds the lock; the connection is new. A restarted server remembers neither AUTH nor
  // SELECT, so both are sent on every connection. With neither, a PING makes a server that wants
  // a password say so here rather than at the first command.
  void handshake(const std::string& op) {
    if (!password_.empty()) {
      std::vector<std::string_view> auth{"AUTH"};
      if (!username_.empty()) auth.emplace_back(username_);
      auth.emplace_back(password_);
      if (reply r = send(op, auth); r->type == REDIS_REPLY_ERROR) {
        refused(op, "AUTH as " + user() + " with the password from " + password_source_, *r);
      }
    }
    if (opts_.database != 0) {
      const std::string db = std::to_string(opts_.database);
      if (reply r = send(op, {"SELECT", db}); r->type == REDIS_REPLY_ERROR) refused(op, "database " + db, *r);
    }
    if (password_.empty() && opts_.database == 0) {
      if (reply r = send(op, {"PING"}); r->type == REDIS_REPLY_ERROR) refused(op, "PING", *r);
    }
  }

  // Caller holds the lock.
  void connect(const std::string& op) {
    ctx_.reset(redisConnectWithTimeout(opts_.host.c_str(), opts_.port, to_timeval(opts_.connect_timeout)));
    if (!ctx_) throw communication_error(-1, op, "cannot allocate a connection to " + where());
    if (ctx_->err) {
      const std::string why = ctx_->errstr;
      ctx_.reset();
      throw communication_error(-1, op, "cannot connect to " + where() + ": " + why);
    }
    detail::cap_reply_arrays(*ctx_->reader);
    if (redisSetTimeout(ctx_.get(), to_timeval(opts_.command_timeout)) != REDIS_OK) {
      ctx_.reset();
      throw communication_error(-1, op, "cannot set the command timeout on the connection to " + where());
    }
    try {
      handshake(op);
    } catch (...) {
      ctx_.reset();  // not authenticated: the next command starts over
      throw;
    }
  }

  static std::vector<std::string_view> to_views(const std::vector<std::string>& args) {
    return {args.begin(), args.end()};
  }

  // One command, binary safe. A broken connection is dropped and re-made (and authenticated
  // again) by the next command, so a restarted server is usable again; the failing command itself
  // throws.
  reply command(const std::string& op, std::vector<std::string_view> args) {
    std::lock_guard lk(*m_);
    if (!ctx_) connect(op);
    reply r = send(op, args);
    detail::throw_if_error_reply(*r, op, where());
    return r;
  }

  // One command on the open connection; error replies are returned. A lost connection is
  // dropped and thrown. Caller holds the lock. Errors never show `args` (AUTH holds the password).
  reply send(const std::string& op, const std::vector<std::string_view>& args) {
    std::vector<const char*> argv;
    std::vector<std::size_t> argl;
    for (auto a : args) {
      argv.push_back(a.data());
      argl.push_back(a.size());
    }
    const sigpipe_guard no_sigpipe;  // hiredis writes with write(2): a dead server must not kill us
    auto* raw =
        static_cast<redisReply*>(redisCommandArgv(ctx_.get(), static_cast<int>(argv.size()), argv.data(), argl.data()));
    if (raw == nullptr) {
      std::string why = ctx_->errstr[0] ? ctx_->errstr : "connection lost";
      if (ctx_->err == REDIS_ERR_OOM) {
        why += " (or a reply announcing more than " + std::to_string(detail::max_reply_elements) + " array elements)";
      }
      ctx_.reset();
      throw communication_error(-1, op, where() + ": " + why);
    }
    return reply(raw);
  }

  void expect(const reply& r, int type, const std::string& op) const { detail::expect_reply(*r, type, op, where()); }

  // A counter's value without creating it; validated like anything read back.
  std::int64_t read_counter(std::string_view key, const std::string& op) {
    reply r = command(op, {"GET", "c:" + std::string(key)});
    return detail::decode_counter_reply(*r, op, where());
  }

  // For the error message of a timed-out wait.
  std::vector<std::string> missing(std::span<const std::string> keys) {
    std::vector<std::string> out;
    for (const auto& k : keys) {
      reply r = command("store wait", {"EXISTS", "v:" + k});
      expect(r, REDIS_REPLY_INTEGER, "store wait");
      if (r->integer == 0) out.push_back(k);
    }
    return out;
  }

  redis_options opts_;
  std::string username_;           // resolved from the options or the environment; empty: default
  std::string password_;           // empty: no AUTH. Never in a message
  std::string password_source_;    // where the password came from, for messages
  std::unique_ptr<std::mutex> m_;  // in a box so the store can move
  std::unique_ptr<redisContext, context_deleter> ctx_;
};

static_assert(first_write_store<redis_store>);

}  // namespace ddp::stores
