#pragma once
/// @file launch_env.hpp
/// @brief `ddp::launch_env`: this process's rank, the job's size and its place on its node, as the
/// launcher that started it says: Slurm (`srun`), Open MPI (`mpirun`, `ddp-run`), a torchrun-style
/// launcher, or `ddp-supervise`. For jobs that do not initialise MPI (gloo over a store) and still
/// need a rank (docs/launching.md, "Rank and size without MPI").

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
};

}  // namespace ddp
