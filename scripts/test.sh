#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite (unit and integration;
# tests labelled `gpu` skip themselves on a machine without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
kvtier_install_deps
kvtier_build build
cd build
ctest --output-on-failure -j"$(nproc)" --timeout 600
cd ..
# Bounded fuzzing: each libFuzzer target (fuzz/) runs for KVTIER_FUZZ_SECONDS from its
# seed corpus, built with clang, ASan and UBSan in build-fuzz/.
bash fuzz/run.sh "${KVTIER_FUZZ_SECONDS:-30}"
