#!/usr/bin/python3
"""SSD write amplification under churn (issue 10): puts of ten times ssd_capacity into a
full SSD tier, plain LRU (no deletes, no reads), in write-through and in write-back with
its flusher threads. Reports, per mode, the payload bytes put, the bytes the daemon wrote
to the device (/proc/PID/io write_bytes, the issue's measure), their ratio, and the bytes
garbage collection moved (kvtier_ssd_gc_bytes_total). The target is at most 1.15 device
bytes per payload byte.

  PYTHONPATH=build/python /usr/bin/python3 bench/churn_bench.py [--rounds=3] [--json=FILE]

The daemon is build/server/kvtierd, or $KVTIERD_BINARY (an A/B against another build).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request

import numpy as np

import kvtier
from kvtier.testing import Daemon

MiB = 1 << 20


def metric(daemon, name):
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics").read()
    for line in text.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            if line.split(" ")[0] == name:
                return float(line.split(" ")[1])
    raise KeyError(name)


def device_write_bytes(pid):
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    raise KeyError("write_bytes")


def one_run(mode, ssd_mib, ram_mib, chunk_kib, threads):
    layout = kvtier.Layout("churn-bench", dtype="float16", num_layers=1, num_kv_heads=1,
                           head_dim=chunk_kib * 1024 // 2 // 2 // 16, tokens_per_chunk=16)
    args = [f"--ram-capacity={ram_mib}MiB", f"--ssd-capacity={ssd_mib}MiB",
            f"--write-mode={mode}"]
    if mode == "write-back":
        args.append(f"--writeback-threads={threads}")
    with tempfile.TemporaryDirectory(prefix="churn-bench-") as tmp:
        daemon = Daemon(os.path.join(tmp, "data"), args=args)
        try:
            client = kvtier.Client(daemon.target, connect_timeout=30)
            ns = client.register_layout(layout).namespace_id
            chunk = layout.chunk_bytes
            rng = np.random.default_rng(7)
            payloads = [rng.integers(0, 255, chunk, dtype=np.uint8) for _ in range(64)]
            start_io = device_write_bytes(daemon.proc.pid)
            total = 10 * ssd_mib * MiB
            put = 0
            n = 0
            t0 = time.perf_counter()
            while put < total:
                keys = [k.to_bytes(16, "little") for k in range(n, n + 8)]
                client.put(ns, keys, [payloads[(n + j) % 64] for j in range(8)])
                n += 8
                put += 8 * chunk
            if mode == "write-back":
                # Until the flusher has written everything put (the backlog is empty).
                while metric(daemon, "kvtier_writeback_dirty_bytes") > 0:
                    time.sleep(0.05)
            seconds = time.perf_counter() - t0
            written = device_write_bytes(daemon.proc.pid) - start_io
            gc = metric(daemon, "kvtier_ssd_gc_bytes_total")
            client.close()
        finally:
            daemon.close()
    return {"mode": mode, "put_bytes": put, "device_bytes": written, "gc_bytes": gc,
            "ratio": written / put, "seconds": seconds}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ssd-mib", type=int, default=64)
    p.add_argument("--ram-mib", type=int, default=16)
    p.add_argument("--chunk-kib", type=int, default=128)
    p.add_argument("--writeback-threads", type=int, default=4)
    p.add_argument("--label", default="")
    p.add_argument("--json", default="")
    a = p.parse_args()
    rows = []
    for r in range(a.rounds):
        for mode in ("write-through", "write-back"):
            row = one_run(mode, a.ssd_mib, a.ram_mib, a.chunk_kib, a.writeback_threads)
            row.update(round=r, label=a.label, ssd_mib=a.ssd_mib, chunk_kib=a.chunk_kib)
            rows.append(row)
            print(f"round {r} {mode:13s}: put {row['put_bytes'] / MiB:.0f} MiB, device "
                  f"{row['device_bytes'] / MiB:.0f} MiB ({row['ratio']:.3f} per payload byte), "
                  f"GC moved {row['gc_bytes'] / MiB:.0f} MiB", flush=True)
            if a.json:
                with open(a.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
    for mode in ("write-through", "write-back"):
        ratios = [r["ratio"] for r in rows if r["mode"] == mode]
        gcs = [r["gc_bytes"] / MiB for r in rows if r["mode"] == mode]
        print(f"median {mode:13s}: {statistics.median(ratios):.3f} device bytes per payload "
              f"byte, GC {statistics.median(gcs):.0f} MiB (target <= 1.15)")


if __name__ == "__main__":
    sys.exit(main())
