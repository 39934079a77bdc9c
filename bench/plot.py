#!/usr/bin/python3
"""Plots for bench/RESULTS.md from bench/results/ (written by bench/run.sh).

usage: plot.py RESULTS_DIR PLOTS_DIR
Writes throughput.png (GB/s vs clients, one panel per chunk size: kvtier RAM/SSD tier,
Redis, with the loopback-TCP and fio lines) and latency.png (get p50/p99 vs clients).
"""
import json
import os
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(res):
    rows = []
    with open(os.path.join(res, "results.jsonl")) as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


def baselines(res):
    out = {}
    try:
        j = json.load(open(os.path.join(res, "iperf3.json")))
        out["tcp"] = j["end"]["sum_received"]["bits_per_second"] / 8e9
    except Exception:
        pass
    for rw in ("read", "write"):
        try:
            j = json.load(open(os.path.join(res, f"fio_{rw}.json")))
            out["fio_" + rw] = j["jobs"][0][rw]["bw_bytes"] / 1e9
        except Exception:
            pass
    return out


def main():
    res, plots = sys.argv[1], sys.argv[2]
    os.makedirs(plots, exist_ok=True)
    rows = [r for r in load(res) if r.get("kind") == "cell"]
    base = baselines(res)
    chunks = sorted({int(r["chunk_mib"]) for r in rows})
    series = [("ram", "get", "kvtier RAM get", "C0", "-"), ("ram", "put", "kvtier RAM put", "C0", "--"),
              ("ssd", "get", "kvtier SSD get", "C1", "-"), ("ssd", "put", "kvtier SSD put", "C1", "--"),
              ("redis", "get", "Redis get", "C2", "-"), ("redis", "put", "Redis put", "C2", "--")]

    def pts(tier, op, c, key):
        p = sorted((r["clients"], r[key]) for r in rows
                   if r["tier"] == tier and r["op"] == op and int(r["chunk_mib"]) == c)
        return [x for x, _ in p], [y for _, y in p]

    fig, axes = plt.subplots(1, len(chunks), figsize=(5 * len(chunks), 4.2), squeeze=False)
    for ax, c in zip(axes[0], chunks):
        for tier, op, label, color, ls in series:
            x, y = pts(tier, op, c, "gbps")
            if x:
                ax.plot(x, y, marker="o", color=color, ls=ls, label=label)
        if "tcp" in base:
            ax.axhline(base["tcp"], color="k", ls=":", label="loopback TCP (iperf3, 1 stream)")
        if "fio_read" in base:
            ax.axhline(base["fio_read"], color="C3", ls=":", label="fio seq read")
        if "fio_write" in base:
            ax.axhline(base["fio_write"], color="C3", ls="-.", label="fio seq write")
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 4, 16, 64], ["1", "4", "16", "64"])
        ax.set_title(f"{c} MiB chunks")
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("GB/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(plots, "throughput.png"), dpi=110)

    fig, axes = plt.subplots(1, len(chunks), figsize=(5 * len(chunks), 4.2), squeeze=False)
    for ax, c in zip(axes[0], chunks):
        for tier, op, label, color, _ in series:
            if op != "get":
                continue
            for key, ls in (("p50_ms", "-"), ("p99_ms", "--")):
                x, y = pts(tier, op, c, key)
                if x:
                    ax.plot(x, y, marker="o", color=color, ls=ls, label=f"{label} {key[:3]}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([1, 4, 16, 64], ["1", "4", "16", "64"])
        ax.set_title(f"get latency, {c} MiB chunks")
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("ms per chunk")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(plots, "latency.png"), dpi=110)


if __name__ == "__main__":
    main()
