#pragma once
/// @file gloo/errors.hpp
/// @brief gloo's exceptions turned into ddp's, naming the rank and the operation.
///
/// - `gloo::IoException` "Timed out ..." → `timeout_error`: a peer is stopped, slow, or itself
///   waiting on a dead rank (gloo fails the operation where the dead peer is, and a rank that
///   only talks to survivors just stops receiving).
/// - other `gloo::IoException` → `communication_error`: a connection failed (peer died, peer
///   aborted, or our own abort()).
/// - `gloo::EnforceNotMet` about a size mismatch → `mismatch_error`: ranks issued different
///   collectives at the same position.
/// - anything else from gloo → `communication_error`. ddp's own errors and std::bad_alloc pass
///   through unchanged.

#include <exception>
#include <new>
#include <string>

#include <gloo/common/error.h>
#include <gloo/common/logging.h>

#include <ddp/error.hpp>
#include <ddp/work.hpp>

namespace ddp::gloo::detail {

/// The message of any exception, without the "ddp: rank r, <operation>: " prefix if it is a ddp
/// error (`error::message()`).
[[nodiscard]] inline std::string bare_message(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const ddp::error& x) {
    return x.message();
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown error";
  }
}

/// The ddp exception for the exception in flight (call from a catch block).
[[nodiscard]] inline std::exception_ptr translate_current_exception(const op_info& info) {
  const std::string where = info.describe();
  try {
    throw;
  } catch (const ddp::error&) {
    return std::current_exception();
  } catch (const std::bad_alloc&) {
    return std::current_exception();
  } catch (const ::gloo::IoException& e) {
    const std::string what = e.what();
    if (what.find("Timed out") != std::string::npos || what.find("timeout") != std::string::npos) {
      return std::make_exception_ptr(timeout_error(
          info.rank, where, "gloo: " + what + " (a peer is stopped or slow, or waits on a rank that died)"));
    }
    return std::make_exception_ptr(
        communication_error(info.rank, where, "gloo: " + what + " (a peer died or aborted)"));
  } catch (const ::gloo::EnforceNotMet& e) {
    const std::string what = e.what();
    if (what.find("mismatch") != std::string::npos || what.find("doesn't match") != std::string::npos) {
      return std::make_exception_ptr(mismatch_error(info.rank, where, "gloo: " + what));
    }
    return std::make_exception_ptr(communication_error(info.rank, where, "gloo: " + what));
  } catch (const std::exception& e) {
    return std::make_exception_ptr(communication_error(info.rank, where, std::string("gloo: ") + e.what()));
  } catch (...) {
    return std::make_exception_ptr(communication_error(info.rank, where, "gloo: unknown exception"));
  }
}

}  // namespace ddp::gloo::detail
