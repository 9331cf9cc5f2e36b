#!/usr/bin/env bash
# Installs the Debian packages ddp's build, tests and examples need, if any is missing.
# CUDA and NCCL are not Debian packages here: the NCCL backend is built only where they are found.
# libtorch-dev (PyTorch's C++ API, CPU) and libeigen3-dev are for the tensor adapters (ddp::torch,
# ddp::eigen), their tests and examples; libtorch-dev is large (about 1 GiB with its dependencies).
# ddp::ddp itself needs libssl-dev (OpenSSL's libcrypto 3: SHA-256 and HMAC-SHA256 of the peer
# authentication, include/ddp/detail/hmac_sha256.hpp) and libxxhash-dev (xxhash.h, used header-only:
# XXH64, the Manager's state hash and the checkpoints' checksum, include/ddp/detail/xxh64.hpp).
# slurmd, slurmctld, slurm-client and munge are for the tests under a Slurm cluster on test hosts
# (ctest -L slurm, scripts/ddp-slurm); no daemon is started by installing them here.
#
# DDP_SKIP_PACKAGES="libtorch-dev libeigen3-dev" leaves those packages out (any of the optional ones:
# libtorch-dev, libeigen3-dev, libgloo-dev, redis-server, libhiredis-dev, doxygen, clang,
# clang-format, slurmd, slurmctld, slurm-client, munge); CMake then leaves out the part that needs it. The packages ddp::ddp, the tests and
# the launcher need cannot be skipped.
set -euo pipefail
packages=(cmake make ninja-build g++ clang clang-format openmpi-bin libopenmpi-dev catch2 libgloo-dev redis-server libhiredis-dev
          libssl-dev libxxhash-dev doxygen pkg-config libtorch-dev libeigen3-dev iproute2 util-linux python3
          slurmd slurmctld slurm-client munge)
optional=" libtorch-dev libeigen3-dev libgloo-dev redis-server libhiredis-dev doxygen clang clang-format slurmd slurmctld slurm-client munge "
skip=" ${DDP_SKIP_PACKAGES:-} "
for p in $skip; do
  [[ "$optional" == *" $p "* ]] || { echo "install-deps.sh: DDP_SKIP_PACKAGES names $p, which is not optional (optional:$optional)" >&2; exit 2; }
done
missing=()
for p in "${packages[@]}"; do
  [[ "$skip" == *" $p "* ]] && continue
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "installing: ${missing[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
