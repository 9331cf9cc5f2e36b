#!/usr/bin/env bash
# Packs what ddp::ddp needs beyond the standard library (OpenSSL 3's libcrypto: headers and
# library; xxHash's xxhash.h), and gloo where it is installed, into build/gpu-deps, for a machine that lacks them and cannot install
# them (the lent GPU machine: a bare CUDA image without network). Carry build/gpu-deps there
# (the device tool's `carry`); scripts/gpu-check.sh uses it when it exists.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=build/gpu-deps
rm -rf "$out"
mkdir -p "$out/include" "$out/lib"
multiarch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
cp -r /usr/include/openssl "$out/include/"
# Debian keeps the configuration headers under the multiarch directory.
[ -d "/usr/include/$multiarch/openssl" ] && cp -r "/usr/include/$multiarch/openssl/." "$out/include/openssl/"
cp /usr/include/xxhash.h "$out/include/"
lib=$(readlink -f "/usr/lib/$multiarch/libcrypto.so")
cp "$lib" "$out/lib/"
ln -sf "$(basename "$lib")" "$out/lib/libcrypto.so"
[ -e "$out/lib/libcrypto.so.3" ] || ln -sf "$(basename "$lib")" "$out/lib/libcrypto.so.3"
# gloo (headers, libgloo and the libraries it needs that a bare CUDA image lacks), for the GPU
# check of replica processes over the staged communicator (tests/gpu/staged_replicas_test.cpp).
if [ -f /usr/include/gloo/allreduce.h ] && [ -e /usr/lib/libgloo.so ]; then
  cp -r /usr/include/gloo "$out/include/"
  gloo=$(readlink -f /usr/lib/libgloo.so)
  cp "$gloo" "$out/lib/"
  ln -sf "$(basename "$gloo")" "$out/lib/libgloo.so"
  ln -sf "$(basename "$gloo")" "$out/lib/libgloo.so.0"
  for dep in $(ldd "$gloo" | awk '/=> \// {print $3}' | grep -E 'libhiredis|libibverbs|libnl-'); do
    cp "$dep" "$out/lib/"
  done
fi
echo "gpu-deps: $(du -sh "$out" | cut -f1) in $out (OpenSSL $(sed -n 's/^# *define OPENSSL_VERSION_TEXT *"\(.*\)"/\1/p' "$out/include/openssl/opensslv.h" | head -1))"
