"""Section of docs/benchmarks.md for the "idle" scenario (clients that make one request each and then stay
connected, idle: examples/idle_clients.rs); see report_common for the contract."""

from report_common import by_layout_and_subject, derive, fmt, markdown_table, med, other_codes

TITLE = "Idle clients: proxy memory per connected idle client"

# RSS barely moves between runs of the same proxy; a difference below this is reported as a tie.
NOISE_RSS = 0.05

HEAD = [
    "subject", "layout", "runs", "connected / answered / failed", "closed by the proxy before the sample",
    "proxy RSS before MB", "proxy RSS with idle clients MB", "increment MB", "KiB per idle client",
    "set-up s", "connect + request p50 / p99 ms", "non-2xx (share)", "proxy CPU-µs / client",
]


def numbers(run):
    """The idle-specific figures of one run, from what load_idle wrote into its load.json."""
    w = run["load"]
    closed = w.get("closed_by_peer")
    open_ = w["requests"] - (closed or 0)
    inc_kb = w["rss_idle_kb"] - w["rss_before_kb"]
    return {
        "connected": w["connected"],
        "completed": w["requests"],
        "failed": w["failed"],
        "closed": closed,
        "before_mb": w["rss_before_kb"] / 1024,
        "idle_mb": w["rss_idle_kb"] / 1024,
        "inc_mb": inc_kb / 1024,
        "per_client_kib": inc_kb / open_ if open_ > 0 else None,
        "setup_s": w["duration_us"] / 1e6,
    }



def grouped(runs):
    """Direct runs left out: there is no proxy to measure."""
    return by_layout_and_subject(runs, lambda r: r["subject"] != "direct")


def render(runs, meta):
    s = meta["settings"]
    lines = [
        f"`examples/idle_clients.rs` opens {s.get('idle_clients', '8000')} connections through the proxy, "
        f"{s.get('idle_parallel', '8')} being set up at once (no more than the cap, so that nginx, which cannot "
        "queue, does not answer 502), makes one `GET /` on each, reads the answer and keeps every connection open "
        "and idle; the upstream is `examples/bench_upstream.rs` at 0 ms. Once every connection is answered (or "
        f"failed), and {s.get('idle_settle', '1')} s later, the proxy's RSS (VmRSS summed over its processes) is "
        "sampled; then the clients are stopped. Before they connected, after a short wrk warm-up with N connections, "
        "the same proxy's RSS was sampled the same way.",
        "",
        "Columns: **connected / answered / failed**: connections that were established, that got their answer, and "
        "that failed (connect, request or 5 s timeout), medians over runs; **closed by the proxy before the "
        "sample**: connections the proxy had closed by the time the sample was over (it must be 0 for the sample to "
        "count every client; the proxies' idle timeouts are 60-75 s); **increment**: RSS with the idle clients "
        "minus RSS before; **KiB per idle client**: the increment over the connections still open; **set-up s**: "
        "from the first connect to the last answer; **connect + request**: each connection's time from connect to "
        "the end of its answer; **proxy CPU-µs / client**: the proxy's CPU time over the set-up and the idle "
        "sample, per answered connection. Medians over runs.",
        "",
    ]
    rows = []
    for subject, layout, rs in grouped(runs):
        ns = [numbers(r) for r in rs]
        ds = [derive(r) for r in rs]
        closed = [n["closed"] for n in ns]
        rows.append([
            subject, layout, len(rs),
            f'{fmt(med([n["connected"] for n in ns]))} / {fmt(med([n["completed"] for n in ns]))} / '
            f'{fmt(med([n["failed"] for n in ns]))}',
            "unknown" if any(c is None for c in closed) else fmt(max(closed)),
            fmt(med([n["before_mb"] for n in ns]), 1), fmt(med([n["idle_mb"] for n in ns]), 1),
            fmt(med([n["inc_mb"] for n in ns]), 1), fmt(med([n["per_client_kib"] for n in ns]), 2),
            fmt(med([n["setup_s"] for n in ns]), 2),
            f'{fmt(med([d["p50"] for d in ds]), 1)} / {fmt(med([d["p99"] for d in ds]), 1)}',
            other_codes(ds), fmt(med([d["proxy_cpu_us"] for d in ds]), 1),
        ])
    lines += markdown_table(HEAD, rows)
    return lines


def _best(groups, prefix):
    """The variant of a family with the lowest median RSS with idle clients: (subject, MB, KiB per client, runs)."""
    cands = []
    for subject, _, rs in groups:
        if subject.startswith(prefix):
            ns = [numbers(r) for r in rs]
            cands.append((subject, med([n["idle_mb"] for n in ns]), med([n["per_client_kib"] for n in ns]), ns))
    return min(cands, key=lambda c: c[1]) if cands else None


def targets(runs, meta):
    groups = [g for g in grouped(runs) if g[1] == "shared"] or grouped(runs)
    fg, hp, ng = (_best(groups, p) for p in ("floodgate", "haproxy", "nginx"))
    if fg is None:
        return []
    clients = max(r["clients"] for r in runs)

    def show(b):
        return f"{b[0]}: {fmt(b[1], 1)} MB ({fmt(b[2], 2)} KiB / client)" if b else "-"

    verdict = "n/a"
    if hp is not None:
        verdict = "met" if fg[1] <= hp[1] else ("tie" if (fg[1] - hp[1]) / hp[1] < NOISE_RSS else "gap")
    short = [b[0] for b in (fg, hp, ng) if b and any(n["closed"] or n["failed"] for n in b[3])]
    note = f"nginx best: {show(ng)}; within {NOISE_RSS:.0%} is a tie"
    if short:
        note += "; not every client was connected at the sample for " + ", ".join(short) + " (see the table)"
    return [{
        "target": f"Idle clients: proxy RSS with {clients:,} connected idle clients <= HAProxy's",
        "floodgate": show(fg),
        "peer": show(hp),
        "verdict": verdict,
        "note": note,
    }]


def plot(runs, meta, ax):
    """Proxy RSS before and with the idle clients, per subject (shared layout when there is one)."""
    groups = [g for g in grouped(runs) if g[1] == "shared"] or grouped(runs)
    names = [g[0] for g in groups]
    before = [med([numbers(r)["before_mb"] for r in g[2]]) for g in groups]
    idle = [med([numbers(r)["idle_mb"] for r in g[2]]) for g in groups]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], before, 0.4, label="before")
    ax.bar([x + 0.2 for x in xs], idle, 0.4, label="with idle clients")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, fontsize=8)
    ax.set_ylabel("proxy RSS (MB)")
    clients = max((r["clients"] for r in runs), default=0)
    ax.set_title(f"Idle clients: proxy resident memory with {clients:,} connected idle clients")
    ax.legend(fontsize=7)
