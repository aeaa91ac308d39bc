"""Section of docs/benchmarks.md for the "storm" scenario (a retry storm: wrk closed loop, no think time, 2 s client
timeout, 1,000-16,000 clients against cap 8 and a 50 ms service time); see report_common for the contract."""

from report_common import derive, fmt, markdown_table, med, pct0 as pct, present_subjects, proxy_cores, spread

TITLE = "Retry storm: goodput while thousands of clients are refused"

SUBJECTS = ["floodgate-1", "floodgate-2", "haproxy-1", "haproxy-2", "haproxyq-1", "haproxyq-2", "nginx-1", "nginx-2"]
UPSTREAMS = {"bench": "bench upstream (examples/bench_upstream.rs)", "jvm": "thread-per-connection JVM upstream"}

HEAD = [
    "subject", "runs", "2xx/s med [min-max]", "share of N / service", "upstream at N in flight (mean / N)",
    "shed answers/s", "503 without Retry-After", "client timeouts", "socket errors (connect / read)",
    "proxy CPU (cores)", "proxy RSS MB", "upstream peak conns / in flight",
]


def capacity(run):
    return run["cap"] * 1000.0 / max(run["delay_ms"], 1e-9)


def busy_share(run):
    """Share of the window the upstream had N (or more) requests in flight, and its mean in flight over N, from its
    own clock of levels: (None, None) for an upstream without one."""
    up = run["upstream"]
    levels, window = up.get("inflight_time_us"), up.get("window_us")
    if not levels or not window:
        return None, None
    mean = sum(level * us for level, us in enumerate(levels)) / window
    return sum(levels[run["cap"]:]) / window, mean / run["cap"]


def row(run):
    d = derive(run)
    w = run["load"]
    secs = max(w["duration_us"], 1) / 1e6
    shed = sum(v for k, v in w["codes"].items() if k in ("503", "429"))
    d.update({
        "share": d["ok_rate"] / capacity(run),
        "busy": busy_share(run)[0],
        "mean_busy": busy_share(run)[1],
        "shed_rate": shed / secs,
        "no_retry_after": w.get("no_retry_after_503"),
        "connect_read": w.get("err_connect", 0) + w.get("err_read", 0) + w.get("err_write", 0),
        "cores": proxy_cores(run),
    })
    return d


def subjects(runs):
    return present_subjects(runs, SUBJECTS)


def table(runs):
    rows = []
    for subject in subjects(runs):
        rs = [r for r in runs if r["subject"] == subject]
        ds = [row(r) for r in rs]
        missing = [d["no_retry_after"] for d in ds if d["no_retry_after"] is not None]
        rows.append([
            subject, len(rs), spread([d["ok_rate"] for d in ds]), pct(med([d["share"] for d in ds])),
            f'{pct(med([d["busy"] for d in ds]))} ({pct(med([d["mean_busy"] for d in ds]))})',
            fmt(med([d["shed_rate"] for d in ds])),
            fmt(max(missing)) if missing else "-", fmt(med([d["timeouts"] for d in ds])),
            fmt(med([d["connect_read"] for d in ds])), fmt(med([d["cores"] for d in ds]), 2),
            fmt(med([d["proxy_hwm_mb"] for d in ds])),
            f'{max(d["peak_conns_life"] for d in ds):,} / {max(d["peak_inflight_life"] for d in ds):,}',
        ])
    return rows


