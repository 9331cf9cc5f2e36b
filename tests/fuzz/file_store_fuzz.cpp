// Fuzz target: file_store reading what another process left in its directory
// (stores/file_store.hpp): the input becomes the file of a value (`v.<key>`) and of a counter
// (`c.<key>`), then the store reads them through get and add; and the file of a 256-byte key's
// value (a hashed name; the file starts with the key and a newline, `long_key` below).
//
// An input starting with one of the bytes below is a directory entry of another kind instead:
//   0xF0  a directory       0xF1  a FIFO (named pipe)       0xF2  a symlink to /dev/zero
//   0xF3  a symlink to itself (ELOOP)                        0xF4  a dangling symlink
//
// Properties: malformed or unreadable entries and every symlink (never followed) are
// communication_errors (never a crash, a hang or a read of more than the limit); what decodes
// round-trips through the encoder.

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>

#include <ddp/error.hpp>
#include <ddp/stores/codec.hpp>
#include <ddp/stores/file_store.hpp>

#include "fuzz_check.hpp"

namespace fs = std::filesystem;
namespace st = ddp::stores;
using namespace std::chrono_literals;

namespace {

constexpr std::size_t small_limit = 100;

// The longest key; tests/fuzz/make_corpus.cpp writes a seed for it.
const std::string long_key = "job/" + std::string(ddp::max_key_bytes - 4, 'k');

bool is_link(const std::uint8_t* data, std::size_t size) { return size > 0 && data[0] >= 0xF2 && data[0] <= 0xF4; }

// The name of `key`'s value file, as the store made it.
const fs::path& long_value_path(st::file_store& s) {
  static const fs::path p = [&] {
    s.set(long_key, {});
    for (const auto& e : fs::directory_iterator(s.directory())) {
      if (e.path().filename().string().find('~') != std::string::npos) return e.path();
    }
    std::abort();
  }();
  return p;
}

// One directory per process, on tmpfs when there is one; removed at exit. libFuzzer ends a run
// that crashed or timed out with _Exit, so each directory carries its process id and the next
// run removes those whose process is gone.
const fs::path& directory() {
  static const fs::path dir = [] {
    const fs::path base = fs::is_directory("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
    const std::string prefix = "ddp-fuzz-file-store-";
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(base, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind(prefix, 0) != 0) continue;
      const long pid = std::strtol(name.c_str() + prefix.size(), nullptr, 10);
      if (pid <= 0 || (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH)) fs::remove_all(e.path(), ec);
    }
    std::string tmpl = (base / (prefix + std::to_string(::getpid()) + "-XXXXXX")).string();
    if (::mkdtemp(tmpl.data()) == nullptr) std::abort();
    std::atexit([] {
      std::error_code ec2;
      fs::remove_all(dir, ec2);
    });
    return fs::path(tmpl);
  }();
  return dir;
}

void clear(const fs::path& p) {
  std::error_code ec;
  fs::remove_all(p, ec);
}

// Puts the entry the input describes at `p`.
void make_entry(const fs::path& p, const std::uint8_t* data, std::size_t size) {
  clear(p);
  if (size > 0) {
    switch (data[0]) {
      case 0xF0: fs::create_directory(p); return;
      case 0xF1: ::mkfifo(p.c_str(), 0644); return;
      case 0xF2: fs::create_symlink("/dev/zero", p); return;
      case 0xF3: fs::create_symlink(p, p); return;
      case 0xF4: fs::create_symlink(p.string() + ".missing", p); return;
      default: break;
    }
  }
  const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) std::abort();
  for (std::size_t done = 0; done < size;) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n <= 0) std::abort();
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const fs::path& dir = directory();
  // Counters' lock timeout short: nothing else holds the lock here.
  static st::file_store small(dir, {.max_value_bytes = small_limit, .lock_timeout = 2000ms});
  static st::file_store large(dir, {.lock_timeout = 2000ms});
  const auto raw = fuzz::bytes(data, size);

  make_entry(dir / "v.job%key", data, size);
  for (st::file_store* s : {&small, &large}) {
    try {
      const std::optional<ddp::store_value> v = s->get("job/key");
      FUZZ_CHECK(!is_link(data, size));  // a link is refused
      FUZZ_CHECK(v.has_value());         // the entry exists: a value or an error
      FUZZ_CHECK(fuzz::same_bytes(st::detail::encode_frame(*v), raw));
      FUZZ_CHECK(v->size() <= (s == &small ? small_limit : ddp::default_max_value_bytes));
    } catch (const ddp::communication_error&) {
    }
  }

  make_entry(dir / "c.job%count", data, size);
  try {
    const std::int64_t before = small.add("job/count", 0);
    FUZZ_CHECK(!is_link(data, size));
    FUZZ_CHECK(fuzz::same_bytes(st::detail::encode_counter(before), raw));
    // A counter that reads back can be incremented (two's complement wrap-around).
    const std::int64_t after = small.add("job/count", 1);
    FUZZ_CHECK(static_cast<std::uint64_t>(after) == static_cast<std::uint64_t>(before) + 1);
  } catch (const ddp::communication_error&) {
  }

  // A hashed name: only "<long_key>\n" followed by a valid frame decodes.
  const fs::path& long_path = long_value_path(large);
  make_entry(long_path, data, size);
  try {
    const std::optional<ddp::store_value> v = large.get(long_key);
    FUZZ_CHECK(!is_link(data, size));
    FUZZ_CHECK(v.has_value());
    auto expected = ddp::store_value(reinterpret_cast<const std::byte*>(long_key.data()),
                                     reinterpret_cast<const std::byte*>(long_key.data() + long_key.size()));
    expected.push_back(std::byte{'\n'});
    const auto frame = st::detail::encode_frame(*v);
    expected.insert(expected.end(), frame.begin(), frame.end());
    FUZZ_CHECK(fuzz::same_bytes(expected, raw));
  } catch (const ddp::communication_error&) {
  }
  return 0;
}
