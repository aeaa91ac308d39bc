#!/usr/bin/env python3
"""Turns a results directory of benches/e2e/run.sh (meta.json + runs.jsonl) into docs/benchmarks.md and, when
matplotlib is importable, docs/benchmarks.png next to it.

Usage: python3 benches/e2e/report.py RESULTS_DIR [OUTPUT.md]   (stdout without OUTPUT.md; no plot then)
Each scenario's section is rendered by section_<scenario>.py (contract in report_common.py).
"""

import importlib
import json
import os
import statistics
import sys

from report_common import markdown_table

SCENARIO_ORDER = ["closed", "capacity", "open", "single", "h2", "idle", "jvm"]


def load(results_dir):
    with open(os.path.join(results_dir, "meta.json")) as f:
        meta = json.load(f)
    runs = []
    with open(os.path.join(results_dir, "runs.jsonl")) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    return meta, runs


def sections(runs):
    present = {r["scenario"] for r in runs}
    names = [s for s in SCENARIO_ORDER if s in present] + sorted(present - set(SCENARIO_ORDER))
    return [(n, importlib.import_module(f"section_{n}"), [r for r in runs if r["scenario"] == n]) for n in names]


def load_range(runs):
    loads = [r["loadavg_1m"] for r in runs if "loadavg_1m" in r]
    if not loads:
        return "not recorded"
    return f"{min(loads):.2f}-{max(loads):.2f} (median {statistics.median(loads):.2f})"


def invariant(runs):
    """The one target every run speaks to: the upstream's own counts never above the cap in force."""
    proxied = [r for r in runs if r["subject"] != "direct"]
    rows = {}
    for r in proxied:
        peak = max(r["upstream"]["peak_conns"], r["upstream_warmup"]["peak_conns"],
                   r["upstream"]["peak_inflight"], r["upstream_warmup"]["peak_inflight"])
        family = r["subject"].split("-")[0]
        over = peak - r["cap"]
        worst = rows.get(family, (0, 0, None))
        rows[family] = (worst[0] + 1, worst[1] + (over > 0), max(over, worst[2]) if worst[2] is not None else over)
    out = []
    for family in ("floodgate", "haproxy", "nginx"):
        if family in rows:
            n, bad, worst = rows[family]
            out.append(f"{family}: above the cap in {bad} of {n} runs (worst: cap {'+' if worst >= 0 else ''}{worst})")
    fg = rows.get("floodgate")
    return {
        "target": "Invariant: the upstream's own peak connections and requests in flight <= N in every run",
        "floodgate": out[0] if out and out[0].startswith("floodgate") else "-",
        "peer": "; ".join(o for o in out if not o.startswith("floodgate")) or "-",
        "verdict": "n/a" if fg is None else ("met" if fg[1] == 0 else "gap"),
        "note": "",
    }


# What limits floodgate where it misses a target, keyed by the start of the target's text: what profiling and
# measurement showed (docs/benchmarks.md prints it under the targets table, only for targets this run missed).
LIMITS = {
    "Cost": "Per response floodgate spends more CPU than HAProxy. It makes four socket calls per request "
    "(strace: 2.0 `writev`, 2.0 `recvfrom`, 0.19 `epoll_wait` at 0 ms) and the loopback carries as many segments "
    "for it as for HAProxy (nstat: 5.7-6.2 vs 5.5-6.7 per request), but its user time is 1.6-2.2 "
    "times HAProxy's (`/proc` user/system ticks over a 4 s wrk run at 200 clients, 0 ms, side by side, 3 pairs). A request crosses hyper's HTTP/1 codec "
    "twice (server and client side) and two tasks (the client connection's and the upstream connection's, joined "
    "by hyper's dispatch channel and a oneshot), where HAProxy moves buffers within one event loop; at a fixed, "
    "low rate every request also pays its own wake-ups. The single-thread runtime (`--threads 1` runs tokio's "
    "current-thread scheduler) took 12-31 % off the user time (3 interleaved pairs); going further means fewer task hops per "
    "request (driving the upstream connection inside the client's task) or a leaner codec than hyper's.",
    "Capacity": "The proxy-bound case is the CPU cost (the Cost target) at saturation: with every process on 2 shared cores, "
    "more CPU per response is fewer responses per second.",
    "Hand-off gap": "Between a response leaving the upstream and the next request reaching it, floodgate passes the "
    "connection from the finished exchange to the next queued request's task, which then writes through hyper's "
    "client codec: the same task hops that make up the CPU cost (the Cost target), here seen as time.",
    "HTTP/2": "HTTP/2 clients go through hyper's HTTP/2 server (the h2 crate), which spends more CPU per stream than "
    "HAProxy's multiplexer; proxy-bound (0 ms) that is fewer responses per second, at 2 ms it does not show.",
    "Idle clients": "Most likely hyper's per-connection buffers: its HTTP/1 code (1.12, `proto/h1/io.rs`) gives "
    "each connection an 8 KiB read buffer and an 8 KiB header write buffer, keeps them while the connection idles, "
    "and refuses a `max_buf_size` below 8 KiB; the connection's task comes on top. HAProxy and nginx take buffers "
    "from a pool only while bytes move. That reading of hyper's source is not yet confirmed by a heap profile. "
    "Closing the gap needs a codec that gives buffers back between requests, which hyper 1.x does not offer.",
}


