#!/usr/bin/python3
"""PNG plot of samehost_bench's results (matplotlib: apt-get install python3-matplotlib).

  /usr/bin/python3 bench/plot_samehost.py [DIR]   (default bench/results/samehost)

Reads DIR/samehost.jsonl and writes DIR/samehost.png: GB/s against clients for get and
put through shared memory and through gRPC, one panel per chunk size, with memcpy and
loopback TCP as horizontal lines.
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "results", "samehost")
    with open(os.path.join(d, "samehost.jsonl")) as f:
        rows = [json.loads(l) for l in f if l.strip()]
    cells = [r for r in rows if r.get("kind") == "samehost"]
    chunks = sorted({int(r["chunk_mib"]) for r in cells})
    fig, axes = plt.subplots(1, len(chunks), figsize=(4.2 * len(chunks), 3.8), sharey=True)
    if len(chunks) == 1:
        axes = [axes]
    styles = {("shm", "get"): "C0-o", ("shm", "put"): "C0--s", ("grpc", "get"): "C1-o",
              ("grpc", "put"): "C1--s"}
    for ax, c in zip(axes, chunks):
        for (path, op), style in styles.items():
            pts = sorted((int(r["clients"]), r["gbps"]) for r in cells
                         if r["path"] == path and r["op"] == op and int(r["chunk_mib"]) == c)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style,
                        label=f"{'shared memory' if path == 'shm' else 'gRPC'} {op}")
        for path, op, color, ls, label in (("memcpy", "copy_hot", "black", ":", "memcpy (cache-hot)"),
                                           ("memcpy", "copy_ws", "black", "-.", "memcpy (1 GiB working set)"),
                                           ("tcp", "recv", "C2", ":", "loopback TCP")):
            for r in cells:
                if r["path"] == path and r["op"] == op and int(r["chunk_mib"]) == c:
                    ax.axhline(r["gbps"], linestyle=ls, color=color, label=label, linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{c} MiB chunks")
        ax.set_xlabel("clients")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[-1].legend(fontsize=7, loc="upper right")
    fig.suptitle("Same host: kvtierd through shared memory vs the gRPC stream")
    fig.tight_layout()
    fig.savefig(os.path.join(d, "samehost.png"), dpi=110)


if __name__ == "__main__":
    main()
