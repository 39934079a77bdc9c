#!/usr/bin/env bash
# Installs the Debian packages kvtier needs to build, test and run, if any is missing.
# Sourced by start.sh and test.sh; safe to run again (it installs nothing twice).
set -euo pipefail

KVTIER_BUILD_PACKAGES=(
  build-essential cmake pkg-config ccache
  # clang: the thread-safety analysis of the lock annotations (a test), and the fuzz
  # targets; libclang-rt-dev holds libFuzzer's and the sanitizers' runtimes, which clang
  # only recommends (not installed with --no-install-recommends).
  clang libclang-rt-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev librocksdb-dev prometheus-cpp-dev libxxhash-dev libtomlplusplus-dev libisal-dev
  libsystemd-dev libgtest-dev
  # The shared tier's Redis Cluster client (hiredis), and a real cluster for its tests and
  # benchmarks (redis-server, redis-cli).
  libhiredis-dev redis-server redis-tools
  # TLS tests make their certificates with the openssl command.
  openssl
  # Tests of deploy/: promtool (Prometheus config and rules), `file`, which CPack's
  # DEB generator needs to run dpkg-shlibdeps, and strace (the unit's system-call filter
  # is checked against a traced daemon session).
  prometheus file strace
  # The Python package (client/python: a pybind11 binding of the C++ client) and its
  # tests, and the reference worker (worker/: a Llama decoder in torch, CPU).
  pybind11-dev python3-dev python3-numpy python3-protobuf python3-xxhash python3-grpcio
  python3-pytest python3-setuptools python3-pip python3-wheel python3-torch
)

kvtier_install_deps() {
  local missing=()
  for p in "${KVTIER_BUILD_PACKAGES[@]}" "$@"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$p")
    fi
  done
  if [ ${#missing[@]} -eq 0 ]; then
    return 0
  fi
  echo "kvtier: installing ${missing[*]}" >&2
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then sudo=(sudo); fi
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# Configures and builds into $1 (default: build) with every core.
kvtier_build() {
  local dir="${1:-build}"
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build "$dir" -j"$(nproc)"
}

# Packages only the benchmark suite (bench/run.sh) needs; the build and the test suite
# never depend on them: Redis (a baseline; bench/redis_bench.cc speaks RESP itself),
# iperf3 (the loopback TCP limit), fio (the SSD limit), matplotlib (the plots), and
# lscpu's util-linux.
KVTIER_BENCH_PACKAGES=(
  redis-server iperf3 fio python3 python3-matplotlib util-linux
)

kvtier_install_bench_deps() {
  kvtier_install_deps "${KVTIER_BENCH_PACKAGES[@]}" "$@"
}