def render(meta, runs, plot_name):
    s = meta["settings"]
    v = meta["versions"]
    secs = sections(runs)
    short = int(s.get("duration", "4")) < 4 or int(s.get("reps", "3")) < 3
    lines = ["# End-to-end benchmarks", ""]
    lines += [
        "Generated by `benches/e2e/report.py` from the results of `benches/e2e/run.sh` (`-h` for its options); "
        "do not edit by hand, run the command again.",
        "",
    ]
    if short:
        lines += [
            f"**A short run** ({s.get('duration')} s per run, {s.get('reps')} repetition(s)): the harness works end to "
            "end; the numbers are less settled than the script's default (4 s after a 1 s warm-up, 3 repetitions).",
            "",
        ]
    lines += [
        "**Noise.** Everything runs on loopback on one machine: load generator, proxy and upstream share its "
        f"{meta['nproc']} CPUs (in the *pinned* layout the load generator has its own half of them), and on this "
        "machine with other work too. Differences below 15 % in throughput or 20 % in p99 are reported as ties.",
        "",
        "## Setting",
        "",
        f"- Command: `{meta['command']}`",
        f"- Date: {meta['date']}; floodgate at `{meta['git']}`",
        f"- Machine: {meta['nproc']} CPUs ({meta['cpu']}), {meta['mem']} RAM, kernel {meta['kernel']}, {meta['os']}",
        f"- Other work on the machine: 1-minute load average before each run {load_range(runs)} "
        f"(the benchmark itself accounts for up to about {meta['nproc']} of it)",
        "- Versions: " + "; ".join(f"{k}: {v[k]}" for k in sorted(v)),
        "- Settings: " + ", ".join(f"{k} = {s[k]}" for k in sorted(s)),
        "- Subjects: `direct` (the load generator straight at the upstream); `floodgate-T` (`--threads T "
        "--max-connections N`); `haproxy-T` (`nbthread T`, `server … maxconn N`, `http-reuse always`, "
        "`option abortonclose`, 503 when the backend queue holds the bound, `timeout queue`); `nginx-W` "
        "(`worker_processes W`, `max_conns=N`, `keepalive N`, `zone`; nginx OSS cannot queue and answers 502 when all "
        "N are busy). Every run starts a fresh upstream and a fresh proxy; the configurations are written by "
        "`benches/e2e/lib.sh`.",
        "- Layouts: *shared* (no pinning) and *pinned* (load generator on the upper half of the CPUs, proxy and "
        "upstream on the lower half: on 2 CPUs they share one).",
        "- Columns: **2xx/s** median over repetitions [min-max]; latencies are the load generator's, medians over "
        "repetitions; **upstream peak conns / in flight** are the upstream's own exact counts (*life* includes the "
        "warm-up); **proxy RSS** is VmHWM summed over the proxy's processes; **CPU-µs / response** is the proxy's "
        "user + system time in the measured window (clock ticks) over the responses the load generator got.",
        "",
        "## Targets",
        "",
        "Each target of the benchmark issue, floodgate's best variant against the peer's best variant, from this run "
        "(*tie*: inside the noise band; *gap*: outside it, with what limits it in the notes below the table).",
        "",
    ]
    rows = [invariant(runs)]
    for _, mod, rs in secs:
        if hasattr(mod, "targets"):
            rows += mod.targets(rs, meta)
    lines += markdown_table(["target", "floodgate", "best peer", "verdict", "note"],
                            [[t["target"], t["floodgate"], t["peer"], t["verdict"], t["note"]] for t in rows])
    missed = [t for t in rows if t["verdict"] == "gap"]
    if missed:
        lines += ["", "Where floodgate misses a target, what limits it:", ""]
        seen = set()
        for t in missed:
            key = next((k for k in LIMITS if t["target"].startswith(k)), None)
            if key in seen:
                continue
            seen.add(key)
            lines.append(f"- **{t['target']}**: " + (LIMITS[key] if key else "not analysed yet."))
    if plot_name:
        lines += ["", f"![benchmark plot]({plot_name})"]
    for name, mod, rs in secs:
        lines += ["", f"## {mod.TITLE}", ""]
        lines += mod.render(rs, meta)
    lines += [
        "",
        "Raw data: one JSON line per run (`runs.jsonl`) and per-run files (load generator output, proxy "
        "configurations, logs, floodgate's `/status`) in the results directory the script names; it is under "
        "`target/` and not kept.",
        "",
    ]
    return "\n".join(lines)


def write_plot(meta, runs, path):
    """One panel per scenario that can draw itself; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    drawable = [(n, m, rs) for n, m, rs in sections(runs) if hasattr(m, "plot")]
    if not drawable:
        return False
    fig, axes = plt.subplots(len(drawable), 1, figsize=(11, 4.2 * len(drawable)), squeeze=False)
    for ax, (_, mod, rs) in zip(axes[:, 0], drawable):
        mod.plot(rs, meta, ax)
    fig.suptitle(f"floodgate e2e benchmark, {meta['date']}, {meta['git']}, {meta['nproc']} CPUs", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def main():
    if len(sys.argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    meta, runs = load(sys.argv[1])
    if len(sys.argv) == 2:
        sys.stdout.write(render(meta, runs, None))
        return
    out = os.path.abspath(sys.argv[2])
    os.makedirs(os.path.dirname(out), exist_ok=True)
    png = os.path.splitext(out)[0] + ".png"
    plot_name = os.path.basename(png) if write_plot(meta, runs, png) else None
    with open(out, "w") as f:
        f.write(render(meta, runs, plot_name))


if __name__ == "__main__":
    main()
