// Fuzz target: a checkpoint file as `checkpoint_dir::load_latest` reads it (ddp/checkpoint/format.hpp),
// whose bytes a crash, a full disk or another program may have left in any shape.
//
// Properties: no crash or UB; a file decode accepts is exactly what encode_header, the tensors'
// bytes and the checksum make of what it returned (so nothing it accepts can be read two ways);
// each tensor's bytes lie inside the file, in order, ending at the checksum.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <ddp/checkpoint/format.hpp>

#include "fuzz_check.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace f = ddp::detail::checkpoint_format;
  const auto in = fuzz::bytes(data, size);
  std::string why;
  const auto c = f::decode(in, why);
  if (!c) {
    FUZZ_CHECK(!why.empty());
    return 0;
  }
  std::vector<std::byte> again = f::encode_header(c->step, c->tensors, c->scalars);
  FUZZ_CHECK(c->offsets.size() == c->tensors.size());
  std::size_t at = again.size();
  for (std::size_t i = 0; i < c->tensors.size(); ++i) {
    FUZZ_CHECK(c->offsets[i] == at);
    at += c->tensors[i].count * ddp::size_of(c->tensors[i].type);
  }
  FUZZ_CHECK(at + 8 == size);
  again.insert(again.end(), in.begin() + static_cast<std::ptrdiff_t>(again.size()), in.end());
  FUZZ_CHECK(again.size() == size && std::memcmp(again.data(), data, size) == 0);
  return 0;
}
