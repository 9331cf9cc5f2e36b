# Sourced by the Slurm tests' scripts: a batch job submitted from the login node, and waits on its
# output. Needs $out (the job's output file) and ddp-run --slurm's DDP_SLURM_TOOL and DDP_HOSTS_ID.

# Submits batch script $1 and waits for it in the background (`sbatch --wait`): its pid in $job.
submit_job() {
  "$DDP_SLURM_TOOL" on "$DDP_HOSTS_ID" sbatch --wait --quiet "$1" &
  job=$!
}

# Waits until `grep -cE $1` of the job's output reaches $2, at most $3 seconds; false if it did
# not, or if the job ended first.
await_count() {
  local i
  for ((i = 0; i < $3 * 20; i++)); do
    [ "$(grep -cE "$1" "$out" 2> /dev/null)" -ge "$2" ] && return 0
    kill -0 "$job" 2> /dev/null || return 1
    sleep 0.05
  done
  return 1
}
