#!/usr/bin/env bash
# Clang's thread-safety analysis over every daemon and client source: the
# ABSL_GUARDED_BY / ABSL_EXCLUSIVE_LOCKS_REQUIRED annotations are checked, and a
# violation fails the suite (GCC, which builds the binaries, ignores them).
# Usage: thread_safety_check.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src="$1"
build="$2"
clangxx="$(command -v clang++ || command -v clang++-14 || true)"
if [ -z "$clangxx" ]; then
  echo "clang++ not found (Debian package clang)" >&2
  exit 1
fi
cd "$src"
ls server/*.cc storage/*.cc scheduler/*.cc client/*.cc |
  xargs -P"$(nproc)" -n4 "$clangxx" -fsyntax-only -std=c++20 -Wthread-safety \
    -Werror=thread-safety -Wno-unused-parameter -I"$src" -I"$build" -I"$build/proto"
echo "thread-safety analysis: clean"
