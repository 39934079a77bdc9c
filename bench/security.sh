#!/usr/bin/env bash
# What TLS and tenants cost on the RAM tier (issue 13's target: TLS within 15% of
# plaintext RAM-tier get throughput at 32 MiB), into bench/results/security/ (read by
# bench/report.py). Plaintext, TLS, and TLS with a tenant's bearer token, interleaved
# for --rounds rounds against a fresh daemon each; medians per cell.
#
#   bash bench/security.sh [BUILD_BENCH_DIR] [ROUNDS]    # default build/bench, 3
#
# then regenerate the report:
#   /usr/bin/python3 bench/report.py bench/results bench/results_header.md bench/RESULTS.md
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
B=${1:-build/bench}
ROUNDS=${2:-3}
OUT=bench/results/security
mkdir -p "$OUT"
rm -f "$OUT/security.jsonl" "$OUT/commands.txt" "$OUT"/*.log
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
bash tests/tls/make_test_certs.sh "$WORK/certs"
TOKEN=bench-token
printf 'tenant bench role=admin\ntoken bench sha256:%s\n' \
  "$(printf %s "$TOKEN" | sha256sum | cut -d' ' -f1)" > "$WORK/tenants"
COMMON=(--section=grid --tier=ram --ram-mib=2048 --hot-mib=512 --budget-mib=1024
        --min-ops-per-client=3 --chunks=2,32 --clients=1,4 --json="$OUT/security.jsonl")
run() {
  local name=$1; shift
  echo "$B/kv_bench ${COMMON[*]} $*" | sed "s|$B/|build/bench/|; s|$WORK|<tmp>|g; s|$ROOT/||g" \
    >> "$OUT/commands.txt"
  echo "== $name: $*" >&2
  "$B/kv_bench" "${COMMON[@]}" --data-dir="$WORK/data-$name" "$@" >> "$OUT/$name.log" 2>&1
  rm -rf "$WORK/data-$name"
}
for r in $(seq "$ROUNDS"); do
  run plain --label=plaintext
  run tls --label=tls --tls-dir="$WORK/certs"
  run tls_token --label=tls+token --tls-dir="$WORK/certs" --tenants-file="$WORK/tenants" \
    --token="$TOKEN"
done
# The ceiling of any TLS path here, in the same run: loopback TCP against OpenSSL TLS 1.3
# between two processes, no gRPC.
echo "$B/tls_ceiling_bench --tls-dir=$WORK/certs --rounds=$ROUNDS --json=$OUT/security.jsonl" |
  sed "s|$B/|build/bench/|; s|$WORK|<tmp>|g" >> "$OUT/commands.txt"
"$B/tls_ceiling_bench" --tls-dir="$WORK/certs" --rounds="$ROUNDS" --json="$OUT/security.jsonl" \
  > "$OUT/ceiling.log" 2>&1 || { cat "$OUT/ceiling.log" >&2; exit 1; }
cat "$OUT/ceiling.log" >&2
echo "security: $(grep -c '"kind": *"cell"' "$OUT/security.jsonl") cells in $OUT/security.jsonl" >&2
