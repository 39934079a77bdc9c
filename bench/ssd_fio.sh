#!/usr/bin/env bash
# The SSD tier against fio on the same disk, round by round (issue 10's targets: put at
# least 0.7 x fio's sequential write, get at least 0.8 x its sequential read). This VM's
# disk moves 1.3-2.6 GB/s from one fio run to the next, so one fio figure beside one
# grid says little: each round runs fio (write, read), then the SSD-tier grid over the
# gRPC stream, then over the same-host data plane (kv_bench --plane=shm: Put from and
# GetInto shared memory, no TCP), then fio again; a cell's ratio is taken against the
# mean of its round's two fio runs, and the report gives the median over rounds.
#
#   bash bench/ssd_fio.sh [BUILD_BENCH_DIR] [ROUNDS]    # default build/bench, 3
#   CHUNKS=2,32,128 CLIENTS=1,4,16,64 (the defaults) narrow the grid.
#
# Writes bench/results/ssd_fio/ (read by bench/report.py); then regenerate the report:
#   /usr/bin/python3 bench/report.py bench/results bench/results_header.md bench/RESULTS.md
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
B=${1:-build/bench}
ROUNDS=${2:-3}
CHUNKS=${CHUNKS:-2,32,128}
CLIENTS=${CLIENTS:-1,4,16,64}
OUT=bench/results/ssd_fio
DATA=${KVTIER_BENCH_DATA:-var/bench}
PY=/usr/bin/python3
for tool in fio "$B/kv_bench"; do
  command -v "$tool" >/dev/null || { echo "ssd_fio.sh: $tool not found" >&2; exit 1; }
done
mkdir -p "$OUT" "$DATA"
rm -f "$OUT/ssd_fio.jsonl" "$OUT/commands.txt" "$OUT"/*.log
# Put cells of 2 GiB each, as fio writes (and as bench/run.sh's SSD grid).
GRID=(--section=grid --tier=ssd --ram-mib=512 --budget-mib=2048 --get-budget-mib=512
      --min-mib-per-client=32
      "--chunks=$CHUNKS" "--clients=$CLIENTS")
FIO=(--direct=1 --bs=4m --iodepth=8 --ioengine=libaio --size=2g --output-format=json)
echo "bash bench/ssd_fio.sh $B $ROUNDS  (CHUNKS=$CHUNKS CLIENTS=$CLIENTS)" > "$OUT/commands.txt"
echo "fio --name=seq<rw> --filename=$DATA/fio.dat --rw=write|read ${FIO[*]}" >> "$OUT/commands.txt"
for plane in grpc shm; do
  echo "build/bench/kv_bench ${GRID[*]} --data-dir=$DATA/ssd_fio --plane=$plane --label=$plane" \
    >> "$OUT/commands.txt"
done

# Appends `"round": R` (and the fields given) to every JSON line on stdin.
tag() {
  $PY -c '
import json, sys
extra = json.loads(sys.argv[1])
for line in sys.stdin:
    if line.strip():
        row = json.loads(line)
        row.update(extra)
        print(json.dumps(row))' "$1"
}

fio_once() {  # round rw
  local f=$DATA/fio.dat
  if [ "$2" = read ] && [ ! -f "$f" ]; then
    fio --name=prep --filename="$f" --rw=write "${FIO[@]}" > /dev/null
  fi
  fio --name="seq$2" --filename="$f" --rw="$2" "${FIO[@]}" > "$OUT/fio_$1_$2.json"
  $PY -c '
import json, sys
job = json.load(open(sys.argv[1]))["jobs"][0]
print(json.dumps({"kind": "fio", "rw": sys.argv[2], "gbps": job[sys.argv[2]]["bw_bytes"] / 1e9}))' \
    "$OUT/fio_$1_$2.json" "$2" | tag "{\"round\": $1}" >> "$OUT/ssd_fio.jsonl"
}

for r in $(seq "$ROUNDS"); do
  fio_once "$r" write
  fio_once "$r" read
  rm -f "$DATA/fio.dat"
  for plane in grpc shm; do
    echo "== round $r: $plane" >&2
    rm -rf "$DATA/ssd_fio"
    "$B/kv_bench" "${GRID[@]}" --data-dir="$DATA/ssd_fio" --plane="$plane" --label="$plane" \
      --json="$OUT/round.jsonl" >> "$OUT/$plane.log" 2>&1
    tag "{\"round\": $r}" < "$OUT/round.jsonl" >> "$OUT/ssd_fio.jsonl"
    rm -f "$OUT/round.jsonl"
  done
  rm -rf "$DATA/ssd_fio"
  fio_once "$r" write
  fio_once "$r" read
  rm -f "$DATA/fio.dat"
done
rm -f "$OUT"/fio_*.json
echo "ssd_fio: $(grep -c '"cell"' "$OUT/ssd_fio.jsonl") cells in $OUT/ssd_fio.jsonl" >&2
