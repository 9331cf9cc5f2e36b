#!/usr/bin/env bash
# A ddp MPI job as a Slurm user submits it (issue #46): `sbatch --wait` of a batch script whose
# `srun --mpi=pmix` starts examples/train_mlp on 3 hosts x 2 ranks; every rank must report the
# same parameter fingerprint. Run by `ddp-run --hosts 3 --slurm --hosts-only`, which made the
# cluster and gives SLURM_CONF, DDP_SLURM_TOOL and DDP_HOSTS_ID.
# Usage: sbatch_test.sh <path to train_mlp>
set -u
trainer=$1
: "${DDP_SLURM_TOOL:?run me with ddp-run --hosts 3 --slurm --hosts-only}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/job.sh" <<JOB
#!/usr/bin/env bash
#SBATCH --nodes=3 --ntasks-per-node=2 --job-name=train_mlp
#SBATCH --output=$work/job-%j.out
# Open MPI's ranks talk TCP on the hosts' subnet (docs/launching.md, "Test hosts")
export OMPI_MCA_btl=self,vader,tcp OMPI_MCA_btl_tcp_if_include=10.77.0.0/24 OMPI_MCA_mpi_yield_when_idle=1
echo "batch script on \$(hostname), nodes \$SLURM_JOB_NODELIST, \$SLURM_NTASKS tasks"
srun --mpi=pmix "$trainer"
JOB
"$DDP_SLURM_TOOL" on "$DDP_HOSTS_ID" sbatch --wait --quiet "$work/job.sh"
rc=$?
out=$(cat "$work"/job-*.out 2> /dev/null)
echo "$out"
[ "$rc" = 0 ] || { echo "FAIL: sbatch --wait returned $rc"; exit 1; }
ranks=$(grep -c "identical on all 6 ranks: yes" <<< "$out")
prints=$(grep -o "parameter fingerprint [0-9a-f]*" <<< "$out" | sort -u | wc -l)
nodes=$(grep -o "nodes h\[1-3\], 6 tasks" <<< "$out")
if [ "$ranks" = 6 ] && [ "$prints" = 1 ] && [ -n "$nodes" ]; then
  echo "sbatch: 6 ranks on 3 hosts, one fingerprint: passed"
  exit 0
fi
echo "FAIL: $ranks of 6 ranks identical, $prints distinct fingerprints, nodes line '${nodes}'"
exit 1
