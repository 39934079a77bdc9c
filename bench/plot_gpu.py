#!/usr/bin/python3
"""PNG timelines of gpu_worker_bench (matplotlib: apt-get install python3-matplotlib).

  /usr/bin/python3 bench/plot_gpu.py [DIR]   (default bench/results/gpu)

Reads DIR/layerwise.csv, DIR/prefill.csv and, if there, DIR/layerwise_events.csv
(lane,chunk,layer,start_s,end_s) and writes DIR/gpu_timeline.png, one panel each (ms).
  layer-wise  top lane: each layer's transfer into the worker's GPU memory (from the
              previous layer's landing to its own); bottom lane: the compute stream's
              kernels, one per layer. Colour is the chunk, so chunk k's transfer shows
              above chunk k-1's compute.
  prefill     the compute stream's kernels for the chunks the worker computed (forward),
              and a tick for each chunk the daemon streamed into GPU memory (backward).
  events      the layer-wise pipeline with record_events: the compute stream waits on
              the daemon's record of each layer's event, its host on nothing.
"""
import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def rows(path):
    with open(path) as f:
        return [
            dict(lane=r["lane"], chunk=int(r["chunk"]), layer=int(r["layer"]),
                 start=float(r["start_s"]) * 1e3, end=float(r["end_s"]) * 1e3)
            for r in csv.DictReader(f)
        ]


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "results", "gpu")
    lw = rows(os.path.join(d, "layerwise.csv"))
    pf = rows(os.path.join(d, "prefill.csv"))
    ev_path = os.path.join(d, "layerwise_events.csv")
    ev = rows(ev_path) if os.path.exists(ev_path) else None
    fig, axes = plt.subplots(3 if ev else 2, 1, figsize=(11, 7.6 if ev else 5.2))
    a, b = axes[0], axes[1]
    cmap = plt.get_cmap("tab20")
    lanes = {"transfer": 1, "compute": 0}
    for r in lw:
        a.barh(lanes[r["lane"]], r["end"] - r["start"], left=r["start"], height=0.7,
               color=cmap(r["chunk"] % 20), linewidth=0)
    a.set_yticks([0, 1], ["compute stream", "transfer (daemon)"])
    a.set_title("layer-wise: chunk k's layers land while chunk k-1 computes (colour = chunk)",
                fontsize=10)
    a.set_xlabel("ms")
    for r in pf:
        if r["lane"] == "compute":
            b.barh(0, r["end"] - r["start"], left=r["start"], height=0.7,
                   color=cmap(r["chunk"] % 20), linewidth=0)
        else:
            b.plot([r["start"]], [1], "v", color=cmap(r["chunk"] % 20))
            b.annotate(str(r["chunk"]), (r["start"], 1.15), fontsize=7, ha="center")
    b.set_yticks([0, 1], ["compute stream", "streamed in (daemon)"])
    b.set_ylim(-0.6, 1.6)
    b.set_title("Prefill into GPU memory: the worker computes forward, the daemon streams "
                "backward", fontsize=10)
    b.set_xlabel("ms")
    if ev:
        c = axes[2]
        for r in ev:
            c.barh(0, r["end"] - r["start"], left=r["start"], height=0.7,
                   color=cmap(r["chunk"] % 20), linewidth=0)
        c.set_yticks([0], ["compute stream"])
        c.set_title("layer-wise with record_events: the GPU waits on the daemon's event per "
                    "layer, the worker's host on nothing", fontsize=10)
        c.set_xlabel("ms")
    fig.tight_layout()
    out = os.path.join(d, "gpu_timeline.png")
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
