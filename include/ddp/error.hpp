#pragma once
/// @file error.hpp
/// @brief The library's exception hierarchy. Every error carries the rank that saw it and the
/// operation it happened in, so a log line from any rank says what went wrong and where.

#include <stdexcept>
#include <string>
#include <utility>

namespace ddp {

/// Base of every exception the library throws.
class error : public std::runtime_error {
 public:
  /// @param rank       rank that detected the error (-1 if not known, e.g. before a communicator exists)
  /// @param operation  what was being done ("allreduce #12", "Bucketer::mark_ready", ...)
  /// @param message    what was wrong
  error(int rank, std::string operation, const std::string& message)
      : std::runtime_error(format(rank, operation, message)),
        rank_(rank),
        operation_(std::move(operation)),
        message_(message) {}

  /// Rank that detected the error; -1 if not known.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// Operation the error happened in ("allreduce #12", ...); may be empty.
  [[nodiscard]] const std::string& operation() const noexcept { return operation_; }
  /// What was wrong, without the "ddp: rank r, <operation>: " prefix of `what()`: for nesting
  /// this error in another one's message without repeating who and where.
  [[nodiscard]] const std::string& message() const noexcept { return message_; }

 private:
  static std::string format(int rank, const std::string& operation, const std::string& message) {
    std::string out = "ddp: ";
    out += rank >= 0 ? "rank " + std::to_string(rank) : std::string("rank ?");
    if (!operation.empty()) out += ", " + operation;
    out += ": " + message;
    return out;
  }

  int rank_;
  std::string operation_;
  std::string message_;
};

/// A collective failed in the transport: a peer died or aborted, the backend returned an error,
/// or the communicator was aborted while the operation was pending.
class communication_error : public error {
 public:
  using error::error;
};

/// A blocking wait reached its deadline. The operation may still be pending in the backend.
class timeout_error : public communication_error {
 public:
  using communication_error::communication_error;
};

/// Ranks issued different collectives at the same point of their sequence (detected by the
/// checked mode or by a backend that sees every rank's call).
class mismatch_error : public communication_error {
 public:
  using communication_error::communication_error;
};

/// The caller broke a documented precondition: wrong dtype or device, size mismatch, use after
/// abort, a gradient marked ready twice, ...
class usage_error : public error {
 public:
  using error::error;
};

}  // namespace ddp
