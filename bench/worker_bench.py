#!/usr/bin/python3
"""The reference worker's benchmark: a real (seeded, random-weight) Llama model on the CPU
serving through a real kvtierd. Run by hand; not part of the test suite.

  PYTHONPATH=build/python:worker /usr/bin/python3 bench/worker_bench.py [--quick] [--out DIR]
  /usr/bin/python3 bench/plot_worker.py [--out DIR]

Three parts, each written to DIR (default bench/results/worker) as JSON, plus
commands.txt (this command line and every kvtierd command line) and summary.md:

(a) overlap   Layer-wise overlap: a request whose prefix is cached; load it whole then
              compute the suffix ("chunk") vs stream it layer by layer while computing
              layer by layer ("layer"). Medians over repeats, per prefix length.
(b) cake      Cake with real compute: per context length and bandwidth cap, the prefix
              phase (the cached chunks [0, h)) done by compute-only, load-only, Cake, and
              an oracle split (min over s of max(sum_{i<s} c_i, sum_{i>=s} l_i), from the
              measured per-chunk compute times c_i and per-chunk stream time l), plus the
              planner's a + b*i against the measured c_i. The cap is the daemon's
              --prefill-bandwidth-limit (set to the largest cap) with each session's
              max_bytes_per_second selecting the grid's cap.
(c) overflow  CachedAttention context overflow with pre-RoPE keys: a conversation that
              outgrows the window keeps its newest chunks and reuses them at new positions;
              top-1 agreement and logit error against recomputing the truncated context,
              over many random prompts. Random weights: the figures say how far the
              approximation moves this model, not how a trained model would behave.

Torch runs on one thread (the machine has 2 cores; the daemon gets the other).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (os.path.join(ROOT, "build", "python"), os.path.join(ROOT, "worker")):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402

import kvtier  # noqa: E402
from kvtier.testing import Daemon  # noqa: E402
from kvtier_worker.model import LlamaModel, ModelConfig  # noqa: E402
from kvtier_worker.worker import KvCache, Worker, compute_chunkwise, compute_local  # noqa: E402

MiB = 1 << 20


def tokens_of(n, seed, vocab):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def start_daemon(args, commands, tmp_root):
    data = os.path.join(tmp_root, f"kvtierd-{len(commands)}")
    os.makedirs(data, exist_ok=True)  # With --write-mode=ram-only the daemon creates none.
    d = Daemon(data, args=args)
    commands.append(" ".join([d.binary, "--listen=127.0.0.1:0", "--metrics-listen=127.0.0.1:0",
                              "--data-dir=<tmp>", "--port-file=<tmp>/kvtierd.port"] + args))
    return d


# -- (a) layer-wise overlap ------------------------------------------------------------

def bench_overlap(cfg, C, prefixes, suffix, repeats, commands, tmp):
    model = LlamaModel(cfg)
    out = {"model": cfg_dict(cfg), "tokens_per_chunk": C, "suffix_tokens": suffix, "rows": []}
    args = ["--ram-capacity=1GiB", "--write-mode=ram-only"]
    with start_daemon(args, commands, tmp) as d, kvtier.Client(d.target, connect_timeout=30) as c:
        w = Worker(model, c, C, model_id="bench-overlap")
        for n_prefix in prefixes:
            tokens = tokens_of(n_prefix + suffix, n_prefix, cfg.vocab_size)
            # Timing only: the prefix KV is seeded noise of the right shape (a real prefill
            # of 4096 tokens costs this CPU a minute; exactness is the tests' job).
            g = torch.Generator().manual_seed(n_prefix)
            kv = [(torch.randn(cfg.num_kv_heads, n_prefix, cfg.head_dim, generator=g),
                   torch.randn(cfg.num_kv_heads, n_prefix, cfg.head_dim, generator=g))
                  for _ in range(cfg.num_layers)]
            keys = kvtier.chunk_keys(w.ns, tokens.numpy(), C)
            c.put(w.ns, keys[:n_prefix // C], list(w.chunks.pack(kv)))
            # Compute alone (prefix KV already in local memory), for reference.
            times = {"chunk": [], "layer": [], "compute_only": [], "load_only": []}
            past = [(k.clone(), v.clone()) for k, v in kv]
            buf = w.chunks.alloc(n_prefix // C)
            for rep in range(repeats + 1):  # The first round warms up.
                for mode in ("chunk", "layer"):
                    r = w.serve(tokens, mode, put=False, return_kv=False)
                    assert r.reused_chunks == n_prefix // C, (mode, r.reused_chunks, r.fallback)
                    if rep:
                        times[mode].append(r.timings["total"])
                t0 = time.perf_counter()
                model.prefill(tokens[n_prefix:], n_prefix, past)
                t1 = time.perf_counter()
                c.get_into(w.ns, keys[:n_prefix // C], buf)
                t2 = time.perf_counter()
                if rep:
                    times["compute_only"].append(t1 - t0)
                    times["load_only"].append(t2 - t1)
            row = {"prefix_tokens": n_prefix, "chunks": n_prefix // C,
                   "prefix_bytes": n_prefix // C * w.chunks.chunk_bytes,
                   "layer_path": "layer-major Get"}
            for k, v in times.items():
                row[f"{k}_median_s"] = median(v)
                row[f"{k}_all_s"] = v
            row["saved_s"] = row["chunk_median_s"] - row["layer_median_s"]
            row["saved_fraction"] = row["saved_s"] / row["chunk_median_s"]
            out["rows"].append(row)
            print(f"  overlap prefix={n_prefix}: chunk {row['chunk_median_s']*1e3:.1f} ms, "
                  f"layer {row['layer_median_s']*1e3:.1f} ms, compute {row['compute_only_median_s']*1e3:.1f}"
                  f" ms, load {row['load_only_median_s']*1e3:.1f} ms", flush=True)
    return out


# -- (b) Cake ------------------------------------------------------------------------------

def oracle_split(c, l):
    """min over s of max(sum_{i<s} c_i, sum_{i>=s} l_i), and the s that attains it."""
    h = len(c)
    best = None
    for s in range(h + 1):
        t = max(sum(c[:s]), sum(l[s:]))
        if best is None or t < best[0]:
            best = (t, s)
    return best


def fit_line(ys):
    n = len(ys)
    if n < 2:
        return (ys[0] if ys else 0.0, 0.0)
    xm = (n - 1) / 2
    ym = sum(ys) / n
    b = sum((i - xm) * (y - ym) for i, y in enumerate(ys)) / sum((i - xm) ** 2 for i in range(n))
    return (ym - b * xm, b)


def bench_cake(cfg, C, contexts, caps, repeats, commands, tmp):
    model = LlamaModel(cfg)
    out = {"model": cfg_dict(cfg), "tokens_per_chunk": C, "caps": caps, "rows": [],
           "per_chunk": []}
    args = ["--ram-capacity=1GiB", "--write-mode=ram-only",
            f"--prefill-bandwidth-limit={max(caps)}"]
    with start_daemon(args, commands, tmp) as d, kvtier.Client(d.target, connect_timeout=30) as c:
        w = Worker(model, c, C, model_id="bench-cake")
        for n_ctx in contexts:
            h = n_ctx // C
            tokens = tokens_of(n_ctx + C // 2, 1000 + n_ctx, cfg.vocab_size)
            # Cache the prefix as Cake computes it (chunk by chunk): streamed and computed
            # copies are then the same bytes.
            _, kv = compute_local(model, tokens[:n_ctx + 1], h, C, chunkwise_prefix=True)
            keys = kvtier.chunk_keys(w.ns, tokens.numpy(), C)
            c.put(w.ns, keys[:h], list(w.chunks.pack(kv, h)))
            # Compute-only: per-chunk times c_i (median over repeats).
            per_chunk = [[] for _ in range(h)]
            compute_total = []
            for rep in range(repeats + 1):
                cache = KvCache(model, len(tokens))
                times = []
                t0 = time.perf_counter()
                compute_chunkwise(model, tokens, cache, 0, h, C, times)
                if rep:
                    compute_total.append(time.perf_counter() - t0)
                    for i, t in times:
                        per_chunk[i].append(t)
            c_i = [median(v) for v in per_chunk]
            a_fit, b_fit = fit_line(c_i)
            out["per_chunk"].append({"context_tokens": n_ctx, "compute_s": c_i,
                                     "fit_a_s": a_fit, "fit_b_s": b_fit})
            for cap in caps:
                dest = w.chunks.alloc(h)
                load_total = []
                for rep in range(repeats + 1):
                    t0 = time.perf_counter()
                    # Load-only: a forecast that says compute is hopeless, and no compute.
                    with c.prefill(w.ns, keys[:h], dest=dest, compute_estimate=(1e3, 0.0),
                                   max_bytes_per_second=cap) as s:
                        r = s.finish()
                    assert r.first_streamed == 0, r
                    if rep:
                        load_total.append(time.perf_counter() - t0)
                l_chunk = median(load_total) / h
                cake, plans, splits = [], [], []
                for rep in range(repeats + 1):
                    r = w.serve_cake(tokens[:n_ctx + C // 2], put=False, max_bytes_per_second=cap,
                                     compute_estimate=(a_fit, b_fit))
                    assert r.fallback == "" and r.prefill.cached_prefix == h, r.fallback
                    if rep:
                        cake.append(r.timings["total"] - r.timings["rest"])
                        plans.append((r.plan.compute_a_seconds, r.plan.compute_b_seconds,
                                      r.plan.predicted_meeting, r.plan.stream_bytes_per_second))
                        splits.append(r.prefill.first_streamed)
                # The planner's own running fit (no estimate passed): what it learned.
                r = w.serve_cake(tokens[:n_ctx + C // 2], put=False, max_bytes_per_second=cap)
                daemon_fit = (r.plan.compute_a_seconds, r.plan.compute_b_seconds)
                o_t, o_s = oracle_split(c_i, [l_chunk] * h)
                row = {"context_tokens": n_ctx, "chunks": h, "cap_bytes_per_s": cap,
                       "chunk_bytes": w.chunks.chunk_bytes,
                       "compute_only_s": median(compute_total),
                       "load_only_s": median(load_total), "load_per_chunk_s": l_chunk,
                       "cake_s": median(cake), "cake_all_s": cake,
                       "cake_first_streamed": splits,
                       "oracle_s": o_t, "oracle_split": o_s,
                       "planner_predicted_meeting": [p[2] for p in plans],
                       "planner_stream_bytes_per_s": plans[-1][3] if plans else None,
                       "estimate_passed_a_b": [a_fit, b_fit],
                       "daemon_running_fit_a_b": list(daemon_fit)}
                out["rows"].append(row)
                print(f"  cake ctx={n_ctx} cap={cap/MiB:.0f}MiB/s: compute {row['compute_only_s']*1e3:.0f}"
                      f" load {row['load_only_s']*1e3:.0f} cake {row['cake_s']*1e3:.0f} oracle "
                      f"{o_t*1e3:.0f} ms (split {splits} vs oracle {o_s})", flush=True)
    return out


# -- (c) context overflow ----------------------------------------------------------------

def bench_overflow(cfg, C, window, turn1, turn2, prompts, commands, tmp):
    model = LlamaModel(cfg)
    out = {"model": cfg_dict(cfg), "tokens_per_chunk": C, "window": window,
           "turn1_tokens": turn1, "turn2_tokens": turn2, "rows": []}
    args = ["--ram-capacity=512MiB", "--write-mode=ram-only"]
    with start_daemon(args, commands, tmp) as d, kvtier.Client(d.target, connect_timeout=30) as c:
        w = Worker(model, c, C, model_id="bench-overflow")
        agree, agree_last, max_err, mean_err, kl, reuse, t_reuse, t_full = ([] for _ in range(8))
        for p in range(prompts):
            a = tokens_of(turn1, 5000 + p, cfg.vocab_size)
            w.serve(a, "none")
            convo = torch.cat([a, tokens_of(turn2, 9000 + p, cfg.vocab_size)])
            r = w.serve_truncated(convo, window, put=False)
            drop = int(r.timings["dropped_chunks"])
            sub = convo[drop * C:]
            t0 = time.perf_counter()
            ref, _ = model.prefill(sub)
            t_full.append(time.perf_counter() - t0)
            t_reuse.append(r.timings["total"])
            ref = ref[r.computed_from:].float()
            got = r.logits.float()
            agree.append(float((ref.argmax(-1) == got.argmax(-1)).float().mean()))
            agree_last.append(float(ref[-1].argmax() == got[-1].argmax()))
            err = (ref - got).abs()
            max_err.append(float(err.max()))
            mean_err.append(float(err.mean()))
            lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
            kl.append(float((lp.exp() * (lp - lq)).sum(-1).mean()))
            reuse.append(r.reused_chunks)
        ref_scale = float(ref.abs().mean())
        out.update({
            "prompts": prompts, "reused_chunks_median": median(reuse),
            "top1_agreement_mean": statistics.fmean(agree),
            "top1_agreement_last_token": statistics.fmean(agree_last),
            "logit_max_abs_err_median": median(max_err),
            "logit_mean_abs_err_median": median(mean_err),
            "logit_mean_abs_value": ref_scale,
            "kl_ref_to_reuse_mean_nats": statistics.fmean(kl),
            "reuse_s_median": median(t_reuse), "recompute_s_median": median(t_full),
            "top1_agreement_all": agree,
        })
        print(f"  overflow: top-1 agreement {out['top1_agreement_mean']:.3f}, last token "
              f"{out['top1_agreement_last_token']:.3f}, mean |dlogit| "
              f"{out['logit_mean_abs_err_median']:.3f} (|logit| ~{ref_scale:.2f}), KL "
              f"{out['kl_ref_to_reuse_mean_nats']:.4f}", flush=True)
    return out


def cfg_dict(cfg):
    d = dict(cfg.__dict__)
    d["dtype"] = cfg.dtype_name
    return d


def summary_md(res):
    lines = ["# Reference worker benchmark", "",
             "Random-weight Llama-architecture model (seeded), torch on 1 CPU thread, real kvtierd.",
             ""]
    if "overlap" in res:
        o = res["overlap"]
        lines += ["## (a) Layer-wise overlap (medians)", "",
                  f"Model {o['model']['num_layers']} layers, hidden {o['model']['hidden']}, "
                  f"{o['model']['num_kv_heads']} KV heads x {o['model']['head_dim']}, "
                  f"{o['model']['dtype']}; {o['suffix_tokens']} new tokens.", "",
                  "| prefix tokens | MiB | load whole, then compute (ms) | layer-wise (ms) | saved | compute alone | load alone | layer path |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in o["rows"]:
            lines.append(f"| {r['prefix_tokens']} | {r['prefix_bytes']/MiB:.0f} | "
                         f"{r['chunk_median_s']*1e3:.1f} | {r['layer_median_s']*1e3:.1f} | "
                         f"{r['saved_fraction']*100:.0f}% | {r['compute_only_median_s']*1e3:.1f} | "
                         f"{r['load_only_median_s']*1e3:.1f} | {r['layer_path']} |")
        lines.append("")
    if "cake" in res:
        o = res["cake"]
        lines += ["## (b) Cake with real compute (prefix phase, medians, ms)", "",
                  "| context | cap MiB/s | compute-only | load-only | Cake | oracle | Cake split s | oracle s |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in o["rows"]:
            lines.append(f"| {r['context_tokens']} | {r['cap_bytes_per_s']/MiB:.0f} | "
                         f"{r['compute_only_s']*1e3:.0f} | {r['load_only_s']*1e3:.0f} | "
                         f"{r['cake_s']*1e3:.0f} | {r['oracle_s']*1e3:.0f} | "
                         f"{r['cake_first_streamed']} | {r['oracle_split']} |")
        lines += ["", "Per-chunk compute fit (ours, least squares) vs the daemon's running fit:", ""]
        for pc, r in zip(o["per_chunk"], [r for r in o["rows"] if r["cap_bytes_per_s"] == o["caps"][0]]):
            lines.append(f"- context {pc['context_tokens']}: measured a={pc['fit_a_s']*1e3:.2f} ms "
                         f"b={pc['fit_b_s']*1e3:.3f} ms; daemon a={r['daemon_running_fit_a_b'][0]*1e3:.2f} ms "
                         f"b={r['daemon_running_fit_a_b'][1]*1e3:.3f} ms")
        lines.append("")
    if "overflow" in res:
        o = res["overflow"]
        lines += ["## (c) Context overflow, pre-RoPE reuse vs recomputing the truncated context", "",
                  f"{o['prompts']} random prompts; window {o['window']}, turn 1 {o['turn1_tokens']} "
                  f"tokens (cached), turn 2 adds {o['turn2_tokens']}.", "",
                  f"- top-1 agreement over the computed tokens: {o['top1_agreement_mean']:.3f}; "
                  f"on the last token: {o['top1_agreement_last_token']:.3f}",
                  f"- logit error: mean |d| {o['logit_mean_abs_err_median']:.3f}, max |d| "
                  f"{o['logit_max_abs_err_median']:.3f} (mean |logit| {o['logit_mean_abs_value']:.2f}); "
                  f"KL(recompute || reuse) {o['kl_ref_to_reuse_mean_nats']:.4f} nats",
                  f"- time: reuse {o['reuse_s_median']*1e3:.1f} ms vs recompute "
                  f"{o['recompute_s_median']*1e3:.1f} ms (medians)",
                  "", "Random weights: this measures how much the truncated-context approximation "
                  "moves this model's outputs, not the quality a trained model would keep.", ""]
    return "\n".join(lines)


def main():
    import signal
    # SIGTERM unwinds like Ctrl-C, so every kvtierd this started is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "worker"))
    ap.add_argument("--quick", action="store_true", help="small grid, for a smoke run")
    ap.add_argument("--parts", default="overlap,cake,overflow")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    import tempfile
    tmp = tempfile.mkdtemp(prefix="worker-bench-")
    commands = []
    res = {"argv": sys.argv, "torch": torch.__version__}
    parts = args.parts.split(",")
    q = args.quick
    reps = 2 if q else args.repeats
    t_all = time.perf_counter()
    if "overlap" in parts:
        print("(a) layer-wise overlap", flush=True)
        # KV-heavy and compute-light (8 KV heads x 64 on a 256-wide model, 8 new tokens),
        # so that on this CPU loading the prefix and computing the suffix take comparable
        # time: 32 KiB of KV per token.
        cfg = ModelConfig(vocab_size=1024, hidden=256, num_layers=8, num_heads=8, num_kv_heads=8,
                          head_dim=64, intermediate=768, max_position=8192, tie_embeddings=False)
        res["overlap"] = bench_overlap(cfg, 64, [1024, 2048] if q else [1024, 2048, 4096],
                                       8, reps, commands, tmp)
    if "cake" in parts:
        print("(b) Cake", flush=True)
        cfg = ModelConfig(vocab_size=1024, hidden=256, num_layers=4, num_heads=8, num_kv_heads=4,
                          head_dim=32, intermediate=512, max_position=8192, tie_embeddings=False)
        # A 32-token chunk is 4 layers x 2 x 4 heads x 32 tokens x 32 x 4 B = 128 KiB.
        caps = [4 * MiB, 16 * MiB] if q else [2 * MiB, 4 * MiB, 8 * MiB, 32 * MiB]
        res["cake"] = bench_cake(cfg, 32, [256, 512] if q else [256, 512, 1024], caps,
                                 min(reps, 3), commands, tmp)
    if "overflow" in parts:
        print("(c) context overflow", flush=True)
        cfg = ModelConfig(vocab_size=512, hidden=128, num_layers=4, num_heads=4, num_kv_heads=2,
                          head_dim=32, intermediate=256, max_position=256, key_position="pre_rope",
                          tie_embeddings=False)
        res["overflow"] = bench_overflow(cfg, 16, 256, 240, 80, 10 if q else 60, commands, tmp)
    res["elapsed_s"] = time.perf_counter() - t_all
    with open(os.path.join(args.out, "worker_bench.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(args.out, "commands.txt"), "w") as f:
        f.write("PYTHONPATH=build/python:worker /usr/bin/python3 " + " ".join(sys.argv) + "\n")
        f.write("\n".join(commands) + "\n")
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(summary_md(res))
    print(f"done in {res['elapsed_s']:.0f} s; results in {args.out}")


if __name__ == "__main__":
    main()
