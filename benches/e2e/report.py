#!/usr/bin/env python3
"""Turns a results directory of benches/e2e/run.sh (meta.json + runs.jsonl) into docs/benchmarks.md and, when
matplotlib is importable, docs/benchmarks.png next to it; with --kind overload, into docs/overload.md from the
overload-control scenarios' runs instead.

Usage: python3 benches/e2e/report.py [--kind benchmarks|overload] [--also RESULTS_DIR ...] RESULTS_DIR [OUTPUT.md]
  (stdout without OUTPUT.md; no plot then)
--also (repeatable) adds the runs of another results directory, scenario by scenario: a
scenario's runs all come from the first directory that has it (RESULTS_DIR first, then the --also ones in order),
so every comparison stays within one invocation; the report names each invocation's command and what it ran.
Each scenario's section is rendered by section_<scenario>.py ("-" in a scenario's name is "_" in its module's;
contract in report_common.py). A section module's DOC ("benchmarks" when it has none) says which report it is in.
"""

import importlib
import json
import os
import statistics
import sys

from report_common import markdown_table

SCENARIO_ORDER = ["closed", "capacity", "open", "single", "h2", "idle", "jvm", "storm", "cores",
                  "overload", "fairness", "adaptive", "slow-readers", "retry-after", "endpoints"]
KINDS = ("benchmarks", "overload")


def load(results_dir):
    with open(os.path.join(results_dir, "meta.json")) as f:
        meta = json.load(f)
    runs = []
    with open(os.path.join(results_dir, "runs.jsonl")) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    return meta, runs


def load_many(dirs):
    """meta and runs of several results directories (the first's meta, with "sources": one entry per directory
    that gave runs). A scenario's runs come from the first directory that has it."""
    meta, runs, taken, sources = None, [], set(), []
    for d in dirs:
        m, rs = load(d)
        if meta is None:
            meta = dict(m)
            meta["settings"] = dict(m["settings"])
        names = sorted({r["scenario"] for r in rs} - taken)
        if not names:
            continue
        taken |= set(names)
        runs += [r for r in rs if r["scenario"] in names]
        sources.append({"dir": d, "meta": m, "scenarios": names})
        for k, v in m["settings"].items():
            meta["settings"].setdefault(k, v)
    meta["sources"] = sources
    return meta, runs


