#!/usr/bin/python3
"""Writes bench/RESULTS.md from bench/results/ (bench/run.sh's raw output).

usage: report.py RESULTS_DIR HEADER_MD OUT_MD
Every figure sits next to its baseline, as a ratio, with MET / NOT MET per target.
Static text (the RSS optimisation history, the optimisation log) comes from HEADER_MD;
bench/profile.md, when present, is included as the profile section.
"""
import json
import statistics
import os
import sys


def rd(path, default=""):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return default


def jsonl(path):
    """The JSON objects of a .jsonl file, one per non-empty line ([] if absent)."""
    return [json.loads(l) for l in rd(path).splitlines() if l.strip()]


def write_notes(d, w, lead=""):
    """Appends <d>/notes.md (hand-written analysis beside the figures), if there is one."""
    notes = rd(os.path.join(d, "notes.md")).strip()
    if notes:
        w(lead + notes + "\n")


def samehost(res, w, ratio, met):
    """The same-host data plane section, from bench/results/samehost/ (samehost_bench)."""
    d = os.path.join(res, "samehost")
    rows = jsonl(os.path.join(d, "samehost.jsonl"))
    if not rows:
        return
    cells = [r for r in rows if r.get("kind") == "samehost"]

    def get(path, op, c, n=1):
        for r in cells:
            if r["path"] == path and r["op"] == op and int(r["chunk_mib"]) == c and int(r["clients"]) == n:
                return r
        return None

    def best(path, op, c):
        cs = [r for r in cells if r["path"] == path and r["op"] == op and int(r["chunk_mib"]) == c]
        return max(cs, key=lambda r: r["gbps"]) if cs else None

    chunks = sorted({int(r["chunk_mib"]) for r in cells})
    clients = sorted({int(r["clients"]) for r in cells if r["path"] in ("grpc", "shm")})
    w("## Same host: shared memory against gRPC, memcpy and loopback TCP\n")
    w("Command: `" + rd(os.path.join(d, "command.txt")).strip() + "` (one kvtierd, "
      "`--write-mode=ram-only --shm-socket=auto`, its pool filled once before the first "
      "cell; every figure below from this one run). `shm` clients use "
      "`data_plane=kSharedMemory` and move chunks with Put from / GetInto an "
      "`AllocateShared` buffer; `grpc` clients use `data_plane=kStream` with Put from / "
      "GetInto a plain buffer. Each client is a thread with its own connection and buffer, "
      "set up before the clock starts; gets cycle over a 1 GiB hot set resident in the "
      "pool. Every chunk's CRC32C is checked on either path (by the client on the stream, "
      "by the daemon in the copy on shared memory). memcpy is single-thread, median of 15: "
      "`hot` between two cache-resident buffers, `ws` from a 1 GiB working set (the "
      "memory traffic a get has). TCP: one chunk over a loopback connection between two "
      "threads, into a buffer, median. GB/s = 10^9 bytes/s over the cell's wall time.\n")
    m = rd(os.path.join(d, "machine.txt")).strip()
    if m:
        w("```\n" + m + "\n```\n")
    w("| target | shared memory | baseline | ratio | required | status |")
    w("|---|---|---|---|---|---|")
    # Against single-thread memcpy, the fair figure is one client (one daemon thread
    # copying); more clients let the daemon copy on every core, which a single-thread
    # memcpy does not. Both are shown; the status is the one-client figure's.
    for op, need, sizes in (("get", 0.7, [c for c in chunks if c >= 32]), ("put", 0.5, chunks)):
        for c in sizes:
            one_c, top = get("shm", op, c, 1), best("shm", op, c)
            hot, ws = get("memcpy", "copy_hot", c), get("memcpy", "copy_ws", c)
            if not (one_c and top and hot and ws):
                continue
            w(f"| {op} {c} MiB, 1 client vs single-thread memcpy (working set / cache-hot) | "
              f"{one_c['gbps']:.2f} GB/s (p50 {one_c['p50_ms']:.2f} ms) | {ws['gbps']:.2f} / {hot['gbps']:.2f} GB/s | "
              f"{ratio(one_c['gbps'], ws['gbps'])} / {ratio(one_c['gbps'], hot['gbps'])} | >= {need} | "
              f"{met(one_c['gbps'] >= need * ws['gbps'])} / {met(one_c['gbps'] >= need * hot['gbps'])} |")
            w(f"| {op} {c} MiB, best client count ({int(top['clients'])}) vs the same | {top['gbps']:.2f} GB/s | "
              f"{ws['gbps']:.2f} / {hot['gbps']:.2f} GB/s | {ratio(top['gbps'], ws['gbps'])} / "
              f"{ratio(top['gbps'], hot['gbps'])} | >= {need} | {met(top['gbps'] >= need * ws['gbps'])} / "
              f"{met(top['gbps'] >= need * hot['gbps'])} |")
            if op == "get":
                g = best("grpc", "get", c)
                if g:
                    w(f"| get {c} MiB vs the gRPC path (best client count each) | {top['gbps']:.2f} GB/s | "
                      f"{g['gbps']:.2f} GB/s ({int(g['clients'])} clients) | {ratio(top['gbps'], g['gbps'])} | "
                      f">= 2 | {met(top['gbps'] >= 2 * g['gbps'])} |")
    lat = get("shm", "get_latency", chunks[0]) if chunks else None
    glat = get("grpc", "get_latency", chunks[0]) if chunks else None
    if lat:
        w(f"| {chunks[0]} MiB get, p50 of {int(lat['ops'])} (1 client, idle daemon) | {lat['p50_ms']:.3f} ms "
          f"(p99 {lat['p99_ms']:.3f}) | gRPC {glat['p50_ms'] if glat else 0:.3f} ms | | < 0.5 ms | "
          f"{met(lat['p50_ms'] < 0.5)} |")
    for r in (x for x in rows if x.get("kind") == "samehost_regions"):
        w(f"| daemon memory with {int(r['daemon_regions'])} regions registered ({r['region_gib']:.2f} GiB, "
          f"each written by a get) | anonymous RSS {r['anon_delta_mib']:+.1f} MiB, page tables "
          f"{r['pte_delta_mib']:+.1f} MiB | | | bounded | {met(r['anon_delta_mib'] < 64)} |")
    w("")
    w("| chunk | clients | op | shm GB/s | shm p50/p99 ms | gRPC GB/s | gRPC p50/p99 ms | shm/gRPC | "
      "shm/memcpy ws | shm/memcpy hot | gRPC/TCP |")
    w("|---|---|---|---|---|---|---|---|---|---|---|")

    def gb(x):
        return f"{x['gbps']:.2f}" if x else "-"

    def lt(x):
        return f"{x['p50_ms']:.2f} / {x['p99_ms']:.2f}" if x else "-"
    for c in chunks:
        hot, ws, tcp = get("memcpy", "copy_hot", c), get("memcpy", "copy_ws", c), get("tcp", "recv", c)
        for op in ("get", "put"):
            for n in clients:
                s, g = get("shm", op, c, n), get("grpc", op, c, n)
                if not s and not g:
                    continue
                errs = sum(int(x.get("errors", 0)) for x in (s, g) if x)
                w(f"| {c} MiB | {n} | {op} | {gb(s)} | {lt(s)} | {gb(g)} | {lt(g)} | "
                  f"{ratio(s and s['gbps'], g and g['gbps'])} | {ratio(s and s['gbps'], ws and ws['gbps'])} | "
                  f"{ratio(s and s['gbps'], hot and hot['gbps'])} | {ratio(g and g['gbps'], tcp and tcp['gbps'])} |"
                  + (f" {errs} errors" if errs else ""))
        w(f"| {c} MiB | | baselines | memcpy hot {gb(hot)}, ws {gb(ws)}, loopback TCP {gb(tcp)} GB/s | | | | | | | |")
    w("")
    if os.path.exists(os.path.join(d, "samehost.png")):
        w("![same host](results/samehost/samehost.png)\n")
    for r in (x for x in rows if x.get("kind") == "samehost_regions"):
        w(f"Regions: one client registered {int(r['regions'])} regions of {r['region_mib']:.0f} MiB and got a "
          f"chunk into each. The daemon's anonymous memory went {r['anon_before_mib']:.0f} -> "
          f"{r['anon_with_mib']:.0f} MiB and its page tables grew {r['pte_delta_mib']:.1f} MiB; the "
          f"{r['shmem_with_mib']:.0f} MiB of shared pages it had mapped are the client's memfds "
          f"(counted in RssShmem, freed with them: {r['shmem_after_mib']:.0f} MiB once the client "
          f"closed its connection).\n")


