#pragma once
/// @file bench/common/table.hpp
/// @brief `bench::table`: a benchmark's results, printed as an aligned table for people and
/// written as CSV (the same numbers, same precision) for scripts.
///
/// @code
/// bench::table t({{"bytes"}, {"raw us", 2}, {"ddp us", 2}});
/// t.add({std::int64_t{1024}, 3.25, 3.5});
/// t.print(std::cout);
/// if (csv) t.write_csv(*csv);
/// @endcode

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <iomanip>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace bench {

/// One cell: text, an integer, or a floating-point number shown with its column's precision.
using cell = std::variant<std::string, std::int64_t, double>;

class table {
 public:
  struct column {
    std::string name;
    int precision = 0;  ///< digits after the point for floating-point cells
  };

  explicit table(std::vector<column> columns) : columns_(std::move(columns)) {}

  /// Appends a row; it must have one cell per column.
  void add(std::vector<cell> row) {
    if (row.size() != columns_.size()) {
      throw std::invalid_argument("bench::table: row has " + std::to_string(row.size()) + " cells, table has " +
                                  std::to_string(columns_.size()) + " columns");
    }
    rows_.push_back(std::move(row));
  }

  [[nodiscard]] std::size_t rows() const noexcept { return rows_.size(); }

  /// Aligned, right-justified columns under a header line.
  void print(std::ostream& os) const {
    std::vector<std::size_t> width(columns_.size());
    for (std::size_t c = 0; c < columns_.size(); ++c) width[c] = columns_[c].name.size();
    std::vector<std::vector<std::string>> text;
    for (const auto& row : rows_) {
      auto& line = text.emplace_back();
      for (std::size_t c = 0; c < row.size(); ++c) {
        line.push_back(format(row[c], columns_[c].precision));
        width[c] = std::max(width[c], line.back().size());
      }
    }
    auto emit = [&](auto&& value_of) {
      for (std::size_t c = 0; c < columns_.size(); ++c) {
        os << (c ? "  " : "") << std::setw(static_cast<int>(width[c])) << value_of(c);
      }
      os << '\n';
    };
    emit([&](std::size_t c) { return columns_[c].name; });
    emit([&](std::size_t c) { return std::string(width[c], '-'); });
    for (const auto& line : text) emit([&](std::size_t c) { return line[c]; });
    os.flush();
  }

  /// CSV: a header row of column names, then the rows, formatted as in `print`.
  void write_csv(std::ostream& os) const {
    for (std::size_t c = 0; c < columns_.size(); ++c) os << (c ? "," : "") << quote(columns_[c].name);
    os << '\n';
    for (const auto& row : rows_) {
      for (std::size_t c = 0; c < row.size(); ++c) os << (c ? "," : "") << quote(format(row[c], columns_[c].precision));
      os << '\n';
    }
  }

  /// Writes the CSV to `path`. Throws std::runtime_error if the file cannot be written.
  void write_csv(const std::string& path) const {
    std::ofstream out(path);
    if (!out) throw std::runtime_error("bench::table: cannot write " + path);
    write_csv(out);
    if (!out) throw std::runtime_error("bench::table: error writing " + path);
  }

 private:
  static std::string format(const cell& v, int precision) {
    if (const auto* s = std::get_if<std::string>(&v)) return *s;
    if (const auto* i = std::get_if<std::int64_t>(&v)) return std::to_string(*i);
    std::ostringstream os;
    os << std::fixed << std::setprecision(precision) << std::get<double>(v);
    return os.str();
  }

  static std::string quote(const std::string& s) {
    if (s.find_first_of(",\"\n") == std::string::npos) return s;
    std::string q = "\"";
    for (char ch : s) q += ch == '"' ? std::string("\"\"") : std::string(1, ch);
    return q + "\"";
  }

  std::vector<column> columns_;
  std::vector<std::vector<cell>> rows_;
};

}  // namespace bench
