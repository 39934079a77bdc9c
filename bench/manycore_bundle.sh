#!/usr/bin/env bash
# Issue 10's RAM put of 2 MiB chunks against Redis SET, and issue 13's TLS against
# plaintext, both miss on the 2-core VM where bench/run.sh runs (RESULTS.md). Both are
# CPU-bound there: the client, the daemon and the cipher share two cores. This bundle
# reruns those cells on a larger host, once pinned to two of its cores and once on all
# of them, so the same machine says what the core count does to each ratio.
#
#   bash bench/manycore_bundle.sh build DIR   # here: DIR/bin, DIR/lib, DIR/certs, DIR/run.sh
#   bash DIR/run.sh OUT [ROUNDS]              # there: into OUT/manycore.jsonl and OUT/run.log
#   bash DIR/pin.sh OUT [ROUNDS]              # there: where the threads run, into OUT/pin.jsonl
#
# The host needs none of this build's packages (bench/bundle.sh copies the libraries).
set -euo pipefail
build=${1:?usage: manycore_bundle.sh BUILD_DIR OUT_DIR}
out=${2:?usage: manycore_bundle.sh BUILD_DIR OUT_DIR}
rm -rf "$out"
bash "$(dirname "$0")/bundle.sh" "$out" "$build/server/kvtierd" "$build/bench/kv_bench" \
  "$build/bench/redis_bench" "$(command -v redis-server)"
bash "$(dirname "$0")/../tests/tls/make_test_certs.sh" "$out/certs" >/dev/null
cat > "$out/common.sh" <<'EOS'
# Sourced by run.sh and pin.sh: the bundle's libraries, a scratch folder, all CPUs, and
# the RAM-tier cells both run (bench/security.sh's arguments).
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
work=$(mktemp -d)
all="0-$(($(nproc) - 1))"
common=(--section=grid --tier=ram --ram-mib=2048 --hot-mib=512 --budget-mib=1024
        --min-ops-per-client=3 --chunks=2,32 --clients=1,4)
EOS
cat > "$out/run.sh" <<'EOS'
#!/usr/bin/env bash
# Rounds of: kvtierd plaintext and TLS (2 and 32 MiB chunks, 1 and 4 clients, the
# arguments of bench/security.sh), then Redis (2 MiB, 1 and 4 clients, the arguments of
# bench/run.sh), first on CPUs 0-1 (taskset), then on all CPUs. Every cell is a line of
# OUT/manycore.jsonl whose "tier" names the variant and the CPU set.
set -uo pipefail
out=${1:?usage: run.sh OUT [ROUNDS]}
rounds=${2:-3}
mkdir -p "$out"
. "$(dirname "$0")/common.sh"
export KVTIERD_BINARY="$here/bin/kvtierd"
json="$out/manycore.jsonl"
{
  echo "cpu: $(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1), $(nproc) CPUs"
  for cpus in 0-1 "$all"; do
    tag=$([ "$cpus" = 0-1 ] && echo 2cpu || echo "$(nproc)cpu")
    for r in $(seq "$rounds"); do
      timeout 120 taskset -c "$cpus" "$here/bin/kv_bench" "${common[@]}" --data-dir="$work/d" \
        --label="plaintext-$tag" --json="$json" 2>>"$out/stderr.log" | grep '^|' ; rm -rf "$work/d"
      timeout 120 taskset -c "$cpus" "$here/bin/kv_bench" "${common[@]}" --data-dir="$work/d" \
        --label="tls-$tag" --tls-dir="$here/certs" --json="$json" 2>>"$out/stderr.log" | grep '^|'; rm -rf "$work/d"
    done
    port=$((20000 + RANDOM % 20000))
    taskset -c "$cpus" "$here/bin/redis-server" --port "$port" --bind 127.0.0.1 --save '' \
      --appendonly no --maxmemory 12gb --proto-max-bulk-len 512mb \
      --client-output-buffer-limit 'normal 0 0 0' --dir "$work" --daemonize no >/dev/null &
    redis=$!
    sleep 1
    timeout 120 taskset -c "$cpus" "$here/bin/redis_bench" --port="$port" --chunks=2 \
      --clients=1,4 --budget-mib=1536 --hot-mib=1024 --json="$work/redis.jsonl" 2>>"$out/stderr.log" | grep '^|'
    sed "s/\"tier\": \"redis\"/\"tier\": \"redis-$tag\"/" "$work/redis.jsonl" >> "$json"
    rm -f "$work/redis.jsonl"
    kill "$redis"; wait "$redis" 2>/dev/null
  done
} 2>&1 | tee "$out/run.log"
rm -rf "$work"
EOS
cat > "$out/pin.sh" <<'EOS'
#!/usr/bin/env bash
# Plaintext RAM-tier cells (2 and 32 MiB, 1 and 4 clients) with the client and the
# daemon on chosen CPUs: both free on all CPUs, both on CPUs 0-1, the client on 0-1 and
# the daemon on 2-3, each on four CPUs of its own. kv_bench starts kvtierd through
# KVTIERD_BINARY, here a wrapper that pins it. Cells go to OUT/pin.jsonl, "tier" naming
# the placement.
set -uo pipefail
out=${1:?usage: pin.sh OUT [ROUNDS]}
rounds=${2:-2}
mkdir -p "$out"
. "$(dirname "$0")/common.sh"
common+=(--json="$out/pin.jsonl")
# placement: client CPUs, daemon CPUs.
placements=("free $all $all" "shared2 0-1 0-1" "apart2 0-1 2-3" "apart4 0-3 4-7")
for r in $(seq "$rounds"); do
  for p in "${placements[@]}"; do
    read -r name client daemon <<<"$p"
    printf '#!/bin/sh\nexec taskset -c %s %s "$@"\n' "$daemon" "$here/bin/kvtierd" > "$work/kvtierd"
    chmod +x "$work/kvtierd"
    KVTIERD_BINARY="$work/kvtierd" timeout 120 taskset -c "$client" "$here/bin/kv_bench" \
      "${common[@]}" --data-dir="$work/d" --label="$name" 2>>"$out/stderr.log" | grep '^| [a-z]'
    rm -rf "$work/d"
  done
done 2>&1 | tee "$out/pin.log"
cat /proc/sys/net/ipv4/tcp_available_ulp > "$out/ulp.txt" 2>&1
rm -rf "$work"
EOS
chmod +x "$out/run.sh" "$out/pin.sh"
du -sh "$out"
