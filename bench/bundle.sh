#!/usr/bin/env bash
# Copies binaries, stripped, into OUT/bin and every shared library they load from this
# build machine into OUT/lib (gRPC, protobuf, Abseil, RocksDB, OpenSSL, ... but not glibc,
# nor the NVIDIA driver), so that they run on a host that has none of this build's
# packages: LD_LIBRARY_PATH=OUT/lib OUT/bin/NAME. bench/gpu_bundle.sh and
# bench/manycore_bundle.sh use it.
#
#   bash bench/bundle.sh OUT BINARY...
set -euo pipefail
out=${1:?usage: bundle.sh OUT BINARY...}
shift
mkdir -p "$out/bin" "$out/lib"
for b in "$@"; do
  test -x "$b" || { echo "bundle: $b is not built" >&2; exit 1; }
  strip --strip-unneeded -o "$out/bin/$(basename "$b")" "$b"
done
for b in "$@"; do ldd "$b"; done |
  awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
  grep -Ev '/(libc|libm|libdl|librt|libpthread|ld-linux-x86-64|libcuda)\.so' |
  while read -r lib; do
    strip --strip-unneeded -o "$out/lib/$(basename "$lib")" "$(readlink -f "$lib")"
  done
