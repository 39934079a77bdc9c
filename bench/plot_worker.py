#!/usr/bin/python3
"""PNG plots of bench/worker_bench.py's results (matplotlib: apt-get install python3-matplotlib).

  /usr/bin/python3 bench/plot_worker.py [--out bench/results/worker]

Reads DIR/worker_bench.json, writes DIR/worker_overlap.png, worker_cake.png,
worker_cake_fit.png and worker_overflow.png (each only when its part was run).
"""

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20


def plot_overlap(o, out):
    rows = o["rows"]
    x = [r["prefix_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for key, label in (("chunk_median_s", "load whole prefix, then compute"),
                       ("layer_median_s", "layer-wise: load layer l+1 while computing l"),
                       ("compute_only_median_s", "compute alone (prefix in memory)"),
                       ("load_only_median_s", "load alone")):
        ax.plot(x, [r[key] * 1e3 for r in rows], marker="o", label=label)
    ax.set_xlabel("cached prefix (tokens)")
    ax.set_ylabel("median time (ms)")
    ax.set_title(f"Layer-wise overlap ({o['suffix_tokens']} new tokens; {rows[0]['layer_path']})",
                 fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "worker_overlap.png"), dpi=120)
    plt.close(fig)


def plot_cake(o, out):
    rows = o["rows"]
    contexts = sorted({r["context_tokens"] for r in rows})
    caps = o["caps"]
    fig, axes = plt.subplots(1, len(contexts), figsize=(4.2 * len(contexts), 3.8), squeeze=False)
    for ax, ctx in zip(axes[0], contexts):
        rs = sorted((r for r in rows if r["context_tokens"] == ctx),
                    key=lambda r: r["cap_bytes_per_s"])
        xs = [r["cap_bytes_per_s"] / MiB for r in rs]
        for key, label, style in (("compute_only_s", "compute only", "--"),
                                  ("load_only_s", "load only", "--"),
                                  ("cake_s", "Cake", "-"), ("oracle_s", "oracle split", ":")):
            ax.plot(xs, [r[key] * 1e3 for r in rs], style, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("stream cap (MiB/s)")
        ax.set_ylabel("prefix phase (ms)")
        ax.set_title(f"context {ctx} tokens ({rs[0]['chunks']} chunks)", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "worker_cake.png"), dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for pc in o["per_chunk"]:
        ys = [t * 1e3 for t in pc["compute_s"]]
        line, = ax.plot(range(len(ys)), ys, marker=".", linestyle="none",
                        label=f"measured, context {pc['context_tokens']}")
        a, b = pc["fit_a_s"], pc["fit_b_s"]
        ax.plot(range(len(ys)), [(a + b * i) * 1e3 for i in range(len(ys))],
                color=line.get_color(), alpha=0.5)
        d = [r for r in rows if r["context_tokens"] == pc["context_tokens"]]
        if d:
            da, db = d[-1]["daemon_running_fit_a_b"]
            ax.plot(range(len(ys)), [(da + db * i) * 1e3 for i in range(len(ys))],
                    color=line.get_color(), linestyle=":")
    ax.set_xlabel("chunk index i")
    ax.set_ylabel("compute time of chunk i (ms)")
    ax.set_title("Per-chunk compute: measured, least-squares a+b*i (solid), daemon's fit (dotted)",
                 fontsize=8)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "worker_cake_fit.png"), dpi=120)
    plt.close(fig)


def plot_overflow(o, out):
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.hist(o["top1_agreement_all"], bins=20, range=(0, 1))
    ax.set_xlabel("top-1 agreement with recomputing the truncated context, per prompt")
    ax.set_ylabel("prompts")
    ax.set_title(f"Context overflow, pre-RoPE reuse (random weights): mean "
                 f"{o['top1_agreement_mean']:.3f}, KL {o['kl_ref_to_reuse_mean_nats']:.3f} nats",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "worker_overflow.png"), dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "results", "worker"))
    args = ap.parse_args()
    with open(os.path.join(args.out, "worker_bench.json")) as f:
        res = json.load(f)
    if "overlap" in res:
        plot_overlap(res["overlap"], args.out)
    if "cake" in res:
        plot_cake(res["cake"], args.out)
    if "overflow" in res:
        plot_overflow(res["overflow"], args.out)
    print(f"plots in {args.out}")


if __name__ == "__main__":
    main()
