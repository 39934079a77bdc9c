#!/usr/bin/env bash
# Bundles what the GPU checks need (the `gpu` tests, kvtierd, the two GPU benchmarks)
# with the shared libraries they load from this build machine (gRPC, protobuf, Abseil,
# RocksDB, ... but not glibc, nor the NVIDIA driver, which the GPU host has), so that
# they run on a GPU host that has a driver but none of this build's packages:
#
#   bash bench/gpu_bundle.sh build DIR     # here: DIR/bin, DIR/lib, DIR/run.sh
#   bash DIR/run.sh OUT                    # there: tests, then benchmarks, into OUT
#
# CUDA's runtime is linked statically; the binaries find the driver (libcuda.so.1) on the
# GPU host as any CUDA program does. On a GPU host with this project's build
# dependencies installed, `ctest -L gpu` and the benchmark commands in run.sh are all
# there is to it.
set -euo pipefail
build=${1:?usage: gpu_bundle.sh BUILD_DIR OUT_DIR}
out=${2:?usage: gpu_bundle.sh BUILD_DIR OUT_DIR}
bins=(server/kvtierd tests/cuda_device_backend_test tests/daemon_gpu_test bench/gpu_bench
      bench/gpu_worker_bench)
rm -rf "$out"
for b in "${bins[@]}"; do
  test -x "$build/$b" || { echo "gpu_bundle: $build/$b is not built (CUDA toolkit?)" >&2; exit 1; }
done
bash "$(dirname "$0")/bundle.sh" "$out" "${bins[@]/#/$build/}"
cat > "$out/run.sh" <<'EOF'
#!/usr/bin/env bash
# The GPU checks from a bundle: the `gpu` tests, then the benchmarks. Into OUT: run.log
# (everything printed), gpu.jsonl and gpu_worker.jsonl (results), layerwise.csv and
# prefill.csv (timelines), daemon-logs.tar.gz (the kvtierd logs of the run).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: run.sh OUT}
mkdir -p "$out"
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KVTIERD_BINARY="$here/bin/kvtierd"
export TMPDIR=$(mktemp -d)
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
  rc=0
  for t in cuda_device_backend_test daemon_gpu_test; do
    timeout 120 "$here/bin/$t" || rc=1
  done
  echo "gpu tests: $([ $rc -eq 0 ] && echo passed || echo FAILED)"
  timeout 60 "$here/bin/gpu_bench" --sizes-mib=32,128 --reps=20 --json="$out/gpu.jsonl"
  timeout 200 "$here/bin/gpu_worker_bench" --sizes-mib=32,128 --reps=10 --chunks=12 --layers=32 \
    --json="$out/gpu_worker.jsonl" --timeline-dir="$out"
} 2>&1 | tee "$out/run.log"
find "$TMPDIR" -name '*.log' -print0 | tar -czf "$out/daemon-logs.tar.gz" --null -T - 2>/dev/null
grep -q '^gpu tests: passed' "$out/run.log"
EOF
chmod +x "$out/run.sh"
du -sh "$out"
