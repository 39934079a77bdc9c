#!/usr/bin/python3
"""Python client vs C++ client: put and get throughput, side by side in one run.

    PYTHONPATH=build/python /usr/bin/python3 bench/py_client_bench.py \
        [--sizes 2,32,128] [--reps 5] [--budget-mib 512] [--out bench/results/python]

One kvtierd (RAM tier: --write-mode=ram-only, a pool that holds every cell) serves three
implementations in turn, interleaved per repetition so drift hits all alike:
  cpp     build/bench/client_bench: the C++ client, get into one preallocated buffer.
  python  kvtier.Client (the pybind11 binding): put from a numpy buffer, get_into a
          preallocated numpy buffer.
  grpcio  the alternative we measured before choosing the binding: Debian's grpcio with
          the generated stubs (kvtier.v1.kvtier_pb2_grpc), frames built and parsed as
          protobuf messages, each get frame copied into the same preallocated buffer.
Each cell moves --budget-mib MiB (at least 2 chunks) over one connection. Reports the
median GB/s of the repetitions and python/cpp ratios; writes py_client.jsonl and
py_client.md under --out.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import kvtier
from kvtier.testing import Daemon

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def layout_for(chunk_mib):
    return kvtier.Layout("bench-layout", dtype="bfloat16", num_layers=32, num_kv_heads=8,
                         head_dim=128, tokens_per_chunk=chunk_mib * 8)


def keys_for(ns, seed, ops):
    # Same keys as client_bench computes: FirstChunkKey(ns, [seed, i, 0xC0FFEE]).
    return [kvtier.chunk_keys(ns, [seed, i, 0xC0FFEE], 3)[0] for i in range(ops)]


def run_cpp(binary, target, chunk_mib, ops, seed):
    out = subprocess.run([binary, f"--target={target}", f"--chunk-mib={chunk_mib}",
                          f"--ops={ops}", f"--seed={seed}"], check=True, capture_output=True,
                         text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    return r["put_gbps"], r["get_gbps"]


def run_python(client, chunk_mib, ops, seed):
    lay = layout_for(chunk_mib)
    ns = client.register_layout(lay).namespace_id
    payload = np.frombuffer(bytes((i * 131 + seed) & 0xFF for i in range(256)) *
                            (lay.chunk_bytes // 256), dtype=np.uint8)
    keys = keys_for(ns, seed, ops)
    t0 = time.perf_counter()
    r = client.put(ns, keys, [payload] * ops)
    put_s = time.perf_counter() - t0
    assert r.stored == ops, r
    # Touched before the clock starts, as client_bench's zero-initialised vector is: a
    # worker loads into memory it already owns, and first-touch page faults are not the
    # client's cost.
    out = np.ones(ops * lay.chunk_bytes, dtype=np.uint8)
    t0 = time.perf_counter()
    g = client.get_into(ns, keys, out)
    get_s = time.perf_counter() - t0
    assert all(g.found)
    assert np.array_equal(out[-lay.chunk_bytes:], payload)
    client.delete(ns, keys)
    total = ops * lay.chunk_bytes
    return total / put_s / 1e9, total / get_s / 1e9


def run_grpcio(stub, client, chunk_mib, ops, seed, frame=4 << 20):
    from kvtier.v1 import kvtier_pb2 as pb
    lay = layout_for(chunk_mib)
    ns = client.register_layout(lay).namespace_id
    payload = bytes((i * 131 + seed) & 0xFF for i in range(256)) * (lay.chunk_bytes // 256)
    crc = kvtier.crc32c(payload)
    keys = keys_for(ns, seed, ops)

    def frames():
        for k in keys:
            for off in range(0, len(payload), frame):
                f = pb.PutFrame(namespace_id=ns, key=k, offset=off,
                                data=payload[off:off + frame])
                if off + frame >= len(payload):
                    f.crc32c = crc
                yield f

    t0 = time.perf_counter()
    r = stub.Put(frames(), timeout=600)
    put_s = time.perf_counter() - t0
    assert r.chunks_stored == ops, r
    out = np.ones(ops * lay.chunk_bytes, dtype=np.uint8)
    mv = memoryview(out)
    t0 = time.perf_counter()
    for f in stub.Get(pb.GetRequest(namespace_id=ns, keys=keys), timeout=600):
        base = f.key_index * lay.chunk_bytes + f.offset
        mv[base:base + len(f.data)] = f.data
    get_s = time.perf_counter() - t0
    assert bytes(mv[-lay.chunk_bytes:]) == payload
    client.delete(ns, keys)
    total = ops * lay.chunk_bytes
    return total / put_s / 1e9, total / get_s / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="2,32,128")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget-mib", type=int, default=512)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "python"))
    ap.add_argument("--no-grpcio", action="store_true")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    binary = os.path.join(args.build, "bench", "client_bench")
    os.makedirs(args.out, exist_ok=True)
    rows = []
    with Daemon(args=["--write-mode=ram-only", f"--ram-capacity={2 * args.budget_mib + 512}MiB",
                      "--max-chunk-size=256MiB"]) as d:
        client = kvtier.Client(d.target, rpc_deadline=600, connect_timeout=30)
        stub = None
        if not args.no_grpcio:
            import grpc
            from kvtier.v1 import kvtier_pb2_grpc
            channel = grpc.insecure_channel(d.target, options=[
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20)])
            stub = kvtier_pb2_grpc.KvCacheStub(channel)
        for mib in sizes:
            ops = max(2, args.budget_mib // mib)
            res = {"cpp": [], "python": [], "grpcio": []}
            # One untimed round of each warms connections, the pool and the allocator.
            for rep in range(args.reps + 1):
                seed = 1000 * mib + rep
                r_cpp = run_cpp(binary, d.target, mib, ops, seed)
                r_py = run_python(client, mib, ops, seed + 100)
                r_g = run_grpcio(stub, client, mib, ops, seed + 200) if stub else None
                if rep == 0:
                    continue
                res["cpp"].append(r_cpp)
                res["python"].append(r_py)
                if r_g:
                    res["grpcio"].append(r_g)
            for impl, vals in res.items():
                if not vals:
                    continue
                row = {"chunk_mib": mib, "ops": ops, "impl": impl, "reps": len(vals),
                       "put_gbps": statistics.median(v[0] for v in vals),
                       "get_gbps": statistics.median(v[1] for v in vals)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "py_client.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    by = {(r["chunk_mib"], r["impl"]): r for r in rows}
    lines = ["| chunk | C++ put | Python put | ratio | grpcio put | C++ get | Python get | ratio | grpcio get |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mib in sizes:
        c, p, g = by[(mib, "cpp")], by[(mib, "python")], by.get((mib, "grpcio"))
        gp = f"{g['put_gbps']:.2f} ({g['put_gbps'] / c['put_gbps']:.2f})" if g else "-"
        gg = f"{g['get_gbps']:.2f} ({g['get_gbps'] / c['get_gbps']:.2f})" if g else "-"
        lines.append(f"| {mib} MiB | {c['put_gbps']:.2f} | {p['put_gbps']:.2f} | "
                     f"**{p['put_gbps'] / c['put_gbps']:.2f}** | {gp} | {c['get_gbps']:.2f} | "
                     f"{p['get_gbps']:.2f} | **{p['get_gbps'] / c['get_gbps']:.2f}** | {gg} |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "py_client.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    sys.exit(main())