def cache(res, w):
    """Eviction policies and hints on the trace (cache_bench), from bench/results/cache/."""
    d = os.path.join(res, "cache")
    rows = jsonl(os.path.join(d, "cache.jsonl"))
    if not rows:
        return
    w("## Keeping what will be reused: eviction policies and hints (issue 12)\n")
    cmds = rd(os.path.join(d, "commands.txt")).strip()
    if cmds:
        w("Commands:\n\n```\n" + cmds + "\n```\n")
    t = next((r for r in rows if r.get("kind") == "cache_trace"), None)
    if t:
        w(f"Trace `{os.path.basename(t['trace'])}`: {int(t['requests'])} requests, "
          f"{int(t['chunk_refs'])} chunk references, {int(t['unique_chunks'])} distinct chunks of "
          f"{t['chunk_kib']:.0f} KiB (the pool's slot, so capacity counts chunks). Recompute time "
          f"saved: the sum of a + b*i over the prefix hits, a = {t['a']} s, b = {t['b']} s (the Cake "
          f"benchmark's fit).\n")
    sims = {(int(r["ram_pct"]), r["sim"]): r for r in rows if r.get("kind") == "cache_sim"}
    cells = [r for r in rows if r.get("kind") == "cache_cell"]
    if cells:
        w("### Hit ratio by policy, with and without hints (ram-only, one client in trace order)\n")
        w("Per request, as an engine does: Lookup, Get the prefix hits, Put the absent chunks after "
          "them. `sim lru` and `sim belady` are computed by the benchmark over the same sequence "
          "(Belady: MIN with bypass, an upper bound). \"LRU..Belady\" places the prefix hit ratio "
          "between the two (0% = LRU, 100% = Belady).\n")
        w("| RAM % of distinct | policy | hints | prefix hit ratio | vs LRU sim | LRU..Belady | "
          "recompute saved s | vs LRU sim | daemon CPU s | Hint handler s |")
        w("|---|---|---|---|---|---|---|---|---|---|")
        for pct in sorted({int(r["ram_pct"]) for r in cells}):
            lru, opt = sims.get((pct, "lru")), sims.get((pct, "belady"))
            for name, s in (("sim lru", lru), ("sim belady", opt)):
                if s:
                    w(f"| {pct} | {name} | - | {s['prefix_hit_ratio']:.4f} | | | {s['saved_s']:.1f} | | | |")
            for r in (c for c in cells if int(c["ram_pct"]) == pct):
                base, top = r["lru_sim_prefix_hit_ratio"], r["belady_prefix_hit_ratio"]
                pos = (r["prefix_hit_ratio"] - base) / (top - base) * 100 if top > base else 0
                hints = f"next {int(r['hint_depth'])}" if r["hint_depth"] else "off"
                w(f"| {pct} | {r['policy']} | {hints} | {r['prefix_hit_ratio']:.4f} | "
                  f"{(r['prefix_hit_ratio'] / base - 1) * 100:+.1f}% | {pos:.0f}% | {r['saved_s']:.1f} | "
                  f"{(r['saved_s'] / r['lru_sim_saved_s'] - 1) * 100:+.1f}% | {r['daemon_cpu_s']:.1f} | "
                  f"{r['hint_handler_s']:.2f} |")
        w("")
    timed = [r for r in rows if r.get("kind") == "cache_timed"]
    if timed:
        r0 = timed[0]
        w(f"### Timed replay, write-back (RAM {int(r0['ram_pct'])}% of the distinct chunks, SSD holding "
          f"all, arrival times compressed {r0['compress']:.0f}x, {int(r0['workers'])} clients, "
          f"Lookup leases)\n")
        w("Target: with hints of the next 32 queued requests, >= 80% of the loaded (prefix-hit) chunks "
          "come from RAM.\n")
        w("| hints | policy | loaded chunks | from RAM | RAM share | prefix hit ratio | request p50 ms | "
          "p99 ms | p99.9 ms | daemon CPU s | Hint handler s (share of CPU) | errors |")
        w("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in timed:
            hints = (f"next {int(r['hint_depth'])}, every {int(r.get('hint_every', 1))}"
                     if r["hint_depth"] else "off")
            w(f"| {hints} | {r['policy']} | {int(r['loaded'])} | {int(r['from_ram'])} | "
              f"{r['ram_share']:.3f} | {r['prefix_hit_ratio']:.4f} | {r['p50_ms']:.2f} | "
              f"{r['p99_ms']:.2f} | {r['p999_ms']:.2f} | {r['daemon_cpu_s']:.1f} | "
              f"{r['hint_handler_s']:.2f} ({r['hint_cpu_share'] * 100:.1f}%) | {int(r['errors'])} |")
        w("")
    write_notes(d, w)


def security_ceiling(rows, med, w):
    """tls_ceiling_bench's rows (bench/security.sh runs it after the grid): loopback TCP
    against OpenSSL TLS 1.3 between two processes, no gRPC."""
    ceil = [r for r in rows if r.get("kind") == "tls_ceiling"]
    if not ceil:
        return
    by = {}
    for r in ceil:
        by.setdefault(r["variant"], []).append(r)
    m = lambda v, f: statistics.median(r[f] for r in by[v])
    if "tcp" not in by:
        return
    tcp = m("tcp", "gbps")
    grid = med.get(("plaintext", "get", 32, 1))
    w(f"The ceiling of any TLS path on this machine, in the same script: `tls_ceiling_bench` "
      f"moves {ceil[0]['bytes'] / 2**30:.0f} GiB in {ceil[0]['message_bytes'] / 2**20:.0f} MiB "
      f"messages from one process to another over loopback, plain TCP or TLS 1.3 "
      f"(OpenSSL), with no gRPC and no daemon; medians of {len(by.get('tcp', []))} "
      f"interleaved rounds. The last column compares each with the grid's plaintext get "
      f"(32 MiB, 1 client) above:\n")
    w("| transport | GB/s | / TCP | sender / receiver CPU s per GB | / plaintext get above |")
    w("|---|---|---|---|---|")
    for v in ("tcp", "tls-aes256", "tls-aes128"):
        if v not in by:
            continue
        g = m(v, "gbps")
        w(f"| {v} | {g:.3f} | {g / tcp:.2f} | {m(v, 'send_cpu_s_per_gb'):.2f} / "
          f"{m(v, 'recv_cpu_s_per_gb'):.2f} | " + (f"{g / grid:.2f}" if grid else "-") + " |")
    w("")


def security(res, w):
    """TLS and tenants on the RAM tier (bench/security.sh), from bench/results/security/."""
    d = os.path.join(res, "security")
    rows = jsonl(os.path.join(d, "security.jsonl"))
    cells = [r for r in rows if r.get("kind") == "cell"]
    if not cells:
        return
    w("## What TLS and tenants cost (issue 13)\n")
    w("Target: TLS costs at most 15% of RAM-tier get throughput at 32 MiB. One kvtierd per run "
      "(RAM tier, ram-only), runs of plaintext, TLS (server certificate, ECDSA P-256), and TLS "
      "with a tenant's bearer token interleaved; medians over the runs, GB/s. Commands:\n")
    cmds = rd(os.path.join(d, "commands.txt")).strip().splitlines()
    w("```\nbash bench/security.sh\n" + "\n".join(dict.fromkeys(cmds)) + "\n```\n")
    key = lambda r: (r["op"], int(r["chunk_mib"]), int(r["clients"]))
    med = {}
    for r in cells:
        med.setdefault((r["tier"],) + key(r), []).append(r["gbps"])
    med = {k: statistics.median(v) for k, v in med.items()}
    runs = max(len([r for r in cells if r["tier"] == "plaintext" and key(r) == k])
               for k in {key(r) for r in cells})
    w(f"| op | chunk | clients | plaintext | TLS | TLS / plaintext | TLS + token | "
      f"(TLS + token) / plaintext |")
    w("|---|---|---|---|---|---|---|---|")
    for k in sorted({key(r) for r in cells}):
        p, t, tt = (med.get((lab,) + k) for lab in ("plaintext", "tls", "tls+token"))
        if not p:
            continue
        ratio = lambda x: f"{x / p:.2f}" if x else "-"
        num = lambda x: f"{x:.3f}" if x else "-"
        flag = ""
        if k[0] == "get" and k[1] == 32 and t:
            flag = " (target >= 0.85: " + ("met" if t / p >= 0.85 else "missed") + ")"
        w(f"| {k[0]} | {k[1]} MiB | {k[2]} | {num(p)} | {num(t)} | {ratio(t)}{flag} | {num(tt)} | "
          f"{ratio(tt)} |")
    w(f"\n{runs} runs per variant.\n")
    security_ceiling(rows, med, w)
    cpu = [r for r in cells if r.get("daemon_cpu_s")]
    if cpu:
        # CPU seconds per GB moved (user + system, over the cell), medians over the runs:
        # the daemon's and the clients' (kv_bench's own process).
        per = {}
        for r in cpu:
            gb = r["bytes"] / 1e9
            per.setdefault((r["tier"],) + key(r), []).append(
                (r["daemon_cpu_s"] / gb, r["client_cpu_s"] / gb))
        w("CPU seconds per GB moved, daemon / clients (user + system over each cell, from "
          "`/proc/PID/stat`; medians over the runs). Both ends share this machine's 2 cores, "
          "so their sum bounds the rate at 2 / (sum) GB/s:\n")
        w("| op | chunk | clients | plaintext | TLS | TLS + token | daemon TLS / plaintext |")
        w("|---|---|---|---|---|---|---|")
        for k in sorted({key(r) for r in cpu}):
            vals = {}
            for lab in ("plaintext", "tls", "tls+token"):
                xs = per.get((lab,) + k)
                if xs:
                    vals[lab] = (statistics.median(x[0] for x in xs),
                                 statistics.median(x[1] for x in xs))
            if "plaintext" not in vals:
                continue
            fmt = lambda lab: (f"{vals[lab][0]:.2f} / {vals[lab][1]:.2f}" if lab in vals else "-")
            rat = (f"{vals['tls'][0] / vals['plaintext'][0]:.2f}"
                   if "tls" in vals and vals["plaintext"][0] else "-")
            w(f"| {k[0]} | {k[1]} MiB | {k[2]} | {fmt('plaintext')} | {fmt('tls')} | "
              f"{fmt('tls+token')} | {rat} |")
        w("")
    write_notes(d, w)


def churn(res, w):
    """SSD write amplification under churn (bench/churn_bench.py), from
    bench/results/churn/: device bytes per payload byte over puts of ten times
    ssd_capacity, per daemon build (label) and write mode."""
    d = os.path.join(res, "churn")
    rows = jsonl(os.path.join(d, "churn.jsonl"))
    if not rows:
        return
    w("## SSD write amplification under churn (issue 10)\n")
    w("Target: at most 1.15 bytes written to the device per payload byte (`/proc/PID/io` "
      "write_bytes, RocksDB included). The grid above writes into an SSD tier with room; "
      "this one puts ten times `ssd_capacity` into a full one (64 MiB, 128 KiB chunks, a "
      "16 MiB pool, plain LRU, no deletes or reads), so every put evicts, and counts what "
      "garbage collection moved (`kvtier_ssd_gc_bytes_total`). Medians over the rounds. "
      "Command:\n")
    w("```\n" + rd(os.path.join(d, "command.txt")).strip() + "\n```\n")
    w("| daemon | write mode | rounds | put MiB | device MiB | device bytes per payload byte "
      "| GC moved MiB | target |")
    w("|---|---|---|---|---|---|---|---|")
    groups = {}
    for r in rows:
        groups.setdefault((r.get("label", ""), r["mode"]), []).append(r)
    for (label, mode), rs in sorted(groups.items()):
        ratio = statistics.median(r["ratio"] for r in rs)
        w(f"| {label} | {mode} | {len(rs)} | "
          f"{statistics.median(r['put_bytes'] for r in rs) / 2**20:.0f} | "
          f"{statistics.median(r['device_bytes'] for r in rs) / 2**20:.0f} | {ratio:.3f} | "
          f"{statistics.median(r['gc_bytes'] for r in rs) / 2**20:.0f} | "
          f"{'**MET**' if ratio <= 1.15 else '**NOT MET**'} |")
    w("")
    write_notes(d, w)


def manycore(res, w):
    """The two CPU-bound misses on a larger host (bench/manycore_bundle.sh), from
    bench/results/manycore/: the same cells pinned to 2 of its CPUs and on all of them."""
    d = os.path.join(res, "manycore")
    cells = [r for r in jsonl(os.path.join(d, "manycore.jsonl")) if r.get("kind") == "cell"]
    if not cells:
        return
    w("## TLS and 2 MiB puts on 2 and on 16 CPUs of one host (issues 10 and 13)\n")
    w("Issue 13's TLS ratio and issue 10's 2 MiB put against Redis SET miss on the 2-core VM "
      "above, where client, daemon and cipher share two cores. These runs ask whether the "
      "core count is the cause: the same cells on one larger host, first pinned to CPUs 0-1 "
      "(`taskset`), then on all of its CPUs; kvtierd plaintext and TLS with "
      "`bench/security.sh`'s arguments, Redis with `bench/run.sh`'s. Medians over the "
      "rounds, GB/s. Commands:\n")
    w("```\n" + rd(os.path.join(d, "command.txt")).strip() + "\n```\n")
    w("Host: " + rd(os.path.join(d, "run.log")).splitlines()[0].replace("cpu: ", "") + ".\n")
    med = {}
    for r in cells:
        tier, _, cpus = r["tier"].rpartition("-")
        med.setdefault((cpus, tier, r["op"], int(r["chunk_mib"]), int(r["clients"])),
                       []).append(r["gbps"])
    runs = {k: len(v) for k, v in med.items()}
    med = {k: statistics.median(v) for k, v in med.items()}
    w("| CPUs | op | chunk | clients | plaintext | TLS | TLS / plaintext | Redis | "
      "plaintext / Redis |")
    w("|---|---|---|---|---|---|---|---|---|")
    for cpus in sorted({k[0] for k in med}, key=lambda c: int(c.rstrip("cpu"))):
        for op, c, n in sorted({k[2:] for k in med if k[0] == cpus}):
            p, t, r = (med.get((cpus, tier, op, c, n)) for tier in ("plaintext", "tls", "redis"))
            if not p:
                continue
            num = lambda x: f"{x:.3f}" if x else "-"
            ratio = lambda a, b: f"{a / b:.2f}" if a and b else "-"
            w(f"| {cpus.rstrip('cpu')} | {op} | {c} MiB | {n} | {num(p)} | {num(t)} | "
              f"{ratio(t, p)} | {num(r)} | {ratio(p, r)} |")
    w(f"\n{max(v for k, v in runs.items() if k[1] != 'redis')} rounds of kvtierd, "
      f"{max(v for k, v in runs.items() if k[1] == 'redis')} of Redis, per CPU set.\n")
    pin = [r for r in jsonl(os.path.join(d, "pin.jsonl")) if r.get("kind") == "cell"]
    if pin:
        w("Where the threads run (`bash DIR/pin.sh OUT 2`, another lease of the same kind of "
          "host): plaintext only, the client and the daemon free on all CPUs, both on CPUs "
          "0-1, the client on 0-1 and the daemon on 2-3, each on four CPUs of its own. "
          "Medians of the rounds, GB/s:\n")
        places = list(dict.fromkeys(r["tier"] for r in pin))
        pmed = {}
        for r in pin:
            pmed.setdefault((r["tier"], r["op"], int(r["chunk_mib"]), int(r["clients"])),
                            []).append(r["gbps"])
        w("| op | chunk | clients | " + " | ".join(places) + " |")
        w("|---|---|---|" + "---|" * len(places))
        for op, c, n in sorted({k[1:] for k in pmed}):
            w(f"| {op} | {c} MiB | {n} | " + " | ".join(
                f"{statistics.median(pmed[(p,) + (op, c, n)]):.3f}" if (p, op, c, n) in pmed
                else "-" for p in places) + " |")
        w("")
    write_notes(d, w)


def ssd_fio(res, w):
    """The SSD tier against fio, round by round (bench/ssd_fio.sh), from bench/results/ssd_fio/."""
    d = os.path.join(res, "ssd_fio")
    rows = jsonl(os.path.join(d, "ssd_fio.jsonl"))
    cells = [r for r in rows if r.get("kind") == "cell"]
    if not cells:
        return
    fio = {}
    for r in rows:
        if r.get("kind") == "fio":
            fio.setdefault((r["round"], r["rw"]), []).append(r["gbps"])
    fio = {k: statistics.mean(v) for k, v in fio.items()}
    rounds = sorted({r["round"] for r in cells})
    w("## SSD tier against fio, round by round (issue 10)\n")
    w("Targets: SSD-tier put at least 0.7 x fio's sequential write, get at least 0.8 x its "
      "sequential read. This VM's disk swings by 2x between fio runs minutes apart, so each "
      "round runs fio (write, read), the SSD-tier grid over the gRPC stream (`grpc`), the same "
      "grid over the same-host data plane (`shm`: Put from and GetInto shared memory, no "
      "loopback TCP), and fio again; each cell is divided by the mean of its round's fio runs, "
      "and the tables give medians over the rounds (each op's best client count in the first "
      "table). Write-through, 512 MiB pool; gets cycle over everything the put cells wrote, so "
      "every read is an SSD read. Commands:\n")
    w("```\n" + rd(os.path.join(d, "commands.txt")).strip() + "\n```\n")
    fw = [fio[(r, "write")] for r in rounds if (r, "write") in fio]
    fr = [fio[(r, "read")] for r in rounds if (r, "read") in fio]
    if fw and fr:
        w(f"fio per round (mean of the two runs), GB/s: write "
          f"{', '.join(f'{x:.2f}' for x in fw)}; read {', '.join(f'{x:.2f}' for x in fr)}.\n")
    key = lambda r: (r["tier"], r["op"], int(r["chunk_mib"]), int(r["clients"]))
    by = {}
    for r in cells:
        base = fio.get((r["round"], "write" if r["op"] == "put" else "read"))
        if base:
            by.setdefault(key(r), []).append((r["gbps"], r["gbps"] / base, r.get("write_amp", 0)))
    med = lambda xs: statistics.median(xs) if xs else 0.0
    w("| plane | op | chunk | best clients | GB/s | / fio (median) | / fio (rounds) | "
      "required | status |")
    w("|---|---|---|---|---|---|---|---|---|")
    for plane in ("grpc", "shm"):
        for op in ("put", "get"):
            for c in sorted({k[2] for k in by}):
                ks = [k for k in by if k[:3] == (plane, op, c)]
                if not ks:
                    continue
                k = max(ks, key=lambda k: med([x[1] for x in by[k]]))
                ratios = [x[1] for x in by[k]]
                need = 0.7 if op == "put" else 0.8
                ok = med(ratios) >= need
                w(f"| {plane} | {op} | {c} MiB | {k[3]} | {med([x[0] for x in by[k]]):.3f} | "
                  f"{med(ratios):.2f} | {', '.join(f'{x:.2f}' for x in ratios)} | >= {need} | "
                  f"{'**MET**' if ok else '**NOT MET**'} |")
    w("")
    w("Every cell (medians over rounds; device bytes per payload byte from the daemon's "
      "`/proc/PID/io` for puts):\n")
    w("| plane | op | chunk | clients | GB/s | / fio | device bytes per byte |")
    w("|---|---|---|---|---|---|---|")
    for k in sorted(by):
        amp = med([x[2] for x in by[k]]) if k[1] == "put" else None
        w(f"| {k[0]} | {k[1]} | {k[2]} MiB | {k[3]} | {med([x[0] for x in by[k]]):.3f} | "
          f"{med([x[1] for x in by[k]]):.2f} | {f'{amp:.3f}' if amp else '-'} |")
    w("")
    w("Throughput at the most clients against the peak over client counts (target >= 0.9):\n")
    w("| plane | op | chunk | most clients / peak |")
    w("|---|---|---|---|")
    for plane, op, c in sorted({k[:3] for k in by}):
        ks = sorted((k for k in by if k[:3] == (plane, op, c)), key=lambda k: k[3])
        g = {k[3]: med([x[0] for x in by[k]]) for k in ks}
        top = max(g, key=g.get)
        w(f"| {plane} | {op} | {c} MiB | {g[ks[-1][3]] / g[top]:.2f} (peak at {top}) |")
    w(f"\n{len(rounds)} rounds.\n")
    write_notes(d, w)


def overload(res, w):
    """Issue 13's overload target (bench/overload.sh), from bench/results/overload/."""
    d = os.path.join(res, "overload")
    rows = jsonl(os.path.join(d, "overload.jsonl"))
    if not rows:
        return
    w("## Overload: put streams past the pool, stalled clients (issue 13)\n")
    w("Target: 256 concurrent put streams totalling 10x the RAM pool plus 32 stalled clients; "
      "peak RSS within the pool + 15% + a fixed allowance, health and Lookup p99 under 10 ms, "
      "every refusal RESOURCE_EXHAUSTED. The stalled clients send half a chunk and go quiet "
      "(reaped after client_idle_timeout, 3 s here); refused puts back off from the daemon's "
      "hint, exponentially with jitter, and retry. Load generator (at nice 19), prober and "
      "daemon share this machine's 2 cores. Commands:\n")
    cmds = rd(os.path.join(d, "commands.txt")).strip().splitlines()
    w("```\nbash bench/overload.sh\n" + "\n".join(cmds) + "\n```\n")
    w("| daemon | peak RSS / pool | outside the pool | stored GB/s | puts OK / refused | "
      "stalled reaped | oversized frames sent (cancelled) | other statuses (probes failed) | "
      "health p50 / p99 ms | Lookup p50 / p99 ms |")
    w("|---|---|---|---|---|---|---|---|---|---|")
    names = {"shipped": "shipped (max_put_buffer default: 8 streams per CPU, 96 MiB here)",
             "before": "defaults before 0df07cc (256 MiB, a line of 64, no put_place_idle)",
             "unbounded": "max_put_buffer lifted (baseline)",
             "hostile": "shipped + 4 clients sending 256 MiB frames",
             "hostile_bounded": "the same, grpc_memory 512 MiB (reached)"}
    fallback = ["shipped", "unbounded"]  # Rows from before the benchmark wrote labels.
    for i, r in enumerate(rows):
        label = r.get("label") or (fallback[i] if i < len(fallback) else "?")
        name = names.get(label, label)
        pool = r["pool_mib"]
        w(f"| {name} | {r['rss_peak_mib'] / pool:.3f} | {r['rss_peak_mib'] - pool:.0f} MiB | "
          f"{r['stored_gib'] * 1.073741824 / r['secs']:.2f} | {r['puts_ok']:.0f} / "
          f"{r['puts_refused']:.0f} | {r['stalls_reaped']:.0f} / {r['stalled']:.0f} | "
          f"{r.get('oversized_sent', 0):.0f} ({r.get('oversized_cancelled', 0):.0f}) | "
          f"{r['unexpected'] + r['probe_errors']:.0f} ({r['probe_errors']:.0f}) | "
          f"{r['health_p50_ms']:.1f} / "
          f"{r['health_p99_ms']:.1f} | {r['lookup_p50_ms']:.1f} / {r['lookup_p99_ms']:.1f} |")
    write_notes(d, w, lead="\n")


def remote(res, w):
    """Issue 14's shared tier (bench/remote.sh), from bench/results/remote/."""
    d = os.path.join(res, "remote")
    rows = jsonl(os.path.join(d, "remote.jsonl"))
    local = [r for r in jsonl(os.path.join(d, "local.jsonl")) if r.get("kind") == "cell"]
    shared = [r for r in jsonl(os.path.join(d, "shared.jsonl")) if r.get("kind") == "shared_cell"]
    if not rows and not local and not shared:
        return
    w("## The shared tier on Redis Cluster (issue 14)\n")
    cmds = rd(os.path.join(d, "commands.txt")).strip().splitlines()
    w("Commands:\n")
    w("```\nbash bench/remote.sh\n" + "\n".join(dict.fromkeys(cmds)) + "\n```\n")
    if rows:
        w("### Remote-tier throughput against raw SET/GET\n")
        w("Target: remote-tier get >= 0.8x raw Redis GET of the same bytes, put >= 0.8x raw "
          "SET. A three-master cluster on loopback (no replicas), started by the benchmark. "
          "The tier's puts run on its two background writers, as in the daemon; its gets and "
          "the baseline on one thread. Each cell moves at least 256 MiB (at least 16 chunks). "
          "The tier writes (EXISTS, then the segments pipelined over the masters, "
          "then the commit record) and reads (the record, then the segments, verifying each "
          "segment's and the chunk's CRC32C). The baseline SETs and GETs the same 1 MiB "
          "segments with the same client and batching, and nothing else. Medians of the "
          "rounds (interleaved).\n")
        med = {}
        for r in rows:
            med.setdefault((round(r["chunk_bytes"] / 2**20), r["op"], r["path"]), []).append(r["gbps"])
        med = {k: statistics.median(v) for k, v in med.items()}
        w("| chunk | op | raw GB/s | remote tier GB/s | ratio (>= 0.8) |")
        w("|---|---|---|---|---|")
        names = {"put": "put", "get": "get, all chunks at once (a Get's fetch)",
                 "get1": "get, one chunk at a time"}
        for mib in sorted({k[0] for k in med}):
            for op in ("put", "get", "get1"):
                raw, tier = med.get((mib, op, "raw")), med.get((mib, op, "remote"))
                if not raw or not tier:
                    continue
                verdict = "met" if tier / raw >= 0.8 else "missed"
                w(f"| {mib} MiB | {names[op]} | {raw:.2f} | {tier:.2f} | {tier / raw:.2f} ({verdict}) |")
        w("")
    if local:
        w("### The local tiers with the cluster down\n")
        w("Target: with the cluster down, local-tier throughput within 5% of a daemon with no "
          "remote tier. RAM tier (ram-only); the shared tier's seeds point at an address "
          "where nothing listens, so the daemon starts degraded, drops each chunk's remote "
          "write without queueing it and probes again with backoff. Runs interleaved, the "
          "order alternating; medians, GB/s.\n")
        key = lambda r: (r["op"], int(r["chunk_mib"]), int(r["clients"]))
        med = {}
        for r in local:
            med.setdefault((r["tier"],) + key(r), []).append(r["gbps"])
        med = {k: statistics.median(v) for k, v in med.items()}
        w("| op | chunk | clients | no shared tier | cluster down | ratio (>= 0.95) |")
        w("|---|---|---|---|---|---|")
        for k in sorted({key(r) for r in local}):
            a, b = med.get(("no-remote",) + k), med.get(("cluster-down",) + k)
            if not a or not b:
                continue
            verdict = "met" if b / a >= 0.95 else "missed"
            w(f"| {k[0]} | {k[1]} MiB | {k[2]} | {a:.3f} | {b:.3f} | {b / a:.3f} ({verdict}) |")
        runs = max(len([r for r in local if r["tier"] == "no-remote" and key(r) == k])
                   for k in {key(r) for r in local})
        w(f"\n{runs} runs per variant.\n")
    if shared:
        w("### Three daemons round robin, with and without the shared tier\n")
        w("Target: the three-daemon round-robin replay reaches >= 0.9x the hit ratio of one "
          "daemon holding everything. The Mooncake trace, request i sent to daemon i % 3 "
          "(a cache-unaware balancer), arrival times compressed 20x, 8 clients; each daemon "
          "ram-only with the stated share of the trace's distinct chunks in RAM; per "
          "request Lookup, Get of the prefix hits, Put of the rest. Recompute time saved is "
          "the Cake fit's a + b*i summed over the prefix hits.\n")
        w("| daemons | RAM each | shared tier | prefix hit ratio | vs one daemon | recompute "
          "saved s | vs one daemon | chunks from the shared tier | remote writes | p50 / p99 ms |")
        w("|---|---|---|---|---|---|---|---|---|---|")
        ref = next((r for r in shared if r["daemons"] == 1), None)
        for r in shared:
            rel = r["prefix_hit_ratio"] / ref["prefix_hit_ratio"] if ref else 0
            verdict = ""
            if r["daemons"] > 1:
                verdict = " (" + ("met" if rel >= 0.9 else "missed") + ")" if r["shared"] else ""
            w(f"| {r['daemons']:.0f} | {r['ram_pct']:.0f}% | {'yes' if r['shared'] else 'no'} | "
              f"{r['prefix_hit_ratio']:.4f} | {rel:.3f}{verdict} | {r['saved_s']:.0f} | "
              f"{r['saved_s'] / ref['saved_s'] if ref else 0:.3f} | {r['from_remote']:.0f} | "
              f"{r['remote_writes']:.0f} | {r['p50_ms']:.1f} / {r['p99_ms']:.1f} |")
        w("")
    write_notes(d, w)


def gpu(res, w):
    """The GPU tier (gpu_bench and gpu_worker_bench; bench/run.sh on a GPU host, or the
    bundle of bench/gpu_bundle.sh)."""
    d = os.path.join(res, "gpu")
    w("## GPU tier: into a worker's GPU memory vs cudaMemcpyAsync (issue 11)\n")
    rows = jsonl(os.path.join(d, "gpu.jsonl"))
    worker = jsonl(os.path.join(d, "gpu_worker.jsonl"))
    if not rows and not worker:
        w("Not measured: no GPU has been available to this project (the benchmarks exit "
          "saying so). The GPU logic is tested against a fake device; `ctest -L gpu` and "
          "`bash bench/gpu_bundle.sh build DIR && bash DIR/run.sh OUT` are what to run on a "
          "GPU host.\n")
        return
    w("Commands: " + rd(os.path.join(d, "command.txt")).strip() + "\n")
    w("Device: " + rd(os.path.join(d, "device.txt")).strip().replace("\n", "; ") + "\n")
    if rows:
        w("**In-process** (`gpu_bench`: the store's GPU path without the RPC; a fresh chunk "
          "per rep from the page-locked pool, medians of 20). `DMA` and `CRC32C` time a host "
          "delivery's parts alone on the same chunk: the copy, and its check on the CPU "
          "(one thread; split over the GPU tier's threads) or on the GPU after the copy "
          "(which a whole chunk gets where the device checks).\n")
        w("| chunk | cudaMemcpyAsync GB/s | host path GB/s | ratio (>= 0.8) | DMA from pool "
          "GB/s | CRC32C 1 thread GB/s | CRC32C split GB/s | staging (D2D) GB/s | CRC32C on GPU "
          "GB/s |")
        w("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            w(f"| {r['chunk_mib']:.0f} MiB | {r['baseline_gbps']:.1f} | {r['host_gbps']:.1f} | "
              f"{r['host_vs_baseline']:.2f} | {r.get('dma_from_pool_gbps', 0):.1f} | "
              f"{r.get('crc_1_thread_gbps', 0):.1f} | {r.get('crc_parallel_gbps', 0):.1f} | "
              f"{r['staging_gbps']:.0f} | {r.get('crc_on_gpu_gbps', 0):.0f} |")
        w("")
        parts = [r for r in rows if "lane_4k_us" in r]
        if parts:
            w("Where a host delivery's fixed cost goes, on the same pool chunk: a 4 KiB copy "
              "through a copy lane (the submission, the wait on its event and the hand-off "
              "back), the chunk's copies through a lane without and with the check, and the "
              "two CRC32C kernels alone, timed on the device.\n")
            w("| chunk | lane, 4 KiB us | lane copy GB/s | lane copy + check GB/s | CRC32C "
              "kernels us |")
            w("|---|---|---|---|---|")
            for r in parts:
                w(f"| {r['chunk_mib']:.0f} MiB | {r['lane_4k_us']:.0f} | "
                  f"{r['lane_copy_gbps']:.1f} | {r.get('lane_copy_crc_gbps', 0):.1f} | "
                  f"{r.get('crc_kernels_us', 0):.0f} |")
            w("")
    h2d = [r for r in worker if r.get("bench") == "gpu_worker_h2d"]
    if h2d:
        w("**Through the daemon** (`gpu_worker_bench`: a worker process, kvtierd with "
          "`--gpu=0`, GetIntoDevice into the worker's IPC-registered memory, timed from the "
          "call to its return; one key per call (median of 10) and 8 keys per call (median "
          "of 3); the baseline is this process's own cudaMemcpyAsync from cudaHostAlloc'd "
          "memory).\n")
        w("| chunk | cudaMemcpyAsync GB/s | RAM, 1 key GB/s | ratio | RAM, 8 keys GB/s | "
          "ratio (>= 0.8) | staging, 1 key GB/s | staging, 8 keys GB/s |")
        w("|---|---|---|---|---|---|---|---|")
        for r in h2d:
            w(f"| {r['chunk_mib']:.0f} MiB | {r['baseline_gbps']:.1f} | "
              f"{r['daemon_ram_gbps']:.1f} | {r['ram_vs_baseline']:.2f} | "
              f"{r.get('batch_ram_gbps', 0):.1f} | {r.get('batch_ram_vs_baseline', 0):.2f} | "
              f"{r['daemon_staging_gbps']:.0f} | {r.get('batch_staging_gbps', 0):.0f} |")
        w("")
        absent = [r for r in h2d if "absent_get_us" in r]
        if absent:
            w("The call's own cost, without a copy: a GetIntoDevice of one key the daemon "
              "does not hold took " + ", ".join(
                  f"{r['absent_get_us']:.0f} us" for r in absent) + " (median, in the "
              "runs of the rows above).\n")
    for r in worker:
        if r.get("bench") == "gpu_worker_layerwise":
            w(f"**Layer-wise load beside compute**: {r['chunks']:.0f} chunks of "
              f"{r['layers']:.0f} x 1 MiB layers, each layer's compute a "
              f"{r['compute_layer_ms']:.3f} ms kernel on every SM queued once its layer "
              f"landed. Load alone {r['load_only_ms']:.1f} ms, compute alone "
              f"{r['compute_only_ms']:.1f} ms, both pipelined {r['pipelined_ms']:.1f} ms; "
              f"the compute stream was busy {100 * r['compute_busy_share']:.1f}% of its span, "
              f"and {100 * r['median_overlap_k_with_k_minus_1']:.0f}% (median) of chunk k's "
              f"transfer ran while chunk k-1 computed.\n")
            if "events_pipelined_ms" in r:
                first = ""
                if "events_first_layer_ms" in r:
                    first = (f"; its first layer was ready for the worker's GPU after "
                             f"{r['events_first_layer_ms']:.2f} ms (its frame reached the "
                             f"host after {r['first_layer_frame_ms']:.2f} ms without events)")
                w(f"With `record_events` (the compute stream waits on the worker's IPC event "
                  f"the daemon records after each layer, queued from the layer's frame as soon "
                  f"as its copies are queued; the host waits on nothing per layer): one chunk "
                  f"loaded in {r['events_load_chunk_ms']:.2f} ms (against "
                  f"{r['load_chunk_ms']:.2f} ms with frames on landing, alternating, medians)"
                  f"{first}; the same pipeline took {r['events_pipelined_ms']:.1f} ms with the "
                  f"compute stream busy {100 * r['events_compute_busy_share']:.1f}% of its "
                  f"span.\n")
        if r.get("bench") == "gpu_worker_prefill":
            w(f"**Prefill session into GPU memory**: {r['chunks']:.0f} cached chunks of "
              f"{r['chunk_mib']:.0f} MiB, {r['compute_chunk_ms']:.2f} ms of compute each; "
              f"the worker computed {r['computed']:.0f} forward, the daemon streamed "
              f"{r['streamed']:.0f} backward into its memory (they met at chunk "
              f"{r['first_streamed']:.0f}, {r['reason']}): {r['session_ms']:.1f} ms against "
              f"{r['compute_only_ms']:.1f} ms computing all and {r['load_only_ms']:.1f} ms "
              f"loading all; the compute stream was busy "
              f"{100 * r['compute_busy_share']:.1f}% of its span.\n")
    if os.path.exists(os.path.join(d, "gpu_timeline.png")):
        w("![GPU timelines](results/gpu/gpu_timeline.png)\n")
    write_notes(d, w)


def main():
    res, header, out = sys.argv[1:4]
    rows = jsonl(os.path.join(res, "results.jsonl"))
    cells = [r for r in rows if r.get("kind") == "cell"]

    def one(kind):
        return [r for r in rows if r.get("kind") == kind]

    def cell(tier, op, c, n):
        for r in cells:
            if r["tier"] == tier and r["op"] == op and int(r["chunk_mib"]) == c and int(r["clients"]) == n:
                return r
        return None

    def peak(tier, op, c):
        cs = [r for r in cells if r["tier"] == tier and r["op"] == op and int(r["chunk_mib"]) == c]
        return max(cs, key=lambda r: r["gbps"]) if cs else None

    tcp = fio_r = fio_w = None
    try:
        tcp = json.loads(rd(os.path.join(res, "iperf3.json")))["end"]["sum_received"]["bits_per_second"] / 8e9
    except Exception:
        pass
    try:
        fio_r = json.loads(rd(os.path.join(res, "fio_read.json")))["jobs"][0]["read"]["bw_bytes"] / 1e9
        fio_w = json.loads(rd(os.path.join(res, "fio_write.json")))["jobs"][0]["write"]["bw_bytes"] / 1e9
    except Exception:
        pass
    mc = one("memcpy")
    memcpy = mc[0]["gbps"] if mc else None
    fio_note = rd(os.path.join(res, "fio_note.txt")).strip()

    def ratio(a, b):
        return f"{a / b:.2f}" if a is not None and b else "n/a"

    def met(ok):
        return "**MET**" if ok else "**NOT MET**"

    chunks = sorted({int(r["chunk_mib"]) for r in cells})
    clients = sorted({int(r["clients"]) for r in cells})
    L = []
    w = L.append
    w("# Benchmark results\n")
    w("Generated by `bash bench/run.sh` (do not edit by hand: static text lives in "
      "`bench/results_header.md`, the profile in `bench/profile.md`). Raw results: "
      "`bench/results/results.jsonl` and the logs next to it.\n")
    w("## Machine\n")
    w("```\n" + rd(os.path.join(res, "machine.txt")).strip() + "\n```\n")
    w("Machines here are shared and noisy (other builds and benchmarks run on the same 2 "
      "vCPUs); every ratio below compares figures measured in this same run.\n")

    # ---- targets ----
    w("## Targets\n")
    w("| target | kvtier | baseline | ratio | required | status |")
    w("|---|---|---|---|---|---|")
    for c in (32, 128):
        k, r = peak("ram", "get", c), peak("redis", "get", c)
        if k:
            w(f"| RAM-tier get, {c} MiB, vs loopback TCP | {k['gbps']:.2f} GB/s ({int(k['clients'])} clients) | "
              f"{tcp or 0:.2f} GB/s (iperf3, 1 stream) | {ratio(k['gbps'], tcp)} | >= 0.8 | "
              f"{met(tcp and k['gbps'] >= 0.8 * tcp)} |")
        if k and r:
            w(f"| RAM-tier get, {c} MiB, vs Redis | {k['gbps']:.2f} GB/s | {r['gbps']:.2f} GB/s "
              f"(Redis GET, {int(r['clients'])} clients) | {ratio(k['gbps'], r['gbps'])} | >= 1.5 | "
              f"{met(k['gbps'] >= 1.5 * r['gbps'])} |")
    for c in chunks:
        k = peak("ssd", "get", c)
        if k:
            w(f"| SSD-tier get, {c} MiB, vs fio seq read | {k['gbps']:.2f} GB/s ({int(k['clients'])} clients) | "
              f"{fio_r or 0:.2f} GB/s | {ratio(k['gbps'], fio_r)} | >= 0.7 | {met(fio_r and k['gbps'] >= 0.7 * fio_r)} |")
    lk = [r for r in one("lookup") if int(r["clients"]) == 1]
    if lk:
        w(f"| Lookup of 256 keys, p99 (1 client) | {lk[0]['p99_ms']:.3f} ms | | | < 1 ms | "
          f"{met(lk[0]['p99_ms'] < 1.0)} |")
    worst = None
    for tier in ("ram", "ssd"):
        for op in ("get", "put"):
            for c in chunks:
                p, k = peak(tier, op, c), cell(tier, op, c, 64)
                if p and k:
                    q = k["gbps"] / p["gbps"]
                    if worst is None or q < worst[0]:
                        worst = (q, tier, op, c)
    if worst:
        w(f"| throughput at 64 clients vs peak (worst cell: {worst[1]} {worst[2]}, {worst[3]} MiB) | "
          f"| | {worst[0]:.2f} | >= 0.9 | {met(worst[0] >= 0.9)} |")
    rss_log = rd(os.path.join(res, "rss.log"))
    for line in rss_log.splitlines():
        if line.startswith("| write-") or line.startswith("| ram-only"):
            f = [x.strip() for x in line.strip("|").split("|")]
            q = float(f[7])
            w(f"| resident memory, rss_bench {f[0]} (4x pool put load) | peak {f[6]} | pool {f[1]} | "
              f"{q:.3f} | <= 1.15 | {met(q <= 1.15)} |")
    for r in one("rss"):
        if "bound_mib" in r:
            # Issue 10's form: the pool x 1.15 plus the daemon's fixed allowance (its idle
            # process beside the pool, and the buffers its options bound), measured by
            # kv_bench at the daemon's start; explained under "Resident memory".
            allow = r["process_mib"] + r["buffers_mib"]
            w(f"| resident memory, {r['tier']}-tier grid daemon (all cells) | peak {r['peak_rss_mib']:.0f} MiB "
              f"({r['ratio']:.3f} x pool) | pool {r['pool_mib']:.0f} MiB x 1.15 + allowance {allow:.0f} MiB "
              f"= {r['bound_mib']:.0f} MiB | {r['peak_rss_mib'] / r['bound_mib']:.3f} of the bound | <= 1 | "
              f"{met(r['peak_rss_mib'] <= r['bound_mib'])} |")
        else:
            w(f"| resident memory, {r['tier']}-tier grid daemon (all cells) | peak {r['peak_rss_mib']:.0f} MiB | "
              f"pool {r['pool_mib']:.0f} MiB | {r['ratio']:.3f} | <= 1.15 | {met(r['ratio'] <= 1.15)} |")
    w("")
    w("A target that compares against the peak takes the best client count on each side. "
      "The 64-client row is the worst of all (tier, op, chunk) cells; every cell is in the "
      "scaling table below.\n")

    # ---- baselines ----
    w("## Baselines (same run)\n")
    w("| limit | tool | GB/s |")
    w("|---|---|---|")
    w(f"| memory | memcpy of 1 GiB buffers, one thread, median of 7 | {memcpy or 0:.2f} |")
    w(f"| network | iperf3 loopback TCP, one stream, 5 s | {tcp or 0:.2f} |")
    direct = "buffered (O_DIRECT unsupported)" if fio_note else "O_DIRECT"
    def fio_rounds(rw):
        text = rd(os.path.join(res, f"fio_{rw}_rounds.txt")).strip()
        return f" (median of {text})" if text else ""
    w(f"| SSD read | fio sequential read, 4 MiB blocks, iodepth 8, libaio, {direct}, 2 GiB{fio_rounds('read')} | {fio_r or 0:.2f} |")
    w(f"| SSD write | fio sequential write, same settings{fio_rounds('write')} | {fio_w or 0:.2f} |")
    w("| Redis | redis-server " + rd(os.path.join(res, "redis_cmd.txt")).strip().split("(")[-1].rstrip(")") +
      ", SET/GET of the same chunks (`bench/redis_bench.cc`) | see below |")
    w("")
    if fio_note:
        w(f"Note: {fio_note}.\n")

    # ---- grid ----
    w("## Put and get throughput and latency\n")
    w("Per cell: a fixed byte budget, and at least one chunk per client (on the RAM tier "
      "at least three chunks and 96 MiB per client, on the SSD tier 32 MiB, so that a "
      "64-client cell of small chunks is not decided by its start and its tail), "
      "each client a thread with its own connection (all in kv_bench's one process, its "
      "malloc arenas capped at 2: `ClientOptions::malloc_arena_max`), connected before the cell's clock "
      "starts; before a cell's clock each client puts or gets one chunk of the cell's size, "
      "as the cell will (warm connections, as a long-running worker has; Redis clients "
      "likewise). RAM tier: "
      "`--write-mode=ram-only`, 4 GiB pool, gets cycle "
      "over a 1 GiB hot set. SSD tier: `--write-mode=write-through`, 512 MiB pool, gets "
      "cycle over everything the put cells wrote (far more than the pool), so reads miss "
      "RAM; `ssd reads` counts the replies whose tier field said SSD. Latency is per chunk "
      "(one Put or one Get RPC of one chunk). GB/s = 10^9 bytes/s.\n")
    for op in ("get", "put"):
        w(f"### {op}\n")
        w("| chunk | clients | RAM GB/s | RAM p50/p99 ms | SSD GB/s | SSD p50/p99 ms | ssd reads | "
          "Redis GB/s | Redis p50/p99 ms | RAM/TCP | RAM/Redis | RAM/memcpy | SSD/fio |")
        w("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        fio = fio_r if op == "get" else fio_w
        for c in chunks:
            for n in clients:
                k, s, r = cell("ram", op, c, n), cell("ssd", op, c, n), cell("redis", op, c, n)

                def g(x):
                    return f"{x['gbps']:.3f}" if x else "-"

                def l(x):
                    return f"{x['p50_ms']:.1f} / {x['p99_ms']:.1f}" if x else "-"
                sr = "-"
                if s and op == "get":
                    tot = s.get("from_ssd", 0) + s.get("from_ram", 0)
                    sr = f"{int(s.get('from_ssd', 0))}/{int(tot)}"
                errs = sum(int(x.get("errors", 0)) for x in (k, s, r) if x)
                w(f"| {c} MiB | {n} | {g(k)} | {l(k)} | {g(s)} | {l(s)} | {sr} | {g(r)} | {l(r)} | "
                  f"{ratio(k and k['gbps'], tcp)} | {ratio(k and k['gbps'], r and r['gbps'])} | "
                  f"{ratio(k and k['gbps'], memcpy)} | {ratio(s and s['gbps'], fio)} |" +
                  (f" {errs} errors" if errs else ""))
        w("")
    w("### Scaling: throughput at 64 clients / peak over 1-64 clients (target >= 0.9)\n")
    w("| tier | op | " + " | ".join(f"{c} MiB" for c in chunks) + " |")
    w("|---|---|" + "---|" * len(chunks))
    for tier in ("ram", "ssd", "redis"):
        for op in ("get", "put"):
            vals = []
            for c in chunks:
                p, k = peak(tier, op, c), cell(tier, op, c, 64)
                vals.append(f"{k['gbps'] / p['gbps']:.2f} (peak at {int(p['clients'])})" if p and k else "-")
            w(f"| {tier} | {op} | " + " | ".join(vals) + " |")
    w("")
    rounds = max((len(r.get("gbps_rounds", [])) for r in cells), default=0)
    if rounds > 1:
        w(f"Each kvtier cell is the median of {rounds} rounds, the client counts interleaved "
          "(`kv_bench --rounds`); Redis cells are one run.\n")
    # Who pays for more clients: the daemon's CPU per GB against the clients' (kv_bench's
    # one process, all its client threads).
    w("What a GB costs at the peak and at 64 clients, in CPU seconds (user + system over the "
      "cell), daemon / clients (kv_bench's one process, a thread per client):\n")
    w("| tier | op | chunk | at the peak | at 64 clients |")
    w("|---|---|---|---|---|")

    def cpu(x):
        gb = x["bytes"] / 1e9 if x and x.get("bytes") else 0
        if not gb or "daemon_cpu_s" not in x:
            return "-"
        return f"{x['daemon_cpu_s'] / gb:.2f} / {x['client_cpu_s'] / gb:.2f}"
    for tier in ("ram", "ssd"):
        for op in ("get", "put"):
            for c in chunks:
                p, k = peak(tier, op, c), cell(tier, op, c, 64)
                if p and k:
                    w(f"| {tier} | {op} | {c} MiB | {cpu(p)} ({int(p['clients'])} clients) | {cpu(k)} |")
    w("")
    w("![throughput](plots/throughput.png)\n")
    w("![latency](plots/latency.png)\n")

    # ---- lookup ----
    w("## Lookup of 256 keys\n")
    w("| clients | samples | p50 ms | p99 ms | p99.9 ms | lookups/s |")
    w("|---|---|---|---|---|---|")
    for r in one("lookup"):
        w(f"| {int(r['clients'])} | {int(r['samples'])} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | "
          f"{r['p999_ms']:.3f} | {r['per_sec']:.0f} |")
    w("")

    # ---- trace ----
    for t in one("trace"):
        w("## Mooncake trace replay\n")
        w(f"`{os.path.basename(t['trace'])}`: {int(t['requests'])} requests, {int(t['chunk_refs'])} chunk "
          f"references, {int(t['unique_chunks'])} distinct hash ids. Each hash id is one "
          f"{t['chunk_kib']:.0f} KiB chunk (so the whole trace fits the time budget; "
          f"{int(t['unique_chunks']) * t['chunk_kib'] / 1048576:.1f} GiB distinct) against a "
          f"{t['ram_mib']:.0f} MiB RAM pool in write-back mode, so eviction, demotion and SSD "
          f"hits are real. Per request: Lookup all its keys, Get the hits in one stream, Put the "
          f"misses in one stream. Arrival times compressed {t['compress']:.0f}x "
          f"({t['span_s']:.0f} s of trace), dispatched to {int(t['workers'])} client threads.\n")
        w("| hit ratio | ideal (every re-reference hits) | prefix hit ratio | RAM hits | SSD hits | "
          "lost between Lookup and Get | GB/s (get+put) | got GB | put GB | requests/s | "
          "request p50 ms | p99 ms | wall s | errors | evictions | demotions |")
        w("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        w(f"| {t['hit_ratio']:.3f} | {t['ideal_hit_ratio']:.3f} | {t['prefix_hit_ratio']:.3f} | "
          f"{int(t['ram_hits'])} | {int(t['ssd_hits'])} | {int(t['lost'])} | {t['gbps']:.3f} | "
          f"{t['got_gb']:.2f} | {t['put_gb']:.2f} | {t['req_per_s']:.1f} | {t['p50_ms']:.1f} | "
          f"{t['p99_ms']:.1f} | {t['secs']:.1f} | {int(t['errors'])} | {int(t['evictions'])} | "
          f"{int(t['demotions'])} |")
        w("")
        tput = t["gbps"]
        w(f"Against the baselines: {ratio(tput, tcp)} of loopback TCP, {ratio(tput, fio_r)} of fio "
          f"sequential read.\n")

    # ---- rss ----
    w("## Resident memory (this run)\n")
    w("Command: `" + "build/bench/rss_bench --mode=write-back" + "`\n")
    w(rss_log.strip() + "\n")
    grid_rss = [r for r in one("rss") if "bound_mib" in r]
    if grid_rss:
        w("The grid daemons (kv_bench, all cells of each tier) against issue 10's form of the "
          "target: peak RSS at most the pool x 1.15 plus a fixed allowance that grows with "
          "neither chunk size nor client count. The allowance is measured at the daemon's "
          "start: its idle process beside the pool (RSS once the pool is faulted in, less the "
          "pool: code, libraries, RocksDB open), and the buffers its options bound beside the "
          "pool, as the daemon exports them (`kvtier_memory_bound_bytes`, "
          "`DaemonConfig::MemoryBesidePool`). Not in it, and so inside the 15%: gRPC's "
          "per-connection state and RocksDB's block cache.\n")
        w("| tier | pool MiB | idle process MiB | bounded buffers MiB (MiB each) | bound MiB | peak RSS MiB | peak / bound | peak / pool |")
        w("|---|---|---|---|---|---|---|---|")
        for r in grid_rss:
            w(f"| {r['tier']} | {r['pool_mib']:.0f} | {r['process_mib']:.0f} | {r['buffers_mib']:.0f} "
              f"({r['buffers']}) | {r['bound_mib']:.0f} | {r['peak_rss_mib']:.0f} | "
              f"{r['peak_rss_mib'] / r['bound_mib']:.3f} | {r['ratio']:.3f} |")
        w("")

    cake = rd(os.path.join(res, "cake.log")).strip()
    if cake:
        w("## Cake planner\n")
        cmd = [l.split("\t", 1)[1] for l in rd(os.path.join(res, "commands.txt")).splitlines()
               if l.startswith("cake\t")]
        if cmd:
            w(f"Command: `{cmd[0]}`\n")
        w(cake + "\n")

    prof = rd(os.path.join(os.path.dirname(header), "profile.md")).strip()
    if prof:
        w(prof + "\n")

    # Benchmarks run on their own (not by bench/run.sh, which leaves their folders alone):
    # the Python client against the C++ client, and the reference worker.
    py = rd(os.path.join(res, "python", "py_client.md")).strip()
    if py:
        w("## Python client vs C++ client (target: Python >= 0.8 x C++)\n")
        w("Command: `PYTHONPATH=build/python /usr/bin/python3 bench/py_client_bench.py "
          "--out bench/results/python` (one kvtierd, RAM tier; the three clients "
          "interleaved per repetition; medians of 5; GB/s). Raw: "
          "`bench/results/python/py_client.jsonl`.\n")
        w(py + "\n")
        notes = rd(os.path.join(res, "python", "notes.md")).strip()
        if notes:
            w(notes + "\n")
    samehost(res, w, ratio, met)
    cache(res, w)
    ssd_fio(res, w)
    churn(res, w)
    security(res, w)
    manycore(res, w)
    overload(res, w)
    remote(res, w)
    gpu(res, w)
    worker = rd(os.path.join(res, "worker", "summary.md")).strip()
    if worker:
        w("## Reference worker: layer-wise overlap, Cake with real compute, context overflow\n")
        w("Commands: `PYTHONPATH=build/python:worker /usr/bin/python3 bench/worker_bench.py` "
          "then `/usr/bin/python3 bench/plot_worker.py` (needs python3-matplotlib). Raw: "
          "`bench/results/worker/worker_bench.json`; every kvtierd command line in "
          "`bench/results/worker/commands.txt`.\n")
        w(worker.split("\n", 1)[-1].strip().replace("\n## ", "\n### ") + "\n")
        for png, what in (("worker_overlap.png", "Layer-wise overlap"),
                          ("worker_cake.png", "Cake with real compute"),
                          ("worker_cake_fit.png", "Per-chunk compute: measured vs the planner's fit"),
                          ("worker_overflow.png", "Context overflow")):
            if os.path.exists(os.path.join(res, "worker", png)):
                w(f"![{what}](results/worker/{png})\n")

    w(rd(header).split("-->", 1)[-1].strip() + "\n")

    w("## Exact commands (this run, from the repository root)\n")
    w("```")
    w("bash bench/run.sh")
    for l in rd(os.path.join(res, "commands.txt")).splitlines():
        w(l.split("\t", 1)[1])
    red = rd(os.path.join(res, "redis_cmd.txt")).strip()
    if red:
        w(red.split("  (")[0] + "   # started before the redis step")
    w("iperf3 -s -1 -p PORT   # started before the iperf3 step")
    w("```")
    with open(out, "w") as f:
        f.write("\n".join(L) + "\n")


if __name__ == "__main__":
    main()