def render(runs, meta):
    s = meta["settings"]
    cap = runs[0]["cap"] if runs else 8
    delay = runs[0]["delay_ms"] if runs else 50
    lines = [
        f"wrk, closed loop with no think time (a shed answer is followed at once by the next request: a retry "
        f"storm), client timeout {s.get('storm_timeout', '2')} s, cap N = {cap}, service time {delay} ms, so "
        f"the upstream's capacity is N / service time = {cap * 1000 / delay:.0f} req/s; queue bound "
        f"{s.get('queue', '1024')}, queue timeout {s.get('queue_timeout', '2')} s. "
        f"{s.get('storm_duration', '8')} s measured after {s.get('storm_warmup', '3')} s of the same load. "
        "Subjects: floodgate with its defaults otherwise; **haproxy-T** sheds with 503 once its backend queue holds "
        "the queue bound (as in the other sections); **haproxyq-T** queues everything (no bound, `timeout queue` "
        "60 s), the configuration that keeps HAProxy's goodput in a storm by making every client wait its turn; "
        "nginx has no queue (502 when its `max_conns` are busy).",
        "",
        "Columns: **share of N / service**: 2xx/s over the capacity; **upstream at N in flight**: the share of the "
        "window the upstream itself had N requests in flight (its own clock of in-flight levels, "
        "`inflight_time_us`), and in brackets its mean number in flight over N (each hand-off dips the count to "
        "N - 1 for its length, so the first is the stricter); **shed answers/s**: 503 and 429 answers per second; **503 without Retry-After**: the "
        "worst run; **client timeouts**: wrk's count of requests still unanswered after the client timeout, "
        "sampled every 2 s (wrk keeps waiting and counts the answer if it comes: a FIFO queue of 1,024 drained at "
        f"{cap * 1000 / delay:.0f} req/s holds a request up to the queue timeout, as long as the client's own); "
        "**proxy CPU**: cores used over the window. The rest as in the closed-loop section.",
    ]
    for kind in [k for k in UPSTREAMS if any(r["upstream_kind"] == k for r in runs)]:
        for clients in sorted({r["clients"] for r in runs if r["upstream_kind"] == kind}):
            sel = [r for r in runs if r["upstream_kind"] == kind and r["clients"] == clients]
            lines += ["", f"### {UPSTREAMS[kind]}, {clients:,} clients", ""]
            lines += markdown_table(HEAD, table(sel))
    if runs:
        lines += ["", f"Client counts run: {', '.join(f'{c:,}' for c in sorted({r['clients'] for r in runs}))} "
                      f"(`ulimit -n` {s.get('storm_fd_limit', 'see the run')}; storm_clients asked for "
                      f"{s.get('storm_clients', '-')}). HAProxy and nginx hold two descriptors per proxied client: "
                      "their `maxconn` / `worker_connections` is at most (limit - 200) / 2, so at 16,000 clients "
                      "(limit 20,000) they hold 9,900 and the rest wait in their accept backlog."]
    return lines


def _share(runs, subject, kind, clients):
    return med([row(r)["share"] for r in runs
                if r["subject"] == subject and r["upstream_kind"] == kind and r["clients"] == clients])


def targets(runs, meta):
    out = []
    counts = sorted({r["clients"] for r in runs if r["clients"] <= 8000})
    if not counts:
        return out
    for prefix in ("floodgate",):
        cells = []
        for subject in [s for s in subjects(runs) if s.startswith(prefix)]:
            for kind in UPSTREAMS:
                for clients in counts:
                    share = _share(runs, subject, kind, clients)
                    if share is not None:
                        cells.append((share, subject, kind, clients))
        if not cells:
            continue
        worst = min(cells)
        peers = []
        for peer in ("haproxy-", "haproxyq-", "nginx-"):
            pc = [(_share(runs, s, k, c), s, k, c) for s in subjects(runs) if s.startswith(peer)
                  for k in UPSTREAMS for c in counts]
            pc = [p for p in pc if p[0] is not None]
            if pc:
                w = min(pc)
                peers.append(f"{peer.rstrip('-')} worst {100 * w[0]:.0f} % ({w[1]}, {w[2]}, {w[3]:,} cl.)")
        out.append({
            "target": f"Storm: 2xx/s >= 90 % of N / service time at {', '.join(f'{c:,}' for c in counts)} clients, "
                      "--threads 1 and 2, bench and JVM upstream (worst median)",
            "floodgate": f"{100 * worst[0]:.0f} % ({worst[1]}, {worst[2]}, {worst[3]:,} cl.)",
            "peer": "; ".join(peers) or "-",
            "verdict": "met" if worst[0] >= 0.9 else "gap",
            "note": "",
        })
    return out


def plot(runs, meta, ax):
    """Goodput share against clients, per subject; solid the bench upstream, dashed the JVM one."""
    for kind, style in (("bench", "-"), ("jvm", "--")):
        rs = [r for r in runs if r["upstream_kind"] == kind]
        clients = sorted({r["clients"] for r in rs})
        for subject in subjects(rs):
            pts = [(c, _share(rs, subject, kind, c)) for c in clients]
            pts = [(c, 100 * v) for c, v in pts if v is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=f"{subject} ({kind})")
    ax.axhline(90, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log")
    ax.set_ylim(0, 105)
    ax.set_xlabel("clients (wrk connections, no think time)")
    ax.set_ylabel("2xx/s, % of N / service time")
    ax.set_title("Retry storm: goodput against clients (solid: bench upstream, dashed: JVM upstream)")
    ax.legend(fontsize=6, ncol=4)
