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
  echo "build/bench/overload_bench $* --label=$name --json=$OUT/overload.jsonl" >> "$OUT/commands.txt"
  echo "== $name: $*" >&2
  "$B/overload_bench" --data-dir="$WORK/$name" --json="$OUT/overload.jsonl" "$@" --label="$name" \
    > "$OUT/$name.log" 2>&1 || echo "$name: exit $?" >> "$OUT/$name.log"
  rm -rf "$WORK/$name"
  cat "$OUT/$name.log" | grep -v '^{' >&2
}
run shipped
# The defaults before 0df07cc: an eighth of the pool for Put streams (42 here), a line of
# 64 (the rest refused, to retry), and stalled holders kept until client_idle_timeout.
run before --daemon-args=--max-put-buffer=256MiB,--max-put-waiters=64,--put-place-idle=0
run unbounded --daemon-args=--max-put-buffer=64GiB
# Four more clients send 256 MiB Put frames (the limit is 4 MiB) again and again; the
# idle timeout is long enough for such a frame to arrive. gRPC assembles a message
# before its size check, so grpc_memory is what bounds them: at its default (half the
# memory beside the pool) and set low enough for them to reach it.
run hostile --oversized=4 --idle-timeout-s=30
run hostile_bounded --oversized=4 --idle-timeout-s=30 --daemon-args=--grpc-memory=512MiB
