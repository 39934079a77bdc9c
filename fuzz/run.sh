#!/usr/bin/env bash
# Builds the libFuzzer targets with clang, ASan and UBSan in build-fuzz/ and runs each
# for SECONDS (default 30) from its committed seed corpus (fuzz/corpus/<target>), on
# a scratch copy so that the repository's corpus stays as committed. Fails on any
# crash, leak, sanitizer report or hang (a libFuzzer timeout, -timeout=25).
# Usage: fuzz/run.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-30}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(frame_splitter_fuzz tenants_file_fuzz config_fuzz requests_fuzz)
fi
build="${KVTIER_FUZZ_BUILD:-build-fuzz}"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
  -DCMAKE_CXX_COMPILER=clang++ -DKVTIER_FUZZ=ON -DKVTIER_BUILD_TESTS=OFF \
  -DKVTIER_BUILD_BENCH=OFF -DKVTIER_WITH_CUDA=OFF >/dev/null
cmake --build "$build" -j"$(nproc)" --target "${targets[@]}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for t in "${targets[@]}"; do
  mkdir -p "$work/$t"
  if [ -d "fuzz/corpus/$t" ]; then cp -r "fuzz/corpus/$t/." "$work/$t/"; fi
  echo "fuzz: $t for ${seconds}s"
  # Leak checks stay on; -rss_limit_mb bounds a runaway input. A failing input is kept
  # under build-fuzz/artifacts/ (not the working tree) for `build-fuzz/fuzz/$t FILE`.
  mkdir -p "$build/artifacts"
  "$build/fuzz/$t" -max_total_time="$seconds" -timeout=25 -rss_limit_mb=4096 \
    -artifact_prefix="$build/artifacts/$t-" -print_final_stats=1 "$work/$t" \
    2>"$work/$t.log" || {
    tail -60 "$work/$t.log"
    echo "fuzz: $t FAILED; reproducer(s): $(ls "$build/artifacts/$t-"* 2>/dev/null)" >&2
    exit 1
  }
  grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$work/$t.log" | sed "s/^/fuzz: $t /"
done
echo "fuzz: all targets clean"
