#pragma once
/// @file job_secret.hpp
/// @brief `ddp::job_secret`: the secret every process of one job holds, with which peers prove
/// they belong to the job before any data moves (gloo pairs: gloo/authenticate.hpp). Where it
/// comes from and what it protects: docs/security.md.

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ddp/error.hpp>

namespace ddp {

/// A job's shared secret (its bytes; empty = none). The bytes are wiped when an object dies.
class job_secret {
 public:
  /// Shortest secret accepted, in bytes of randomness: a guessable one would prove nothing (one
  /// observed exchange lets anyone test guesses offline).
  static constexpr std::size_t min_bytes = 32;
  /// The environment variable `from_environment()` reads; `scripts/ddp-run` sets it.
  static constexpr const char* default_variable = "DDP_JOB_SECRET";

  /// No secret: peers are not authenticated.
  job_secret() = default;
  /// Takes `other`'s bytes; `other` is left empty.
  job_secret(job_secret&& other) noexcept : bytes_(std::move(other.bytes_)) { other.bytes_.clear(); }
  /// Wipes this secret, then takes `other`'s bytes; `other` is left empty.
  job_secret& operator=(job_secret&& other) noexcept {
    if (this != &other) {
      wipe();
      bytes_ = std::move(other.bytes_);
      other.bytes_.clear();
    }
    return *this;
  }
  /// A copy of `other`'s bytes.
  job_secret(const job_secret& other) : bytes_(other.bytes_) {}
  /// Wipes this secret, then copies `other`'s bytes.
  job_secret& operator=(const job_secret& other) {
    if (this != &other) {
      wipe();
      bytes_ = other.bytes_;
    }
    return *this;
  }
  /// Wipes the bytes.
  ~job_secret() { wipe(); }

  /// How to make a secret, for error messages.
  static constexpr const char* how_to_make =
      "make one with `openssl rand -hex 32` (or job_secret::generate()); scripts/ddp-run sets a fresh one for "
      "every job";

  /// The secret `text`: at least `min_bytes` random bytes. Text (valid UTF-8 without control
  /// characters) must be 64 or more hex digits that look random: a passphrase is refused, however
  /// long; other bytes (a key file) must not be mostly one value (`weakness`).
  /// @throws usage_error saying what is wrong and how to make a good one
  [[nodiscard]] static job_secret of(std::string_view text) {
    if (const char* problem = weakness(text)) {
      throw usage_error(-1, "job secret", std::string(problem) + "; " + how_to_make);
    }
    job_secret s;
    s.bytes_.resize(text.size());
    std::memcpy(s.bytes_.data(), text.data(), text.size());
    return s;
  }

  /// The secret in environment variable `name`, or none if it is unset or empty.
  /// @throws usage_error if it is set but is no secret (`of`)
  [[nodiscard]] static job_secret from_environment(const char* name = default_variable) {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') return {};
    try {
      return of(v);
    } catch (const usage_error& e) {
      throw usage_error(-1, "job secret", "environment variable " + std::string(name) + ": " + e.message());
    }
  }

