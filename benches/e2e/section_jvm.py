"""Section of docs/benchmarks.md for the "jvm" scenario (wrk closed loop in front of a thread-per-connection JVM
upstream, benches/e2e/jvm/JvmUpstream.java); see report_common for the contract."""

from report_common import by_layout_and_subject, by_subject, derive, fmt, markdown_table, med, other_codes, spread

TITLE = "Thread-per-connection JVM upstream: threads and memory behind a cap"

HEAD = [
    "subject", "layout", "runs", "2xx/s med [min-max]", "p99 ms", "non-2xx (share)",
    "upstream peak conns / in flight", "upstream Java threads: peak / pool (window / life)",
    "upstream RSS MB (window peak)", "proxy RSS MB", "proxy CPU-µs / response",
]



def pool(run, life=True):
    """Threads the load made the JVM start: its peak Java threads minus those it had before the first accept."""
    up, warm = run["upstream"], run["upstream_warmup"]
    if up.get("peak_threads") is None or up.get("base_threads") is None:
        return None
    peak = max(up["peak_threads"], warm.get("peak_threads", 0)) if life else up["peak_threads"]
    return peak - up["base_threads"]


def up_rss_mb(run):
    up = run["upstream"]
    kb = up.get("hwm_kb") if up.get("hwm_kb", -1) >= 0 else run["upstream_hwm_kb"]
    return kb / 1024


def rows_of(runs, key):
    return by_layout_and_subject(runs, key)


def table_rows(runs, key):
    rows = []
    for subject, layout, rs in rows_of(runs, key):
        ds = [derive(r) for r in rs]
        peak_threads = max(r["upstream"].get("peak_threads") or 0 for r in rs)
        rows.append([
            subject, layout, len(rs), spread([d["ok_rate"] for d in ds]), fmt(med([d["p99"] for d in ds]), 1),
            other_codes(ds),
            f'{max(d["peak_conns_life"] for d in ds):,} / {max(d["peak_inflight_life"] for d in ds):,}',
            f'{peak_threads:,} / {fmt(max(pool(r, False) or 0 for r in rs))} / {fmt(max(pool(r) or 0 for r in rs))}',
            fmt(med([up_rss_mb(r) for r in rs]), 0), fmt(med([d["proxy_hwm_mb"] for d in ds]), 1),
            fmt(med([d["proxy_cpu_us"] for d in ds]), 1),
        ])
    return rows


def render(runs, meta):
    s = meta["settings"]
    lines = [
        "wrk, closed loop, against `benches/e2e/jvm/JvmUpstream.java`: a plain Java 17 HTTP/1.1 server that gives "
        "every accepted connection its own platform thread for as long as the connection lives (like a classic "
        "blocking servlet container or Ktor CIO: threads follow connections), with a fixed service time "
        f"(`Thread.sleep`, {s.get('jvm_delay', '50')} ms). JVM flags: `-Xms{s.get('jvm_heap', '256m')} "
        f"-Xmx{s.get('jvm_heap', '256m')} -Xss{s.get('jvm_xss', '256k')} -XX:+AlwaysPreTouch` (the whole heap is "
        "resident from the start, so RSS differences are threads and connections, not how much heap the collector "
        "touched; -Xss bounds the stacks' address space only, RSS per thread is what a thread touches). Connections "
        f"beyond {s.get('jvm_max_conns', '9000')} are closed unserved (they would be threads too).",
        "",
        "Columns: **upstream Java threads**: *peak*: the JVM's own peak of live Java threads (`ThreadMXBean`, reset "
        "with the window), the JVM's housekeeping threads included, its GC and JIT threads not (they are not Java "
        "threads); *pool*: that peak minus the live Java threads just before the first accept (main/accept loop, "
        "control listener, Reference Handler, Finalizer, Signal Dispatcher, Common-Cleaner, Notification Thread): the "
        "threads the load made the JVM start, which in this server are connection threads (its own count of them "
        "agrees; see the raw data, `peak_conn_threads`); *window*: the measured window, *life*: with the warm-up. "
        "**upstream RSS**: the JVM's VmHWM over the measured window (reset through `/proc/self/clear_refs` when the "
        "window starts), median over runs. The rest as in the closed-loop section.",
        "",
        "In a server like this one a count above N is threads really run: a request whose proxy-side connection was "
        "closed (a client gone at the end of a run, with HAProxy's `option abortonclose`) keeps its thread until its "
        "service time is over, while the proxy may already send the next request on a new connection. Direct, the "
        "peak connections column says how many clients the JVM held at once: on a small machine it may not keep up "
        "with accepting and serving thousands (wrk closes a connection after 5 s without an answer and opens a new "
        "one).",
    ]
    for cap, clients in sorted({(r["cap"], r["clients"]) for r in runs}):
        key = lambda r, c=cap, k=clients: (r["cap"], r["clients"]) == (c, k)
        lines += ["", f"### N = {cap}, {clients:,} clients", ""]
        lines += markdown_table(HEAD, table_rows(runs, key))
    refused = [r for r in runs if r["upstream"].get("refused", 0) or r["upstream_warmup"].get("refused", 0)]
    if refused:
        lines += ["", "Connections the JVM closed unserved (over its connection bound): " + ", ".join(
            f'{r["subject"]} at {r["clients"]:,} clients ({r["upstream"].get("refused", 0) + r["upstream_warmup"].get("refused", 0):,})'
            for r in refused) + "."]
    return lines


