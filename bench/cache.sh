#!/usr/bin/env bash
# Eviction policies and scheduler hints on the Mooncake trace (cache_bench), into
# bench/results/cache/ (read by bench/report.py). Run by bench/run.sh; alone:
#
#   bash bench/cache.sh [BUILD_BENCH_DIR]    # default build/bench, about 10 minutes
#
# then regenerate the report:
#   /usr/bin/python3 bench/report.py bench/results bench/results_header.md bench/RESULTS.md
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
B=${1:-build/bench}
OUT=bench/results/cache
TRACE=${KVTIER_TRACE:-$ROOT/../shared/data/traces/mooncake_synthetic_trace.jsonl}
mkdir -p "$OUT"
rm -f "$OUT/cache.jsonl" "$OUT/commands.txt" "$OUT"/*.log
run() {
  local name=$1; shift
  echo "$*" | sed "s|$B/|build/bench/|; s|$ROOT/||g; s|$TRACE|<trace>|" >> "$OUT/commands.txt"
  echo "== $name: $*" >&2
  "$@" > "$OUT/$name.log" 2>&1 || echo "!! $name exited $?" | tee -a "$OUT/$name.log" >&2
}
run policies "$B/cache_bench" --section=policies --trace="$TRACE" --fracs=5,10,20 \
  --policies=lru,prefix-lru,prefix-cost --hint-depth=32 --json="$OUT/cache.jsonl"
run timed "$B/cache_bench" --section=timed --trace="$TRACE" --timed-frac=5 --hint-depth=32 \
  --compress="${KVTIER_CACHE_COMPRESS:-20}" --workers=16 --timed-hints=0,32 --hint-every=1 \
  --json="$OUT/cache.jsonl"
# The same hints refreshed every 4 dispatches: what a scheduler that hints per step pays.
run timed4 "$B/cache_bench" --section=timed --trace="$TRACE" --timed-frac=5 --hint-depth=32 \
  --compress="${KVTIER_CACHE_COMPRESS:-20}" --workers=16 --timed-hints=32 --hint-every=4 \
  --json="$OUT/cache.jsonl"
