#pragma once
/// @file detail/describe_exception.hpp
/// @brief `describe_exception`: the text of whatever an `std::exception_ptr` holds, for logs and
/// for nesting one failure in another's message.

#include <exception>
#include <string>

namespace ddp::detail {

/// `what()` of the exception `e` holds; "unknown error" for a non-standard one, "no error" for null.
[[nodiscard]] inline std::string describe_exception(const std::exception_ptr& e) {
  if (!e) return "no error";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown error";
  }
}

}  // namespace ddp::detail
