#!/usr/bin/env bash
# Installs what is missing, builds, and starts kvtierd in the foreground on its embedded
# defaults (gRPC on 127.0.0.1:50051, data in ./var/kvtier). Extra arguments go to
# kvtierd, e.g. `bash scripts/start.sh --ram-capacity=4GiB`. Stop it with Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
kvtier_install_deps
kvtier_build build
exec ./build/server/kvtierd "$@"
