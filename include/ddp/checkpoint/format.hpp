#pragma once
/// @file checkpoint/format.hpp
/// @brief (detail) The bytes of one checkpoint file and their check (docs/checkpoint.md, "Format"):
/// `encode_header` and `decode`, which refuses a file that is short, long, of another version or
/// whose checksum differs, naming what it found. Pure functions over bytes, fuzzed.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <ddp/dtype.hpp>
#include <ddp/detail/xxh64.hpp>

namespace ddp::detail::checkpoint_format {

inline constexpr char magic[8] = {'D', 'D', 'P', 'C', 'K', 'P', 'T', '\n'};
inline constexpr std::uint32_t version = 1;
/// What a tensor entry of the header says: its dtype and element count.
struct tensor_entry {
  dtype type = dtype::f32;
  std::uint64_t count = 0;
  friend bool operator==(const tensor_entry&, const tensor_entry&) = default;
};

/// What a valid file holds: the step, the entries, the scalars and where each tensor's bytes are.
struct contents {
  std::int64_t step = 0;
  std::vector<tensor_entry> tensors;
  std::vector<std::int64_t> scalars;
  std::vector<std::size_t> offsets;  ///< of each tensor's bytes in the file
};

// Header: magic (8), version u32, tensors u32, scalars u32, reserved u32, step i64, then per tensor
// dtype u64 and count u64, then the scalars (i64 each); then the tensors' bytes in order; then the
// XXH64 of everything before it (u64). Native byte order: a checkpoint is read on the machine kind
// that wrote it (docs/checkpoint.md).
inline constexpr std::size_t fixed_header = 8 + 4 * 4 + 8;

template <class T>
void put(std::vector<std::byte>& out, T v) {
  const auto* p = reinterpret_cast<const std::byte*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}
template <class T>
[[nodiscard]] T get(std::span<const std::byte> in, std::size_t at) {
  T v;
  std::memcpy(&v, in.data() + at, sizeof(T));
  return v;
}

/// The header and scalars; the tensors' bytes and the checksum follow.
[[nodiscard]] inline std::vector<std::byte> encode_header(std::int64_t step, std::span<const tensor_entry> tensors,
                                                          std::span<const std::int64_t> scalars) {
  std::vector<std::byte> out;
  const auto* m = reinterpret_cast<const std::byte*>(magic);
  out.insert(out.end(), m, m + sizeof(magic));
  put(out, version);
  put(out, static_cast<std::uint32_t>(tensors.size()));
  put(out, static_cast<std::uint32_t>(scalars.size()));
  put(out, std::uint32_t{0});
  put(out, step);
  for (const tensor_entry& t : tensors) {
    put(out, static_cast<std::uint64_t>(t.type));
    put(out, t.count);
  }
  for (const std::int64_t s : scalars) put(out, s);
  return out;
}

/// The checksum that ends a file whose bytes before it are `body`.
[[nodiscard]] inline std::uint64_t checksum(std::span<const std::byte> body) noexcept { return xxh64(body); }

/// `file` checked and read, or why it is not a checkpoint (into `why`).
[[nodiscard]] inline std::optional<contents> decode(std::span<const std::byte> file, std::string& why) {
  if (file.size() < fixed_header + 8 || std::memcmp(file.data(), magic, sizeof(magic)) != 0) {
    why = file.size() < fixed_header + 8 ? "is " + std::to_string(file.size()) + " bytes, shorter than any checkpoint"
                                         : "does not start with a checkpoint's magic bytes";
    return std::nullopt;
  }
  if (const auto v = get<std::uint32_t>(file, 8); v != version) {
    why = "has format version " + std::to_string(v) + ", this build reads version " + std::to_string(version);
    return std::nullopt;
  }
  const auto n_tensors = get<std::uint32_t>(file, 12);
  const auto n_scalars = get<std::uint32_t>(file, 16);
  if (get<std::uint32_t>(file, 20) != 0) {
    why = "has a reserved field that is not zero";
    return std::nullopt;
  }
  const std::uint64_t header_bytes = fixed_header + std::uint64_t{n_tensors} * 16 + std::uint64_t{n_scalars} * 8;
  if (header_bytes + 8 > file.size()) {
    why = "is " + std::to_string(file.size()) + " bytes, shorter than its header says (truncated?)";
    return std::nullopt;
  }
  const auto header = static_cast<std::size_t>(header_bytes);  // below file.size(): fits
  contents c;
  c.step = get<std::int64_t>(file, 24);
  std::size_t at = fixed_header;
  std::size_t payload = 0;
  bool bad_type = false;
  for (std::uint32_t i = 0; i < n_tensors; ++i, at += 16) {
    const auto raw = get<std::uint64_t>(file, at);
    const tensor_entry e{static_cast<dtype>(raw), get<std::uint64_t>(file, at + 8)};
    bad_type = bad_type || raw >= all_dtypes.size();
    if (!bad_type && e.count > (file.size() - payload) / size_of(e.type)) {
      why = "is " + std::to_string(file.size()) + " bytes, shorter than its tensors say (truncated?)";
      return std::nullopt;
    }
    if (!bad_type) payload += e.count * size_of(e.type);
    c.tensors.push_back(e);
  }
  if (bad_type) {
    why = "names a dtype this build does not know";
    return std::nullopt;
  }
  for (std::uint32_t i = 0; i < n_scalars; ++i, at += 8) c.scalars.push_back(get<std::int64_t>(file, at));
  if (header + payload + 8 != file.size()) {
    why = "is " + std::to_string(file.size()) + " bytes, its header says " + std::to_string(header + payload + 8) +
          (header + payload + 8 > file.size() ? " (truncated?)" : "");
    return std::nullopt;
  }
  const std::size_t body = file.size() - 8;
  if (checksum(file.first(body)) != get<std::uint64_t>(file, body)) {
    why = "fails its checksum (XXH64 of its contents): corrupted";
    return std::nullopt;
  }
  for (const tensor_entry& e : c.tensors) {
    c.offsets.push_back(at);
    at += e.count * size_of(e.type);
  }
  return c;
}

}  // namespace ddp::detail::checkpoint_format
