#!/usr/bin/env python3
"""Turns a results directory of benches/e2e/run.sh (meta.json + runs.jsonl) into docs/benchmarks.md.

Usage: python3 benches/e2e/report.py RESULTS_DIR [OUTPUT.md]   (stdout without OUTPUT.md)
Standard library only.
"""

import json
import os
import statistics
import sys

SUBJECT_ORDER = ["direct", "floodgate-1", "floodgate-2", "haproxy-1", "haproxy-2", "nginx-1", "nginx-2"]

MISSING = [
    "the thread-per-connection JVM upstream with a fixed heap (its peak threads and RSS are the point of the "
    "project); the upstream here is the project's own counting Rust upstream (`examples/bench_upstream.rs`, "
    "1 runtime thread), so its thread and RSS columns barely move",
    "open-loop load below and at 2x capacity (needs an open-loop generator: oha or wrk2)",
    "HTTP/2 clients (h2load)",
    "one client alone, for the latency a proxy adds",
    "a CPU pinning layout (load generator, proxy and upstream on separate cores); here all share the cores",
    "a plot (PNG): left out of this slice (no plotting library is installed; the tables carry every number)",
    "the kernel's own count of upstream sockets as a cross-check of the upstream's count",
]


def load(results_dir):
    with open(os.path.join(results_dir, "meta.json")) as f:
        meta = json.load(f)
    runs = []
    with open(os.path.join(results_dir, "runs.jsonl")) as f:
        for line in f:
            line = line.strip()
            if line:
                runs.append(json.loads(line))
    return meta, runs


def derive(run):
    """Per-run numbers, as the tables show them."""
    w, up = run["wrk"], run["upstream"]
    secs = w["duration_us"] / 1e6
    codes = {int(k): v for k, v in w["codes"].items()}
    ok = sum(v for k, v in codes.items() if 200 <= k < 300)
    other = {k: v for k, v in codes.items() if not 200 <= k < 300}
    responses = w["requests"]
    d = {
        "ok_rate": ok / secs,
        "rate": responses / secs,
        "p50": w["p50_us"] / 1000,
        "p99": w["p99_us"] / 1000,
        "p999": w["p999_us"] / 1000,
        "other": other,
        "responses": responses,
        "sock_err": w["err_connect"] + w["err_read"] + w["err_write"] + w["err_timeout"],
        "timeouts": w["err_timeout"],
        "peak_conns": up["peak_conns"],
        "peak_conns_life": max(up["peak_conns"], run["upstream_warmup"]["peak_conns"]),
        "peak_inflight": up["peak_inflight"],
        "accepted": up["accepted"],
        "up_hwm_mb": run["upstream_hwm_kb"] / 1024,
        "up_threads": run["upstream_threads"],
        "up_cpu_us": run["upstream_cpu_ticks"] * 1e6 / run["clk_tck"] / max(responses, 1),
        "proxy_hwm_mb": run["proxy_hwm_kb"] / 1024 if run["proxy_cpu_ticks"] is not None else None,
        "proxy_cpu_us": (
            run["proxy_cpu_ticks"] * 1e6 / run["clk_tck"] / max(responses, 1)
            if run["proxy_cpu_ticks"] is not None
            else None
        ),
    }
    return d


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(v, digits=0):
    if v is None:
        return "-"
    if digits == 0:
        return f"{v:,.0f}"
    return f"{v:,.{digits}f}"


def spread(values, digits=0):
    """median, and [min-max] when there is more than one value."""
    m = med(values)
    if len(values) < 2:
        return fmt(m, digits)
    return f"{fmt(m, digits)} [{fmt(min(values), digits)}-{fmt(max(values), digits)}]"


def other_codes(rows):
    """Non-2xx responses by code: median share of all responses over the repetitions."""
    codes = sorted({c for r in rows for c in r["other"]})
    if not codes:
        return "0"
    parts = []
    for c in codes:
        share = med([100 * r["other"].get(c, 0) / max(r["responses"], 1) for r in rows])
        parts.append(f"{c}: {share:.1f} %")
    return ", ".join(parts)


