#pragma once
/// @file launch_env.hpp
/// @brief `ddp::launch_env`: this process's rank, the job's size and its place on its node, as the
/// launcher that started it says: Slurm (`srun`), Open MPI (`mpirun`, `ddp-run`), a torchrun-style
/// launcher, or `ddp-supervise`. For jobs that do not initialise MPI (gloo over a store) and still
/// need a rank (docs/launching.md, "Rank and size without MPI"). And `ddp::replica_env`: what
/// `ddp-supervise` told a replica of a fault-tolerant job (its id, incarnation, group and store).

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include <ddp/error.hpp>

namespace ddp {

/// What a launcher told this process.
struct launch_env {
  int rank = 0;          ///< in the job (Slurm: SLURM_PROCID)
  int size = 1;          ///< processes in the job (Slurm: SLURM_NTASKS)
  int local_rank = 0;    ///< on this node (Slurm: SLURM_LOCALID): pick the GPU, the core set
  int local_size = 1;    ///< processes on this node (Slurm: SLURM_NTASKS_PER_NODE's, when uniform)
  std::string launcher;  ///< "slurm", "openmpi", "torchrun", "ddp-supervise"
  std::string job_id;    ///< a name for the job's store keys: SLURM_JOB_ID[.step], "" if none

  /// Reads the first launcher's variables found, in the order Slurm, Open MPI, torchrun
  /// (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), ddp-supervise (DDP_REPLICA_ID and
  /// DDP_REPLICAS: a replica of one rank); nothing if none is set. `get` reads a variable
  /// (std::getenv; tests pass their own).
  /// @throws usage_error naming the variable when a value is not a number, or a rank is not
  ///   below its size
  [[nodiscard]] static std::optional<launch_env> detect(const std::function<const char*(const char*)>& get =
                                                            [](const char* n) { return std::getenv(n); }) {
    const auto has = [&](const char* n) { return get(n) != nullptr && *get(n) != '\0'; };
    launch_env e;
    if (has("SLURM_PROCID") && has("SLURM_NTASKS")) {
      e.launcher = "slurm";
      e.rank = number(get, "SLURM_PROCID");
      e.size = number(get, "SLURM_NTASKS");
      e.local_rank = has("SLURM_LOCALID") ? number(get, "SLURM_LOCALID") : 0;
      e.local_size = has("SLURM_NTASKS_PER_NODE") ? uniform_count(get, "SLURM_NTASKS_PER_NODE") : 1;
      if (has("SLURM_JOB_ID")) {
        e.job_id =
            std::string(get("SLURM_JOB_ID")) + (has("SLURM_STEP_ID") ? "." + std::string(get("SLURM_STEP_ID")) : "");
      }
    } else if (has("OMPI_COMM_WORLD_RANK") && has("OMPI_COMM_WORLD_SIZE")) {
      e.launcher = "openmpi";
      e.rank = number(get, "OMPI_COMM_WORLD_RANK");
      e.size = number(get, "OMPI_COMM_WORLD_SIZE");
      e.local_rank = has("OMPI_COMM_WORLD_LOCAL_RANK") ? number(get, "OMPI_COMM_WORLD_LOCAL_RANK") : 0;
      e.local_size = has("OMPI_COMM_WORLD_LOCAL_SIZE") ? number(get, "OMPI_COMM_WORLD_LOCAL_SIZE") : 1;
    } else if (has("RANK") && has("WORLD_SIZE")) {
      e.launcher = "torchrun";
      e.rank = number(get, "RANK");
      e.size = number(get, "WORLD_SIZE");
      e.local_rank = has("LOCAL_RANK") ? number(get, "LOCAL_RANK") : 0;
      e.local_size = has("LOCAL_WORLD_SIZE") ? number(get, "LOCAL_WORLD_SIZE") : 1;
      if (has("TORCHELASTIC_RUN_ID")) e.job_id = get("TORCHELASTIC_RUN_ID");
    } else if (has("DDP_REPLICA_ID") && has("DDP_REPLICAS")) {
      e.launcher = "ddp-supervise";
      e.rank = number(get, "DDP_REPLICA_ID");
      e.size = number(get, "DDP_REPLICAS");
    } else {
      return std::nullopt;
    }
    check(e.rank, e.size, e.launcher, "rank", "size");
    check(e.local_rank, e.local_size, e.launcher, "local rank", "local size");
    return e;
  }

