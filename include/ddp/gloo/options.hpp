#pragma once
/// @file gloo/options.hpp
/// @brief Knobs of a gloo communicator.

#include <chrono>
#include <optional>
#include <string>

#include <ddp/job_secret.hpp>
#include <ddp/progress.hpp>
#include <ddp/work.hpp>

namespace ddp::gloo {

/// Files of gloo's TLS transport (PEM): this rank's key and certificate, and the CAs that signed
/// its peers' (a file, a directory, or both).
struct tls_files {
  std::string private_key{};  ///< this rank's private key
  std::string certificate{};  ///< this rank's certificate
  std::string ca_file{};      ///< CA certificates to verify peers with ("" if `ca_path` is given)
  std::string ca_path{};      ///< directory of CA certificates ("" if `ca_file` is given)
};

/// How a gloo communicator connects and how long its operations may take.
struct options {
  /// Deadline of every collective, measured from when it starts running (gloo's per-operation
  /// timeout). A peer that stopped answering turns into `timeout_error` after this long.
  std::chrono::milliseconds timeout = default_timeout;
  /// Deadline of the whole rendezvous: every member publishing its address and every connection
  /// being made. gloo itself would wait a fixed 30 s for a missing member; this bounds it.
  std::chrono::milliseconds connect_timeout{std::chrono::minutes(1)};
  /// Address to listen on and to advertise to peers. Loopback unless an address is given: a
  /// communicator reachable from the network is a decision, not a default.
  std::string hostname = "127.0.0.1";
  /// Network interface to listen on ("eth0"); when set, it replaces `hostname`.
  std::string interface {};
  /// The job's secret, proven over every pair right after connecting and before any data moves
  /// (gloo/authenticate.hpp). Default: environment variable DDP_JOB_SECRET, which
  /// `scripts/ddp-run` sets; empty (unset) = pairs are not authenticated, which only a
  /// communicator on one host over loopback accepts (see `insecure_no_secret`). Every rank needs
  /// the same one: docs/security.md.
  job_secret secret = job_secret::from_environment();
  /// Lets a communicator without a secret start although it spans hosts or listens where other
  /// hosts can reach it (without this, that is a usage_error). Insecure: any process that reaches
  /// its ports can then join it and read or inject gradients (docs/security.md).
  bool insecure_no_secret = false;
  /// Encrypt and mutually authenticate every pair with gloo's TLS transport. Only where gloo was
  /// built with it (GLOO_HAVE_TRANSPORT_TCP_TLS; Debian's libgloo is not): elsewhere asking for
  /// it is a usage_error. The job secret authenticates without encrypting (docs/security.md).
  std::optional<tls_files> tls{};
  /// Namespace of the communicator's keys inside the store it is given.
  std::string key_prefix = "gloo/";
  /// f16/bf16 are reduced in f32 on the wire: one rounding at the end, like the local backend,
  /// for twice the bytes. False reduces them in their own format (each ring step rounds).
  bool widen_half = true;
  /// Reports a slow rendezvous while connecting: which ranks have not published their address
  /// yet. Default: lines on stderr from rank 0 once the wait passes 2 s (progress.hpp).
  progress_sink progress = print_progress();
};

}  // namespace ddp::gloo
