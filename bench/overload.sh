#!/usr/bin/env bash
# Issue 13's overload target, into bench/results/overload/ (read by bench/report.py):
# 256 put streams totalling 10x a 2 GiB pool plus 32 stalled clients, against kvtierd as
# shipped (max_put_buffer at its default) and with the bound lifted (the baseline: what
# the same load costs without it).
#
#   bash bench/overload.sh [BUILD_BENCH_DIR]     # default build/bench
#
# then regenerate the report:
#   /usr/bin/python3 bench/report.py bench/results bench/results_header.md bench/RESULTS.md
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
B=${1:-build/bench}
OUT=bench/results/overload
mkdir -p "$OUT"
rm -f "$OUT/overload.jsonl" "$OUT/commands.txt" "$OUT"/*.log
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
run() {
  local name=$1; shift
  echo "build/bench/overload_bench $* --json=$OUT/overload.jsonl" >> "$OUT/commands.txt"
  echo "== $name: $*" >&2
  "$B/overload_bench" --data-dir="$WORK/$name" --json="$OUT/overload.jsonl" "$@" \
    > "$OUT/$name.log" 2>&1 || echo "$name: exit $?" >> "$OUT/$name.log"
  rm -rf "$WORK/$name"
  cat "$OUT/$name.log" | grep -v '^{' >&2
}
run shipped
run unbounded --daemon-args=--max-put-buffer=64GiB