def table(rows_by_subject, cap):
    head = [
        "subject",
        "runs",
        "2xx/s med [min-max]",
        "responses/s",
        "p50 ms",
        "p99 ms",
        "p99.9 ms",
        "non-2xx (share of responses)",
        "socket errors (of which timeouts)",
        f"upstream peak conns (window / life; cap {cap})",
        "upstream peak in flight",
        "upstream conns accepted",
        "upstream RSS MB / threads",
        "proxy RSS MB",
        "proxy CPU-µs / response",
        "upstream CPU-µs / response",
    ]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for subject, rows in rows_by_subject:
        cells = [
            subject,
            str(len(rows)),
            spread([r["ok_rate"] for r in rows]),
            fmt(med([r["rate"] for r in rows])),
            fmt(med([r["p50"] for r in rows]), 1),
            fmt(med([r["p99"] for r in rows]), 1),
            fmt(med([r["p999"] for r in rows]), 1),
            other_codes(rows),
            f'{fmt(med([r["sock_err"] for r in rows]))} ({fmt(med([r["timeouts"] for r in rows]))})',
            f'{max(r["peak_conns"] for r in rows)} / {max(r["peak_conns_life"] for r in rows)}',
            str(max(r["peak_inflight"] for r in rows)),
            fmt(med([r["accepted"] for r in rows])),
            f'{fmt(med([r["up_hwm_mb"] for r in rows]), 1)} / {max(r["up_threads"] for r in rows)}',
            fmt(med([r["proxy_hwm_mb"] for r in rows]), 1),
            fmt(med([r["proxy_cpu_us"] for r in rows]), 1),
            fmt(med([r["up_cpu_us"] for r in rows]), 1),
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def load_range(runs):
    loads = [r["loadavg_1m"] for r in runs if "loadavg_1m" in r]
    if not loads:
        return "not recorded"
    return f"{min(loads):.2f}-{max(loads):.2f} (median {statistics.median(loads):.2f})"


def render(meta, runs):
    s = meta["settings"]
    short = s["duration_s"] < 10 or s["reps"] < 3
    v = meta["versions"]
    lines = ["# End-to-end benchmarks", ""]
    lines += [
        "Generated by `benches/e2e/report.py` from the results of `benches/e2e/run.sh` (`-h` for its options); "
        "do not edit by hand, run the command again.",
        "",
    ]
    if short:
        lines += [
            f"**A first, short run** ({s['duration_s']} s per run, {s['reps']} repetition(s)): it shows that the "
            "harness works end to end, not settled numbers. The full setting is the script's default "
            "(10 s after a 2 s warm-up, 3 repetitions, 200 and 1,000 clients).",
            "",
        ]
    lines += [
        "**Noise.** Everything runs on loopback on one machine: load generator, proxy and upstream share its "
        f"{meta['nproc']} CPUs, and on this machine with other work too. Treat differences below about 15 % in "
        "throughput or 20 % in p99 as noise, more so for single runs.",
        "",
        "## What the full benchmark still lacks",
        "",
        "This is the first slice of the end-to-end harness. Not in it yet:",
        "",
    ]
    lines += [f"- {m}" for m in MISSING]
    lines += [
        "",
        "## Setting",
        "",
        f"- Command: `{meta['command']}`",
        f"- Date: {meta['date']}; floodgate at `{meta['git']}`",
        f"- Machine: {meta['nproc']} CPUs ({meta['cpu']}), {meta['mem']} RAM, kernel {meta['kernel']}, {meta['os']}",
        f"- Other work on the machine: 1-minute load average before each run {load_range(runs)} "
        f"(the benchmark itself accounts for up to about {meta['nproc']} of it)",
        f"- Versions: {v['floodgate']} ({v['rustc']}); {v['haproxy']}; {v['nginx']}; {v['wrk']}",
        f"- Cap N = {s['cap']} upstream connections for every proxy; queue bound {s['queue']}, queue timeout "
        f"{s['queue_timeout_s']} s (floodgate, HAProxy; nginx OSS cannot queue and answers 502 when all N are busy)",
        f"- Load: wrk, closed loop, {s['wrk_threads']} threads, clients {s['clients']}, {s['duration_s']} s measured "
        f"after a {s['warmup_s']} s warm-up, {s['reps']} repetition(s), subjects interleaved within a repetition; "
        "every run starts a fresh upstream and a fresh proxy",
        f"- Upstream: `examples/bench_upstream.rs` (hyper, {s['upstream_threads']} runtime thread(s)), a fixed "
        f"service time per scenario ({s['delays_ms']} ms), answer `200 ok`",
        "- Subjects: `direct` (wrk straight at the upstream); `floodgate-T` (`--threads T --max-connections N`); "
        "`haproxy-T` (`nbthread T`, `server … maxconn N`, `http-reuse always`, `option abortonclose`, 503 when the "
        "backend queue holds the bound, `timeout queue`); `nginx-W` (`worker_processes W`, `max_conns=N`, "
        "`keepalive N`, `zone`). The configurations are written by `benches/e2e/run.sh`.",
        "",
        "## How to read the tables",
        "",
        "- **2xx/s**: successful responses per second (median over repetitions, [min-max] when more than one). "
        "**responses/s** counts every response, fast 502/503 included; under closed loop a proxy that sheds fast "
        "looks busy there, so judge by 2xx/s.",
        "- **p50/p99/p99.9**: wrk's latency of every response (errors included), median over repetitions.",
        "- **non-2xx**: by status code, as a share of all responses. **socket errors**: wrk connect, read, write "
        "errors and timeouts (no response within 5 s).",
        "- **upstream peak conns / in flight**: the upstream's own exact counts (a connection from accept until "
        "closed; a request from handler start to its response), maximum over repetitions. *window* is the "
        "measured window; *life* includes the warm-up, so the first ramp-up of the clients. wrk opens one extra "
        "connection of its own before its load starts, so `direct` accepts clients + 1. "
        "**accepted**: connections the upstream accepted in the window (churn; a fixed pool opens none).",
        "- **upstream RSS / threads**: the upstream's VmHWM and its thread count at the end of the run.",
        "- **proxy RSS**: VmHWM summed over the proxy's processes (nginx: master and workers), at the end of the run. "
        "**CPU-µs / response**: user + system CPU time of the process(es) during the measured window (clock "
        "ticks, so ±10 ms over the window) divided by the responses wrk got, shed ones included.",
        "",
        "## Results",
    ]
    derived = [(r, derive(r)) for r in runs]
    scenarios = sorted({(r["delay_ms"], r["clients"]) for r in runs})
    for delay, clients in scenarios:
        rows_by_subject = []
        present = {r["subject"] for r in runs}
        for subject in SUBJECT_ORDER + sorted(present - set(SUBJECT_ORDER)):
            rows = [d for r, d in derived if r["subject"] == subject and (r["delay_ms"], r["clients"]) == (delay, clients)]
            if rows:
                rows_by_subject.append((subject, rows))
        lines += ["", f"### {clients} clients, {delay} ms service time", ""]
        if delay > 0:
            bound = s["cap"] * 1000 / delay
            lines += [f"Upper bound through any proxy at N = {s['cap']}: N / service time = {bound:,.0f} 2xx/s.", ""]
        lines.append(table(rows_by_subject, s["cap"]))
        held, broke = [], []
        for subject, rows in rows_by_subject:
            if subject == "direct":
                continue
            peak = max(r["peak_conns_life"] for r in rows)
            (held if peak <= s["cap"] else broke).append(f"{subject} ({peak})")
        lines += [
            "",
            f"Upstream connections within the cap of {s['cap']} over each run's whole life: "
            f"{', '.join(held) or 'none'}; above it: {', '.join(broke) or 'none'}.",
        ]
    lines += [
        "",
        "Raw data: one JSON line per run (`runs.jsonl`) and per-run files (wrk output, proxy configurations, logs, "
        "floodgate's `/status`) in the results directory the script names; it is under `target/` and not kept.",
        "",
    ]
    return "\n".join(lines)


def main():
    if len(sys.argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    meta, runs = load(sys.argv[1])
    text = render(meta, runs)
    if len(sys.argv) == 3:
        os.makedirs(os.path.dirname(os.path.abspath(sys.argv[2])), exist_ok=True)
        with open(sys.argv[2], "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
