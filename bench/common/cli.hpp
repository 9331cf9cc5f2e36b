#pragma once
/// @file bench/common/cli.hpp
/// @brief `bench::cli`: the few command-line options of a benchmark program (`--name value` and
/// `--flag`), with sizes like `64KiB` or `256M`, a generated `--help`, and errors for unknown
/// options. Every program accepts `--csv FILE`.

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace bench {

class cli {
 public:
  struct option {
    std::string name;   ///< "--max-bytes"
    std::string value;  ///< placeholder shown in --help ("BYTES"); empty for a flag
    std::string help;
  };

  /// Parses argv against `options` (plus the built-in `--csv FILE` and `--help`). Throws
  /// std::invalid_argument on an unknown option or a missing value.
  cli(int argc, char** argv, std::string summary, std::vector<option> options)
      : summary_(std::move(summary)), options_(std::move(options)) {
    options_.push_back({"--csv", "FILE", "also write the table as CSV to FILE"});
    options_.push_back({"--help", "", "print this help"});
    program_ = argc > 0 ? argv[0] : "bench";
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      const option* o = find(arg);
      if (!o) throw std::invalid_argument("unknown option " + arg + " (see --help)");
      if (o->value.empty()) {
        values_[arg] = "1";
      } else {
        if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value " + o->value);
        values_[arg] = argv[++i];
      }
    }
  }

  [[nodiscard]] bool help_requested() const { return has("--help"); }
  void print_help(std::ostream& os) const {
    os << summary_ << "\n\nusage: " << program_ << " [options]\n";
    for (const auto& o : options_) {
      std::string left = "  " + o.name + (o.value.empty() ? "" : " " + o.value);
      if (left.size() < 28) left.resize(28, ' ');
      os << left << "  " << o.help << '\n';
    }
  }

  [[nodiscard]] bool has(const std::string& name) const { return values_.count(name) != 0; }
  [[nodiscard]] std::optional<std::string> get(const std::string& name) const {
    auto it = values_.find(name);
    if (it == values_.end()) return std::nullopt;
    return it->second;
  }
  [[nodiscard]] std::optional<std::string> csv() const { return get("--csv"); }

  [[nodiscard]] std::string string_or(const std::string& name, std::string fallback) const {
    return get(name).value_or(std::move(fallback));
  }
  [[nodiscard]] std::int64_t int_or(const std::string& name, std::int64_t fallback) const {
    const auto v = get(name);
    return v ? parse_int(name, *v) : fallback;
  }
  [[nodiscard]] double double_or(const std::string& name, double fallback) const {
    const auto v = get(name);
    if (!v) return fallback;
    char* end = nullptr;
    const double d = std::strtod(v->c_str(), &end);
    if (end == v->c_str() || *end != '\0') throw std::invalid_argument(name + ": not a number: " + *v);
    return d;
  }
  /// A byte count: a number with an optional suffix K, M, G (or KiB, MiB, GiB; all powers of 2).
  [[nodiscard]] std::uint64_t bytes_or(const std::string& name, std::uint64_t fallback) const {
    const auto v = get(name);
    return v ? parse_bytes(name, *v) : fallback;
  }

  static std::uint64_t parse_bytes(const std::string& name, std::string_view text) {
    std::size_t digits = 0;
    while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') ++digits;
    if (digits == 0) throw std::invalid_argument(name + ": not a size: " + std::string(text));
    std::uint64_t n = std::stoull(std::string(text.substr(0, digits)));
    const std::string_view suffix = text.substr(digits);
    static const std::pair<std::string_view, int> units[] = {{"", 0},   {"B", 0},    {"K", 10}, {"KiB", 10},
                                                             {"M", 20}, {"MiB", 20}, {"G", 30}, {"GiB", 30}};
    for (const auto& [unit, shift] : units) {
      if (suffix == unit) return n << shift;
    }
    throw std::invalid_argument(name + ": unknown size suffix in " + std::string(text));
  }

  /// "4 B", "64 KiB", "256 MiB": exact binary units where they fit.
  static std::string format_bytes(std::uint64_t n) {
    if (n >= (1ull << 30) && n % (1ull << 30) == 0) return std::to_string(n >> 30) + " GiB";
    if (n >= (1ull << 20) && n % (1ull << 20) == 0) return std::to_string(n >> 20) + " MiB";
    if (n >= (1ull << 10) && n % (1ull << 10) == 0) return std::to_string(n >> 10) + " KiB";
    return std::to_string(n) + " B";
  }

 private:
  const option* find(const std::string& name) const {
    for (const auto& o : options_) {
      if (o.name == name) return &o;
    }
    return nullptr;
  }
  static std::int64_t parse_int(const std::string& name, const std::string& v) {
    char* end = nullptr;
    const long long n = std::strtoll(v.c_str(), &end, 10);
    if (end == v.c_str() || *end != '\0') throw std::invalid_argument(name + ": not an integer: " + v);
    return n;
  }

  std::string summary_;
  std::vector<option> options_;
  std::string program_;
  std::map<std::string, std::string> values_;
};

}  // namespace bench