  /// The secret in file `path` (one trailing newline, LF or CRLF, dropped). The file must be a regular file of
  /// this user's that nobody else can read or write, as ssh demands of keys.
  /// @throws usage_error naming the file and what is wrong with it
  [[nodiscard]] static job_secret from_file(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) throw usage_error(-1, "job secret", "cannot open '" + path + "': " + std::strerror(errno));
    struct fd_closer {
      int fd;
      ~fd_closer() { ::close(fd); }
    } closer{fd};
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      throw usage_error(-1, "job secret", "'" + path + "' is not a regular file");
    }
    if (st.st_uid != ::geteuid()) {
      throw usage_error(-1, "job secret",
                        "'" + path + "' belongs to uid " + std::to_string(st.st_uid) + ", not to this user (uid " +
                            std::to_string(::geteuid()) + ")");
    }
    if ((st.st_mode & 077) != 0) {
      throw usage_error(-1, "job secret",
                        "'" + path + "' can be read or written by group or others (mode " + octal(st.st_mode & 0777) +
                            "); chmod 600 it");
    }
    std::string text(4096, '\0');
    std::size_t got = 0;
    while (got < text.size()) {
      const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw usage_error(-1, "job secret", "reading '" + path + "': " + std::strerror(errno));
      if (n == 0) break;
      got += static_cast<std::size_t>(n);
    }
    text.resize(got);
    if (!text.empty() && text.back() == '\n') text.pop_back();
    if (!text.empty() && text.back() == '\r') text.pop_back();  // a file written with CRLF
    try {
      auto s = of(text);
      std::memset(text.data(), 0, text.size());
      return s;
    } catch (const usage_error& e) {
      throw usage_error(-1, "job secret", "'" + path + "': " + e.message());
    }
  }

  /// A fresh random secret (32 bytes from the kernel, as 64 hex digits: fit for an environment
  /// variable). @throws communication_error if the kernel gives no randomness
  [[nodiscard]] static job_secret generate() { return of(random_hex(32)); }

  /// Fills `out` with random bytes from the kernel. @throws communication_error if it gives none
  static void fill_random(std::span<std::byte> out) {
    std::size_t got = 0;
    while (got < out.size()) {
      const ssize_t r = ::getrandom(out.data() + got, out.size() - got, 0);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) throw communication_error(-1, "job secret", std::string("getrandom: ") + std::strerror(errno));
      got += static_cast<std::size_t>(r);
    }
  }

  /// `n` random bytes from the kernel as 2n hex digits.
  [[nodiscard]] static std::string random_hex(std::size_t n) {
    std::vector<std::byte> raw(n);
    fill_random(raw);
    static constexpr char digits[] = "0123456789abcdef";
    std::string out;
    for (std::byte b : raw) {
      const auto c = static_cast<unsigned>(b);
      out += digits[c >> 4];
      out += digits[c & 15];
    }
    return out;
  }

  /// Why `text` is no secret (a sentence), or nullptr when it is one (see `of`).
  [[nodiscard]] static const char* weakness(std::string_view text) noexcept {
    if (text.size() < min_bytes) return "a job secret needs at least 32 random bytes (64 hex digits)";
    if (!is_text(text)) {  // bytes (a key file): at least 32, and not mostly one value
      return looks_random(text, 4.0) ? nullptr : "the job secret's bytes do not look random (too few distinct values)";
    }
    if (text.find_first_not_of("0123456789abcdefABCDEF") != std::string_view::npos) {
      return "a job secret written as text must be 64 or more hex digits of random bytes, not a passphrase or other "
             "text";
    }
    if (text.size() < 2 * min_bytes) return "a hex job secret needs at least 64 digits (32 bytes)";
    if (!looks_random(text, 3.0) || repeats(text, 8)) {
      return "the hex job secret does not look random (too few distinct digits, or a repeated pattern)";
    }
    return nullptr;
  }

  /// Whether `bytes` read as text: valid UTF-8 without control characters (a passphrase in any
  /// language), as opposed to a key's raw bytes.
  [[nodiscard]] static bool is_text(std::string_view bytes) noexcept {
    for (std::size_t i = 0; i < bytes.size();) {
      const auto c = static_cast<unsigned char>(bytes[i]);
      if (c < 0x20 || c == 0x7f) return false;
      const std::size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
      if (n == 0 || i + n > bytes.size()) return false;
      for (std::size_t k = 1; k < n; ++k) {
        if ((static_cast<unsigned char>(bytes[i + k]) >> 6) != 2) return false;
      }
      i += n;
    }
    return true;
  }

  /// Whether some run of `n` characters occurs twice in `text` ("deadbeef" eight times): about
  /// 4e-7 for 64 random hex digits and n = 8.
  [[nodiscard]] static bool repeats(std::string_view text, std::size_t n) noexcept {
    for (std::size_t i = 0; i + n <= text.size(); ++i) {
      if (text.find(text.substr(i, n), i + 1) != std::string_view::npos) return true;
    }
    return false;
  }

  /// Whether the characters of `text` carry at least `bits` bits each by their frequencies (the
  /// empirical Shannon entropy): random hex has about 3.7 in 64 digits, random base64 about 5 in
  /// 43 characters; "aaaa..." or a word repeated has much less. A screen for mistakes, not proof
  /// of randomness.
  [[nodiscard]] static bool looks_random(std::string_view text, double bits) noexcept {
    std::array<std::size_t, 256> count{};
    for (char c : text) ++count[static_cast<unsigned char>(c)];
    double h = 0;
    const auto n = static_cast<double>(text.size());
    for (std::size_t k : count) {
      if (k == 0) continue;
      const double p = static_cast<double>(k) / n;
      h -= p * std::log2(p);
    }
    return h >= bits;
  }

  /// True when there is no secret.
  [[nodiscard]] bool empty() const noexcept { return bytes_.empty(); }
  /// The secret's bytes.
  [[nodiscard]] std::span<const std::byte> bytes() const noexcept { return bytes_; }

 private:
  static std::string octal(unsigned mode) {
    std::string out;
    for (int shift = 6; shift >= 0; shift -= 3) out += static_cast<char>('0' + ((mode >> shift) & 7));
    return out;
  }
  void wipe() noexcept {
    // volatile: the stores must happen although the memory is freed next.
    volatile std::byte* p = bytes_.data();
    for (std::size_t i = 0; i < bytes_.size(); ++i) p[i] = std::byte{0};
  }

  std::vector<std::byte> bytes_;
};

}  // namespace ddp
