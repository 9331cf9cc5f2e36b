// Fuzz target: file_store reading what another process left in its directory
// (stores/file_store.hpp): the input becomes the file of a value (`v.<key>`) and of a counter
// (`c.<key>`), then the store reads them through get and add.
//
// An input starting with one of the bytes below is a directory entry of another kind instead:
//   0xF0  a directory       0xF1  a FIFO (named pipe)       0xF2  a symlink to /dev/zero
//   0xF3  a symlink to itself (ELOOP)                        0xF4  a dangling symlink
//
// Properties: malformed or unreadable entries are communication_errors (never a crash, a hang
// or a read of more than the limit); what decodes round-trips through the encoder.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

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

// One directory per process, on tmpfs when there is one; removed at exit.
const fs::path& directory() {
  static const fs::path dir = [] {
    const fs::path base = fs::is_directory("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
    std::string tmpl = (base / "ddp-fuzz-file-store-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) std::abort();
    std::atexit([] {
      std::error_code ec;
      fs::remove_all(dir, ec);
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
      // The entry exists: a value or an error, except a dangling symlink, which is no value (as
      // for `wait`, which follows links).
      if (size > 0 && data[0] == 0xF4) {
        FUZZ_CHECK(!v.has_value());
        continue;
      }
      FUZZ_CHECK(v.has_value());
      FUZZ_CHECK(fuzz::same_bytes(st::detail::encode_frame(*v), raw));
      FUZZ_CHECK(v->size() <= (s == &small ? small_limit : ddp::default_max_value_bytes));
    } catch (const ddp::communication_error&) {
    }
  }

  make_entry(dir / "c.job%count", data, size);
  try {
    const std::int64_t before = small.add("job/count", 0);
    if (size > 0 && data[0] == 0xF4) {
      FUZZ_CHECK(before == 0);  // no counter yet
    } else {
      FUZZ_CHECK(fuzz::same_bytes(st::detail::encode_counter(before), raw));
    }
    // A counter that reads back can be incremented (two's complement wrap-around).
    const std::int64_t after = small.add("job/count", 1);
    FUZZ_CHECK(static_cast<std::uint64_t>(after) == static_cast<std::uint64_t>(before) + 1);
  } catch (const ddp::communication_error&) {
  }
  return 0;
}
