#!/usr/bin/python3
"""Plots cake_bench's CSV: time to first token against context length for
compute-only, load-only, Cake and the oracle split, one panel per GPU share (rows) and
bandwidth (columns), like the paper's figures 5 and 6.

usage: bench/plot_cake.py [CSV=/tmp/cake.csv] [PNG=bench/cake_ttft.png]
"""
import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else "/tmp/cake.csv"
    dst = sys.argv[2] if len(sys.argv) > 2 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "cake_ttft.png")
    with open(src, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        sys.exit(f"{src}: no rows")
    shares = sorted({float(r["gpu_share_pct"]) for r in rows})
    bands = sorted({float(r["bandwidth_gbps"]) for r in rows})
    methods = [
        ("compute_only_s", "compute-only", "tab:red", "s"),
        ("load_only_s", "load-only", "tab:blue", "^"),
        ("oracle_s", "oracle split", "tab:gray", "x"),
        ("cake_s", "Cake (kvtierd)", "tab:green", "o"),
    ]
    fig, axes = plt.subplots(len(shares), len(bands), figsize=(4.2 * len(bands), 3.4 * len(shares)),
                             squeeze=False)
    for i, share in enumerate(shares):
        for j, bw in enumerate(bands):
            ax = axes[i][j]
            cell = sorted((r for r in rows if float(r["gpu_share_pct"]) == share
                           and float(r["bandwidth_gbps"]) == bw),
                          key=lambda r: float(r["context_tokens"]))
            x = [float(r["context_tokens"]) / 1024 for r in cell]
            for key, label, color, marker in methods:
                ax.plot(x, [float(r[key]) for r in cell], marker=marker, color=color,
                        label=label, linestyle="--" if key == "oracle_s" else "-")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(x)
            ax.set_xticklabels([f"{v:g}k" for v in x])
            ax.set_title(f"GPU share {share:g}%, {bw:g} Gbps", fontsize=10)
            if i == len(shares) - 1:
                ax.set_xlabel("context (tokens)")
            if j == 0:
                ax.set_ylabel("TTFT (s, paper scale)")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    scale = rows[0]
    fig.suptitle("Cake against kvtierd, LongAlpaca-7B emulated (bytes /%s, time /%s, "
                 "scaled back)" % (scale["byte_scale"], scale["time_scale"]), fontsize=11)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(dst)


if __name__ == "__main__":
    main()
