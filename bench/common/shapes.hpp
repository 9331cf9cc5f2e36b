#pragma once
/// @file bench/common/shapes.hpp
/// @brief `bench::read_counts`: element counts of the parameters in a shapes file (one parameter
/// per line: name and shape such as `64x3x7x7`; `#` starts a comment line).

#include <cstddef>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace bench {

/// Element count of every parameter in `path`, in file order; `fallback` if `path` is empty.
inline std::vector<std::size_t> read_counts(const std::string& path, std::vector<std::size_t> fallback) {
  if (path.empty()) return fallback;
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open shapes file " + path);
  std::vector<std::size_t> out;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    std::string name, dims;
    ls >> name >> dims;
    if (dims.empty()) throw std::runtime_error("bad line in " + path + ": " + line);
    std::size_t n = 1;
    std::stringstream ds(dims);
    for (std::string d; std::getline(ds, d, 'x');) n *= static_cast<std::size_t>(std::stoull(d));
    out.push_back(n);
  }
  return out;
}

}  // namespace bench
