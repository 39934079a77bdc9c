#!/usr/bin/env bash
# The benchmark suite: one command, about 25 minutes on the 2-vCPU development VM.
#
#   bash bench/run.sh
#
# Installs the build and benchmark packages (scripts/deps.sh), builds the benchmark
# binaries into build/ (Release), runs every workload and baseline in this one run, and
# REWRITES bench/RESULTS.md (from bench/results_header.md, the raw results and the
# plots). Raw results and logs go to bench/results/ and plots to bench/plots/.
#
# Environment knobs (defaults in brackets):
#   KVTIER_BENCH_BUILD     build directory [build]
#   KVTIER_BENCH_JOBS      build parallelism [nproc]
#   KVTIER_BENCH_DATA      scratch dir for daemons, fio and redis (same disk) [var/bench]
#   KVTIER_BENCH_SKIP_DEPS=1  do not install packages
#   KVTIER_BENCH_SCALE     multiplies every byte budget [1]; 0.25 for a smoke run
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BUILD=${KVTIER_BENCH_BUILD:-build}
JOBS=${KVTIER_BENCH_JOBS:-$(nproc)}
DATA=${KVTIER_BENCH_DATA:-$ROOT/var/bench}
SCALE=${KVTIER_BENCH_SCALE:-1}
RES=bench/results
PLOTS=bench/plots
mkdir -p "$RES" "$PLOTS" "$DATA"
rm -f "$RES"/*.jsonl "$RES"/*.json "$RES"/*.log "$RES"/*.md "$RES"/commands.txt "$RES"/fio_*_rounds.txt

mib() { python3 -c "import sys; print(max(1, int(float(sys.argv[1]) * $SCALE)))" "$1"; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# step NAME CMD...: records the exact command, runs it, keeps its output in $RES/NAME.log.
step() {
  local name=$1; shift
  printf '%s\t%s\n' "$name" "$*" >> "$RES/commands.txt"
  echo "== $name: $*" >&2
  local t0=$SECONDS
  "$@" > "$RES/$name.log" 2>&1 || echo "!! $name exited $?" | tee -a "$RES/$name.log" >&2
  echo "   ($((SECONDS - t0)) s)" >&2
}

T0=$SECONDS
if [ "${KVTIER_BENCH_SKIP_DEPS:-0}" != 1 ]; then
  # shellcheck source=../scripts/deps.sh
  source scripts/deps.sh
  kvtier_install_deps
  kvtier_install_bench_deps
fi

cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j"$JOBS" --target kvtierd kv_bench redis_bench rss_bench samehost_bench
cmake --build "$BUILD" -j"$JOBS" --target gpu_bench gpu_worker_bench 2>/dev/null || true  # CUDA builds only.
# Another engineer's planner benchmark; included when it builds.
cmake --build "$BUILD" -j"$JOBS" --target cake_bench >/dev/null 2>&1 || true
B=$BUILD/bench
JSON=$RES/results.jsonl

# ---- machine ----
{
  echo "cpu: $(lscpu | sed -n 's/^Model name: *//p' | head -1)"
  echo "cores: $(nproc) online ($(lscpu | sed -n 's/^CPU(s): *//p'))"
  echo "ram: $(free -g | awk '/^Mem:/{print $2}') GiB"
  echo "disk: $(df -h "$DATA" | awk 'NR==2{print $1", "$2" total, "$4" free"}') ($(findmnt -n -o FSTYPE --target "$DATA" 2>/dev/null || echo ?))"
  echo "kernel: $(uname -sr)"
  echo "os: $(. /etc/os-release; echo "$PRETTY_NAME")"
  echo "compiler: $(c++ --version | head -1)"
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "commit: ${KVTIER_BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}$(git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
} > "$RES/machine.txt"

# ---- baselines ----
step memcpy "$B/kv_bench" --section=memcpy --memcpy-mib=1024 --runs=7 --json="$JSON"

P=$(free_port)
iperf3 -s -1 -p "$P" >/dev/null 2>&1 &
IPERF=$!
sleep 0.5
step iperf3 iperf3 -c 127.0.0.1 -p "$P" -t 5 -J
wait "$IPERF" 2>/dev/null || true
cp "$RES/iperf3.log" "$RES/iperf3.json"

FIO_FILE=$DATA/fio.dat
FIO_DIRECT=1
if ! python3 -c "import os,sys; os.close(os.open(sys.argv[1], os.O_CREAT|os.O_WRONLY|os.O_DIRECT))" "$FIO_FILE.probe" 2>/dev/null; then
  FIO_DIRECT=0
  echo "O_DIRECT unsupported on $DATA: fio runs buffered" > "$RES/fio_note.txt"
fi
rm -f "$FIO_FILE.probe"
FIO_SIZE=${KVTIER_BENCH_FIO_SIZE:-2g}
# Three rounds, write then read in each; fio_<rw>.json is the round of median bandwidth.
# One 2 GiB run lasts 1-2 s on this disk and swung 1.14-1.94 GB/s (read) between runs.
for round in 1 2 3; do
  for rw in write read; do
    step "fio_${rw}_$round" fio --name="seq$rw" --filename="$FIO_FILE" --direct=$FIO_DIRECT \
      --rw=$rw --bs=4m --size="$FIO_SIZE" --ioengine=libaio --iodepth=8 --output-format=json
  done
done
for rw in write read; do
  /usr/bin/python3 - "$RES" "$rw" <<'PY'
import json, shutil, sys
res, rw = sys.argv[1], sys.argv[2]
runs = []
for r in (1, 2, 3):
    path = f"{res}/fio_{rw}_{r}.log"
    try:
        runs.append((json.load(open(path))["jobs"][0][rw]["bw_bytes"], path))
    except (OSError, ValueError, KeyError, IndexError):
        pass
