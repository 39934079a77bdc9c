#!/usr/bin/env bash
# Profiles the RAM-tier Get path: kv_bench reads 32 MiB chunks from a ram-only kvtierd
# (no put cells), while `perf record` samples the whole machine (cpu-clock; the VM has no
# hardware counters). Prints per-process and per-symbol shares for kvtierd and kv_bench.
#
#   bash bench/profile_get.sh [CLIENTS=1] [CHUNK_MIB=32]     (after bench/run.sh built)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${KVTIER_BENCH_BUILD:-$ROOT/build}
CLIENTS=${1:-1}
CHUNK=${2:-32}
OUT=${KVTIER_PROFILE_OUT:-$ROOT/bench/results/profile}
mkdir -p "$OUT" "$ROOT/var/bench"
"$BUILD/bench/kv_bench" --section=grid --tier=ram --skip-puts=1 --ram-mib=2048 --hot-mib=1024 \
  --chunks="$CHUNK" --clients="$CLIENTS" --get-budget-mib=24576 --data-dir="$ROOT/var/bench" \
  > "$OUT/kv_bench.log" 2>&1 &
BENCH=$!
sleep 6   # Past start-up and the hot-set puts.
perf record -a -g -e cpu-clock -F 999 -o "$OUT/perf.data" -- sleep 8 2> "$OUT/perf-record.log"
wait "$BENCH" || true
grep '^|' "$OUT/kv_bench.log" | tail -1
perf report -i "$OUT/perf.data" --stdio --no-children --sort comm 2>/dev/null | grep -v '^#' | grep '%' | head -8
perf report -i "$OUT/perf.data" --stdio --no-children --sort comm,dso,sym -g none 2>/dev/null \
  | grep -v '^#' | grep '%' | head -40