 private:
  // A non-negative decimal integer below 2^31, or a usage_error naming the variable.
  static int number(const std::function<const char*(const char*)>& get, const char* name) {
    return parse(get(name), name);
  }
  static int parse(std::string_view text, const char* name) {
    long long v = 0;
    bool ok = !text.empty() && text.size() <= 10;
    for (const char c : text) {
      ok = ok && c >= '0' && c <= '9';
      if (ok) v = v * 10 + (c - '0');
    }
    if (!ok || v > 0x7fffffff) {
      throw usage_error(-1, "launch_env::detect",
                        std::string(name) + "='" + std::string(text) + "' is not a non-negative integer");
    }
    return static_cast<int>(v);
  }
  // SLURM_NTASKS_PER_NODE: "4", or "4(x2)" / "4(x2),3": the count when every node has the same.
  static int uniform_count(const std::function<const char*(const char*)>& get, const char* name) {
    const std::string_view text = get(name);
    int count = -1;
    std::size_t at = 0;
    while (at <= text.size()) {
      const std::size_t comma = std::min(text.find(',', at), text.size());
      std::string_view item = text.substr(at, comma - at);
      item = item.substr(0, item.find('('));
      const int n = parse(item, name);
      if (count >= 0 && n != count) {
        throw usage_error(-1, "launch_env::detect",
                          std::string(name) + "='" + std::string(text) +
                              "': nodes run different numbers of tasks; local_size would differ by node");
      }
      count = n;
      at = comma + 1;
    }
    return count;
  }
  static void check(int rank, int size, const std::string& launcher, const char* r, const char* s) {
    if (size < 1 || rank >= size) {
      throw usage_error(-1, "launch_env::detect",
                        launcher + " says " + r + " " + std::to_string(rank) + " of " + s + " " + std::to_string(size) +
                            ": the " + r + " must be below the " + s);
    }
  }
  friend struct replica_env;
};

/// Where a job's store is, as `ddp-supervise` writes it in DDP_STORE: "file:<dir>" (a
/// `stores::file_store` on a directory every replica sees) or "redis:<host>:<port>" (a
/// `stores::redis_store`, which reads the password from DDP_REDIS_PASSWORD itself).
struct store_address {
  /// The kinds of store `ddp-supervise` starts or points at.
  enum class kind { file, redis };
  kind type = kind::file;  ///< which store
  std::string path;        ///< file: the directory
  std::string host;        ///< redis: the server's host
  int port = 0;            ///< redis: the server's port

  /// @throws usage_error saying what is wrong with `text` (`variable` names where it came from)
  [[nodiscard]] static store_address parse(std::string_view text, const char* variable = "DDP_STORE") {
    const auto bad = [&](const std::string& why) {
      return usage_error(-1, "store_address::parse",
                         std::string(variable) + "='" + std::string(text) + "': " + why +
                             " (expected file:<dir> or redis:<host>:<port>)");
    };
    store_address a;
    if (text.starts_with("file:")) {
      a.path = std::string(text.substr(5));
      if (a.path.empty()) throw bad("no directory");
      return a;
    }
    if (!text.starts_with("redis:")) throw bad("unknown kind of store");
    a.type = kind::redis;
    const std::string_view rest = text.substr(6);
    const auto colon = rest.rfind(':');
    if (colon == std::string_view::npos || colon == 0) throw bad("no host and port");
    a.host = std::string(rest.substr(0, colon));
    const std::string_view port = rest.substr(colon + 1);
    bool digits = !port.empty() && port.size() <= 5;
    for (const char c : port) {
      digits = digits && c >= '0' && c <= '9';
      if (digits) a.port = a.port * 10 + (c - '0');
    }
    if (!digits || a.port < 1 || a.port > 65535) throw bad("the port must be 1-65535");
    return a;
  }
};

/// What `ddp-supervise` told one process of a fault-tolerant job (docs/launching.md,
/// "Fault-tolerant jobs"): which replica it is, which start of it, its place in a replica group,
/// and where the job's store is. The job's secret (DDP_JOB_SECRET) is read by the backends
/// themselves.
struct replica_env {
  int id = 0;                          ///< DDP_REPLICA_ID, 0..replicas-1, stable across restarts: the replica_id
  int replicas = 1;                    ///< DDP_REPLICAS
  int incarnation = 0;                 ///< DDP_REPLICA_INCARNATION: 0 at the first start, +1 at each restart
  int group_rank = 0;                  ///< DDP_GROUP_RANK: this process's index in its replica group
  int group_size = 1;                  ///< DDP_GROUP_SIZE: processes per replica (1: no group)
  std::optional<store_address> store;  ///< DDP_STORE; nothing under `--store none`

  /// Reads the variables; nothing if DDP_REPLICA_ID is unset (not under `ddp-supervise`).
  /// @throws usage_error naming the variable when a value is not a number, an index is not below
  ///   its count, or DDP_STORE is malformed
  [[nodiscard]] static std::optional<replica_env> detect(const std::function<const char*(const char*)>& get =
                                                             [](const char* n) { return std::getenv(n); }) {
    const auto has = [&](const char* n) { return get(n) != nullptr && *get(n) != '\0'; };
    if (!has("DDP_REPLICA_ID")) return std::nullopt;
    const auto number = [&](const char* n, int otherwise) { return has(n) ? launch_env::number(get, n) : otherwise; };
    replica_env e;
    e.id = launch_env::number(get, "DDP_REPLICA_ID");
    e.replicas = number("DDP_REPLICAS", 1);
    e.incarnation = number("DDP_REPLICA_INCARNATION", 0);
    e.group_rank = number("DDP_GROUP_RANK", 0);
    e.group_size = number("DDP_GROUP_SIZE", 1);
    launch_env::check(e.id, e.replicas, "ddp-supervise", "replica id", "replica count");
    launch_env::check(e.group_rank, e.group_size, "ddp-supervise", "group rank", "group size");
    if (has("DDP_STORE")) e.store = store_address::parse(get("DDP_STORE"));
    return e;
  }
};

}  // namespace ddp