def sections(runs, kind="benchmarks"):
    """[(scenario, its section module, its runs)] of the scenarios present whose module's DOC is kind."""
    present = {r["scenario"] for r in runs}
    names = [s for s in SCENARIO_ORDER if s in present] + sorted(present - set(SCENARIO_ORDER))
    out = []
    for n in names:
        mod = importlib.import_module("section_" + n.replace("-", "_"))
        if getattr(mod, "DOC", "benchmarks") == kind:
            out.append((n, mod, [r for r in runs if r["scenario"] == n]))
    return out


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
    "Cost": "Per response floodgate spends more CPU than HAProxy, most of it in its own code: it makes fewer socket "
    "calls (`benches/syscalls.sh`, perf on the proxy's PID: 2 `recvfrom`, 2 `sendto`, 1.8 `epoll_wait` per response "
    "at 1,000 req/s, as HAProxy, and none of HAProxy's other calls), but counts about 33,000 instructions per "
    "response (32,777-33,431 in the day's runs) in user space as shipped (the dist profile) against HAProxy's 28,000 by the same count (cachegrind, "
    "one thread each, 2026-12-07); it also sets `X-Forwarded-*` and a request ID on every request, which this "
    "HAProxy does not (doing the same costs HAProxy 10,300 more, `benches/haproxy_headers.cfg`). By callgrind the rest goes to building, editing and "
    "writing the `http` crate's header maps, the request's futures and the values moved between them, and tokio's "
    "readiness and wakers; saturated, its kernel time per response is also higher than HAProxy's (docs/data-path.md, "
    "*Status* and *What the head kept as its bytes would take*). Running the exchange on the client's task instead "
    "was measured and lost capacity (docs/data-path.md).",
    "Capacity": "The proxy-bound case is the CPU cost (the Cost target) at saturation: with every process on 2 shared cores, "
    "more CPU per response is fewer responses per second.",
    "Hand-off gap": "Between a response leaving the upstream and the next request reaching it, the exchange in the "
    "upstream lane reads the answer, ends its lease, and the next queued request (in the lane too) writes its own: "
    "the lane's polls among the client connections' tasks are the time left.",
    "HTTP/2": "HTTP/2 clients go through hyper's HTTP/2 server (the h2 crate), which spends more CPU per stream than "
    "HAProxy's multiplexer; proxy-bound (0 ms) that is fewer responses per second, at 2 ms it does not show.",
    "Idle clients": "An idle HTTP/1 client holds no buffer on floodgate's own server: its task (a future of under 500 bytes), "
    "tokio's registration of its socket and its `ClientInfo` (docs/data-path.md). HTTP/2 clients stay on "
    "hyper's server, which keeps 16 KiB of buffers per connection while it idles.",
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
    ]
    lines += invocations(meta, [n for n, _, _ in secs], "")
    lines += [
        f"- Machine: {meta['nproc']} CPUs ({meta['cpu']}), {meta['mem']} RAM, kernel {meta['kernel']}, {meta['os']}",
        f"- Other work on the machine: 1-minute load average before each run {load_range(runs)} "
        f"(the benchmark itself accounts for up to about {meta['nproc']} of it)",
        "- Versions: " + "; ".join(f"{k}: {v[k]}" for k in sorted(v)),
        "- Settings: " + ", ".join(f"{k} = {s[k]}" for k in sorted(s)),
        "- Subjects: `direct` (the load generator straight at the upstream); `floodgate-T` (`--threads T "
        "--max-connections N`, the build of `floodgate_profile`: dist is what packages ship); `haproxy-T` (`nbthread T`, `server … maxconn N`, `http-reuse always`, "
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


# Settings every report shows; the rest are a scenario's own (named after it) and shown with its report only.
COMMON_SETTINGS = ("duration", "warmup", "reps", "upstream_threads", "scenarios")


def invocations(meta, names, kind_flag):
    """The Setting lines naming the run.sh invocation(s) the report's scenarios (names) came from."""
    sources = [src for src in meta.get("sources", []) if set(src["scenarios"]) & set(names)]
    if len(sources) < 2:
        return [
            f"- Command: `{meta['command']}`",
            f"- Date: {meta['date']}; floodgate at `{meta['git']}`",
        ]
    doc = "docs/overload.md" if kind_flag else "docs/benchmarks.md"
    lines = [
        f"- Invocations: {len(sources)}, each scenario's runs from one of them (so every comparison below is "
        "between configurations interleaved in one invocation; numbers from different invocations are not "
        f"compared), merged by `benches/e2e/report.py {kind_flag}"
        + " ".join(f"--also {src['dir']}" for src in sources[1:]) + f" {sources[0]['dir']} {doc}`:",
    ]
    for src in sources:
        m = src["meta"]
        ms = m["settings"]
        lines.append(
            f"  - {', '.join(src['scenarios'])}: `{m['command']}`, {m['date']}, floodgate at `{m['git']}`; "
            + ", ".join(f"{k} = {ms[k]}" for k in COMMON_SETTINGS if k in ms))
    return lines


def render_overload(meta, runs):
    """docs/overload.md: floodgate's overload control measured against itself (and HAProxy where it has a peer)."""
    s = meta["settings"]
    v = meta["versions"]
    secs = sections(runs, "overload")
    names = [n for n, _, _ in secs]
    prefixes = tuple(n.replace("-", "_") + "_" for n in names)
    sources = [src for src in meta.get("sources", []) if set(src["scenarios"]) & set(names)]
    if len(sources) < 2:
        sources = []
    shown = {k: s[k] for k in s if (k in COMMON_SETTINGS and not sources) or k.startswith(prefixes)}
    metas = [src["meta"] for src in sources] or [meta]
    shorts = [x["settings"] for x in metas
              if int(x["settings"].get("duration", "4")) < 4 or int(x["settings"].get("reps", "3")) < 3]
    short = bool(shorts)
    lines = ["# Overload control: benchmarks", ""]
    lines += [
        "Generated by `benches/e2e/report.py --kind overload` from the results of `benches/e2e/run.sh -x \"overload "
        "fairness adaptive slow-readers retry-after endpoints\"` (`-h` for its options; the invocations this one came from are under "
        "*Setting*); do not edit by hand, run the command again. The proxy-against-proxy "
        "comparison is [benchmarks.md](benchmarks.md); what each setting does is in [concepts.md](concepts.md) "
        "(*Overload control*) and `config/floodgate.toml`.",
        "",
    ]
    if short:
        lines += [
            f"**A short run** ({shorts[0].get('duration')} s per run, {shorts[0].get('reps')} repetition(s)): the "
            "numbers are less settled than the script's default (4 s after a 1 s warm-up, 3 repetitions).",
            "",
        ]
    heads = [h for _, mod, rs in secs if hasattr(mod, "headline") for h in mod.headline(rs, meta)]
    if heads:
        lines += ["## Headline", ""]
        lines += [f"- {h}" for h in heads]
        lines += [""]
    inv = invariant(runs)
    lines += [
        "**Noise.** Load generators, proxy and upstream share the machine's "
        f"{meta['nproc']} CPUs on loopback, with other work on the machine too. Every comparison below is between "
        "configurations run interleaved in the same invocation (each repetition runs every configuration once, in "
        "turn), and is given as a ratio of medians over the repetitions; differences below 15 % in throughput or "
        "20 % in latency are inside the stand's noise.",
        "",
        "## Setting",
        "",
    ]
    lines += invocations(meta, names, "--kind overload ")
    lines += [
        f"- Machine: {meta['nproc']} CPUs ({meta['cpu']}), {meta['mem']} RAM, kernel {meta['kernel']}, {meta['os']}",
        f"- Other work on the machine: 1-minute load average before each run {load_range(runs)} "
        f"(the benchmark itself accounts for up to about {meta['nproc']} of it)",
        "- Versions: " + "; ".join(f"{k}: {v[k]}" for k in sorted(v) if k in ("floodgate", "rustc", "oha", "wrk", "haproxy")),
        "- Settings: " + ", ".join(f"{k} = {shown[k]}" for k in sorted(shown)),
        f"- The cap: {inv['floodgate']}" + (f"; {inv['peer']}" if inv["peer"] != "-" else "")
        + " (the upstream's own count of connections and requests in flight, warm-up included).",
        "- Every run starts a fresh upstream (`examples/bench_upstream.rs`, a fixed service time kept by a timer "
        "thread of its own) and a fresh proxy, warms up for the warm-up seconds, then measures. floodgate's "
        "settings without a flag go in through its environment (`FLOODGATE__UPSTREAMS__DEFAULT__QUEUE_DISCIPLINE` "
        "and so on; `benches/e2e/lib.sh`, `floodgate_env`); its shed counts by reason are "
        "`floodgate_requests_total` by `outcome` from `/metrics`, read before and after the measured load.",
    ]
    for name, mod, rs in secs:
        lines += ["", f"## {mod.TITLE}", ""]
        lines += mod.render(rs, meta)
    pending = [n for n in ("adaptive", "slow-readers") if n not in names]
    if pending:
        lines += [
            "",
            "## Not measured yet",
            "",
            "Issue 6 also asks for " + " and ".join({
                "adaptive": "the adaptive limit settling near the upstream's knee",
                "slow-readers": "slow readers with and without response buffering",
            }[n] for n in pending) + ", which these results do not hold: run `benches/e2e/run.sh -x \""
            + " ".join(pending) + "\"` and merge its results in (`report.py --kind overload --also DIR`).",
        ]
    lines += [
        "",
        "Raw data: one JSON line per run (`runs.jsonl`) and per-run files (oha's JSON and per-response SQLite "
        "record, wrk's output, floodgate's `/status`, logs) in the results directory the script names; it is under "
        "the cargo target directory and not kept.",
        "",
    ]
    return "\n".join(lines)


def main():
    args = sys.argv[1:]
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    kind = "benchmarks"
    also = []
    while len(args) >= 2 and args[0] in ("--kind", "--also"):
        if args[0] == "--kind":
            kind = args[1]
        else:
            also.append(args[1])
        args = args[2:]
    if kind not in KINDS or len(args) not in (1, 2):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    meta, runs = load_many([args[0]] + also) if also else load(args[0])
    # A results directory may hold both kinds (one invocation running every scenario): each report its own runs.
    names = {n for n, _, _ in sections(runs, kind)}
    runs = [r for r in runs if r["scenario"] in names]
    if not runs:
        print(f"report.py: no {kind} scenarios in {args[0]}; nothing written", file=sys.stderr)
        return
    if len(args) == 1:
        sys.stdout.write(render_overload(meta, runs) if kind == "overload" else render(meta, runs, None))
        return
    out = os.path.abspath(args[1])
    os.makedirs(os.path.dirname(out), exist_ok=True)
    if kind == "overload":
        text = render_overload(meta, runs)
    else:
        png = os.path.splitext(out)[0] + ".png"
        text = render(meta, runs, os.path.basename(png) if write_plot(meta, runs, png) else None)
    # Sections measured by scripts of their own (benches/grpc.sh) are kept from the file being replaced.
    text += kept_sections(out)
    with open(out, "w") as f:
        f.write(text)


# The headings of sections no run of run.sh makes: written by hand from their own scripts, kept across reports.
KEPT_HEADINGS = (
    "## gRPC upstream (HTTP/2 to the upstream)",
    "## Admission that reads the upstream (benches/upstream_aware.py)",
    "## Idle HTTP/2 clients (benches/h2_idle.sh clients)",
)


def kept_sections(path):
    """The kept sections of the file at `path` (from the first kept heading on), or nothing."""
    try:
        with open(path) as f:
            old = f.read()
    except OSError:
        return ""
    starts = [old.find("\n" + heading + "\n") for heading in KEPT_HEADINGS]
    starts = [at for at in starts if at >= 0]
    return "\n" + old[min(starts) + 1:] if starts else ""


if __name__ == "__main__":
    main()
