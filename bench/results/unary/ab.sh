#!/bin/bash
cd /work/main
OUT=/tmp/ab_unary
rm -rf $OUT; mkdir -p $OUT
for r in 1 2; do
  for v in new old; do
    if [ $v = old ]; then export KVTIERD_BINARY=/tmp/h20/bin/kvtierd; else unset KVTIERD_BINARY; fi
    d=$(mktemp -d)
    timeout 300 build/bench/kv_bench --section=lookup --keys=256 --samples=5000 --clients=1,4 --data-dir=$d --label=$v-r$r --json=$OUT/lookup.jsonl > $OUT/lookup_$v$r.log 2>&1; echo "lookup $v r$r rc=$?"
    rm -rf $d
  done
done
for v in new old; do
  if [ $v = old ]; then export KVTIERD_BINARY=/tmp/h20/bin/kvtierd; else unset KVTIERD_BINARY; fi
  d=$(mktemp -d)
  timeout 900 build/bench/overload_bench --data-dir=$d/x --json=$OUT/overload.jsonl --label=$v > $OUT/overload_$v.log 2>&1; echo "overload $v rc=$?"
  rm -rf $d
done
