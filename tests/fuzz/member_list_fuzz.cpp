// Fuzz target: the member list of a group (`members/closed`, stores/membership.hpp), written by
// the group's first arrival and read by every member. The input is the stored text.
//
// Properties: a malformed list is a communication_error (the store held bad data: not a
// usage_error, not a crash or UB); a list that decodes has distinct, non-negative arrival numbers
// and valid ids, and decode(encode(list)) == list.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <ddp/error.hpp>
#include <ddp/stores/codec.hpp>
#include <ddp/stores/membership.hpp>

#include "fuzz_check.hpp"

namespace st = ddp::stores::detail;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(fuzz::text(data, size));
  std::vector<st::arrival> list;
  try {
    list = st::decode_members(text);
  } catch (const ddp::communication_error&) {
    return 0;
  }
  std::vector<std::int64_t> indices;
  for (const auto& a : list) {
    FUZZ_CHECK(a.index >= 0);
    FUZZ_CHECK(!a.id.empty() && a.id.size() <= ddp::max_key_bytes);
    FUZZ_CHECK(std::all_of(a.id.begin(), a.id.end(), st::is_key_char));
    indices.push_back(a.index);
  }
  std::sort(indices.begin(), indices.end());
  FUZZ_CHECK(std::adjacent_find(indices.begin(), indices.end()) == indices.end());
  const auto again = st::decode_members(st::encode_members(list));
  FUZZ_CHECK(again.size() == list.size());
  for (std::size_t i = 0; i < list.size(); ++i) {
    FUZZ_CHECK(again[i].index == list[i].index && again[i].id == list[i].id);
  }
  return 0;
}