if runs:
    runs.sort()
    shutil.copy(runs[(len(runs) - 1) // 2][1], f"{res}/fio_{rw}.json")
    with open(f"{res}/fio_{rw}_rounds.txt", "w") as out:
        out.write(" ".join(f"{bw / 1e9:.2f}" for bw, _ in runs) + " GB/s\n")
PY
done
rm -f "$FIO_FILE"

# ---- kvtier ----
step kv_ram "$B/kv_bench" --section=grid --tier=ram --ram-mib=4096 --hot-mib=1024 \
  --budget-mib="$(mib 1536)" --min-ops-per-client=3 --min-mib-per-client="$(mib 96)" \
  --equal-cells=1 --rounds=3 \
  --chunks=2,32,128 --clients=1,4,16,64 \
  --data-dir="$DATA" --json="$JSON"
step kv_ssd "$B/kv_bench" --section=grid --tier=ssd --ram-mib=512 \
  --budget-mib="$(mib 2048)" --get-budget-mib="$(mib 512)" --min-mib-per-client="$(mib 32)" \
  --rounds=3 --chunks=2,32,128 \
  --clients=1,4,16,64 --data-dir="$DATA" --json="$JSON"
step kv_lookup "$B/kv_bench" --section=lookup --keys=256 --samples=5000 --clients=1,4 \
  --data-dir="$DATA" --json="$JSON"
step kv_trace "$B/kv_bench" --section=trace \
  --trace="${KVTIER_TRACE:-$ROOT/../shared/data/traces/mooncake_synthetic_trace.jsonl}" \
  --trace-requests="$(mib 4000)" --trace-chunk-kib=64 --ram-mib=256 --compress=1000 --workers=16 \
  --data-dir="$DATA" --json="$JSON"

# ---- Redis ----
P=$(free_port)
mkdir -p "$DATA/redis"
redis-server --port "$P" --bind 127.0.0.1 --save '' --appendonly no --maxmemory 12gb \
  --proto-max-bulk-len 512mb --client-output-buffer-limit 'normal 0 0 0' \
  --dir "$DATA/redis" --daemonize no > "$RES/redis-server.log" 2>&1 &
REDIS=$!
for _ in $(seq 50); do redis-cli -p "$P" ping >/dev/null 2>&1 && break; sleep 0.1; done
echo "redis-server --port $P --bind 127.0.0.1 --save '' --appendonly no --maxmemory 12gb --proto-max-bulk-len 512mb --client-output-buffer-limit 'normal 0 0 0'  ($(redis-server --version | cut -d' ' -f3))" > "$RES/redis_cmd.txt"
step redis "$B/redis_bench" --port="$P" --chunks=2,32,128 --clients=1,4,16,64 \
  --budget-mib="$(mib 1536)" --hot-mib=1024 --json="$JSON"
redis-cli -p "$P" shutdown nosave >/dev/null 2>&1 || kill "$REDIS"
wait "$REDIS" 2>/dev/null || true

# ---- same host: shared memory vs gRPC, memcpy, loopback TCP (its own folder) ----
mkdir -p "$RES/samehost"
rm -f "$RES/samehost/samehost.jsonl"
SAMEHOST=("$B/samehost_bench" --chunks=2,32,128 --clients=1,4,16 --budget-mib="$(mib 2048)"
          --shm-budget-mib="$(mib 8192)"
          --regions=1000 --json="$RES/samehost/samehost.jsonl")
echo "${SAMEHOST[*]}" | sed "s|$B/|build/bench/|; s|$RES/|bench/results/|" > "$RES/samehost/command.txt"
cp "$RES/machine.txt" "$RES/samehost/machine.txt"
step samehost "${SAMEHOST[@]}"
cp "$RES/samehost.log" "$RES/samehost/samehost.log"
/usr/bin/python3 bench/plot_samehost.py "$RES/samehost" || true

# ---- eviction policies and hints on the trace (its own folder; bench/cache.sh reruns it alone) ----
bash bench/cache.sh "$B"

# ---- resident memory, planner ----
step rss "$B/rss_bench" --mode=write-back
if [ -x "$B/cake_bench" ]; then step cake "$B/cake_bench"; fi
# ---- GPU tier vs cudaMemcpyAsync from pinned memory (CUDA builds on a GPU host; the
# results of the last GPU run, in $RES/gpu, stay as they are without one) ----
if [ -x "$B/gpu_bench" ] && [ -x "$B/gpu_worker_bench" ] && nvidia-smi -L >/dev/null 2>&1; then
  rm -f "$RES/gpu/gpu.jsonl" "$RES/gpu/gpu_worker.jsonl"
  mkdir -p "$RES/gpu"
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
    --format=csv > "$RES/gpu/device.txt"
  step gpu "$B/gpu_bench" --sizes-mib=32,128 --reps=20 --json="$RES/gpu/gpu.jsonl"
  step gpu_worker "$B/gpu_worker_bench" --sizes-mib=32,128 --reps=10 --chunks=12 --layers=32 \
    --json="$RES/gpu/gpu_worker.jsonl" --timeline-dir="$RES/gpu"
  /usr/bin/python3 bench/plot_gpu.py "$RES/gpu"
fi

echo "suite took $((SECONDS - T0)) s" >> "$RES/machine.txt"
/usr/bin/python3 bench/plot.py "$RES" "$PLOTS"
/usr/bin/python3 bench/report.py "$RES" bench/results_header.md bench/RESULTS.md
echo "wrote bench/RESULTS.md ($((SECONDS - T0)) s)" >&2