def _preferred(runs):
    shared = [r for r in runs if r["layout"] == "shared"]
    return shared or runs


def _worst_pool(runs, subject):
    vals = [pool(r) for r in runs if r["subject"] == subject]
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


def _best_family(runs, prefix):
    """The variant of a family whose worst pool over every client count is lowest: (subject, worst)."""
    cands = [(s, _worst_pool(runs, s)) for s in sorted({r["subject"] for r in runs}) if s.startswith(prefix)]
    cands = [c for c in cands if c[1] is not None]
    return min(cands, key=lambda c: c[1]) if cands else (None, None)


def _at(runs, subject, clients, f):
    return med([f(r) for r in runs if r["subject"] == subject and r["clients"] == clients])


def targets(runs, meta):
    rs = _preferred(runs)
    if not rs:
        return []
    out = []
    for cap in sorted({r["cap"] for r in rs}):
        at_cap = [r for r in rs if r["cap"] == cap]
        clients = sorted({r["clients"] for r in at_cap})
        fs, fv = _best_family(at_cap, "floodgate")
        if fs is None:
            continue
        peers = [_best_family(at_cap, p) for p in ("haproxy", "nginx")]
        top = clients[-1]
        direct = [f"{c:,} cl.: {fmt(_at(at_cap, 'direct', c, pool))} threads, "
                  f"{fmt(_at(at_cap, 'direct', c, up_rss_mb))} MB" for c in clients
                  if _at(at_cap, "direct", c, pool) is not None]
        behind = f"{fs} at {top:,} cl.: {fmt(_at(at_cap, fs, top, up_rss_mb))} MB"
        out.append({
            "target": f"JVM upstream's pool threads <= N + 2 ({cap + 2}) "
                      + (f"from {clients[0]:,} to {top:,} clients" if len(clients) > 1 else f"at {top:,} clients")
                      + " (worst run, warm-up included)",
            "floodgate": f"{fs}: {fv}",
            "peer": "; ".join(f"{s}: {v}" for s, v in peers if s is not None) or "-",
            "verdict": "met" if fv <= cap + 2 else "gap",
            "note": "upstream RSS, direct: " + ("; ".join(direct) if direct else "not run") + f"; behind {behind}",
        })
    return out


def plot(runs, meta, ax):
    """The JVM's pool threads against clients, per subject (log-log): flat behind a cap, the diagonal direct."""
    rs = _preferred(runs)
    clients = sorted({r["clients"] for r in rs})
    for subject, _ in by_subject(rs):
        ys = [_at(rs, subject, c, pool) for c in clients]
        pts = [(c, y) for c, y in zip(clients, ys) if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [max(p[1], 1) for p in pts], marker="o", label=subject)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("clients (wrk connections)")
    ax.set_ylabel("JVM threads started by the load")
    ax.set_title("Thread-per-connection JVM upstream: threads it needs, direct and behind each proxy")
    ax.legend(fontsize=7, ncol=2)
