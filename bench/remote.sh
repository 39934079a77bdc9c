#!/usr/bin/env bash
# Issue 14's shared-tier targets, into bench/results/remote/ (read by bench/report.py):
#  1. throughput: the remote tier's put and get against raw Redis Cluster SET and GET of
#     the same segments, on a three-master cluster remote_bench starts on loopback;
#  2. the cluster down: RAM-tier put/get of a daemon whose shared tier points at an
#     address where nothing listens, against a daemon with no shared tier, interleaved;
#  3. the trace spread round robin over three daemons, alone and sharing a cluster,
#     beside one daemon holding everything (cache_bench --section=shared).
#
#   bash bench/remote.sh [BUILD_BENCH_DIR] [ROUNDS]    # default build/bench, 5; ~9 min
#
# then regenerate the report:
#   /usr/bin/python3 bench/report.py bench/results bench/results_header.md bench/RESULTS.md
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
B=${1:-build/bench}
ROUNDS=${2:-5}
OUT=bench/results/remote
TRACE=${KVTIER_TRACE:-$ROOT/../shared/data/traces/mooncake_synthetic_trace.jsonl}
mkdir -p "$OUT"
rm -f "$OUT"/*.jsonl "$OUT/commands.txt" "$OUT"/*.log
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
note() {
  echo "$*" | sed "s|$B/|build/bench/|; s|$WORK|<tmp>|g; s|$ROOT/||g; s|$TRACE|<trace>|" \
    >> "$OUT/commands.txt"
}

# 1. Remote tier against raw SET/GET (JSON lines on stderr).
ARGS=(--chunks=16 --budget-mib=256 --rounds=5)
note "$B/remote_bench ${ARGS[*]}"
"$B/remote_bench" "${ARGS[@]}" 2> "$OUT/remote.log"
grep '^{' "$OUT/remote.log" > "$OUT/remote.jsonl"

# 2. The local tiers with the cluster down. 127.0.0.1:1 refuses connections, as a
# cluster whose nodes are all down does.
COMMON=(--section=grid --tier=ram --ram-mib=2048 --hot-mib=512 --budget-mib=1024
        --min-ops-per-client=3 --chunks=2,32 --clients=1,4 --json="$OUT/local.jsonl")
run_local() {
  local name=$1; shift
  note "$B/kv_bench ${COMMON[*]} $*"
  echo "== $name: $*" >&2
  "$B/kv_bench" "${COMMON[@]}" --data-dir="$WORK/data-$name" "$@" >> "$OUT/local-$name.log" 2>&1
  rm -rf "$WORK/data-$name"
}
# The order alternates (none, down; down, none; ...): whichever runs first in a pair
# was measured slower, by up to 30% on this VM.
for r in $(seq "$ROUNDS"); do
  if [ $((r % 2)) -eq 1 ]; then
    run_local none --label=no-remote
    run_local down --label=cluster-down --remote-seeds=127.0.0.1:1
  else
    run_local down --label=cluster-down --remote-seeds=127.0.0.1:1
    run_local none --label=no-remote
  fi
done

# 3. Three daemons round robin, alone and sharing a cluster, beside one holding all.
SHARED=(--section=shared --trace="$TRACE" --daemons=3 --shared-fracs=10,100 --compress=20
        --workers=8 --json="$OUT/shared.jsonl")
note "$B/cache_bench ${SHARED[*]}"
"$B/cache_bench" "${SHARED[@]}" > "$OUT/shared.log" 2>&1
echo "remote: $(wc -l < "$OUT/remote.jsonl") throughput rows, $(grep -c '"kind": *"cell"' \
  "$OUT/local.jsonl") local cells, $(grep -c shared_cell "$OUT/shared.jsonl") shared cells" >&2
