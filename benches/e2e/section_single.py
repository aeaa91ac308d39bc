"""Section of docs/benchmarks.md for the "single" scenario (one client, wrk -t1 -c1); see report_common."""

from report_common import best, by_subject, fmt, layouts, main_layout, markdown_table, med, other_codes, spread

TITLE = "One client: the latency a proxy adds"

HEAD = [
    "subject", "layout", "runs", "responses/s med [min-max]", "p50 µs", "p99 µs", "p99.9 µs", "p50 added µs",
    "p99 added µs", "non-2xx (share)", "proxy RSS MB", "proxy CPU-µs / response",
]

BOUND_US = 100  # the target: p50 <= direct's + 100 µs



def cases(runs):
    return sorted({(r["cap"], r["delay_ms"]) for r in runs})


def baseline(runs, key):
    """direct's median p50 and p99 (ms) for the runs key selects, or (None, None)."""
    rows = [rs for s, rs in by_subject(runs, key) if s == "direct"]
    if not rows:
        return None, None
    return med([r["p50"] for r in rows[0]]), med([r["p99"] for r in rows[0]])


def added(value_ms, base_ms):
    return None if value_ms is None or base_ms is None else (value_ms - base_ms) * 1000


def render(runs, meta):
    lines = [
        "wrk with one thread and one connection, closed loop: the next request goes when the last answer is in, so "
        "nothing ever queues and the latency is the upstream's plus what the path through the proxy adds. "
        "**added**: the subject's median over repetitions minus direct's, in the same layout (a negative value is "
        "noise). Target: p50 added <= 100 µs. wrk corrects its percentiles for coordinated omission (a response "
        "that took S adds S / mean interval synthetic samples), and with one connection the mean interval is tens of "
        "µs: a single 50 ms stall of any process on the machine becomes hundreds of samples, enough to move p99. "
        "p50 is the robust figure here.",
    ]
    for cap, delay in cases(runs):
        lines += ["", f"### N = {cap}, {delay} ms service time", ""]
        rows = []
        for layout in layouts(runs):
            key = lambda r, l=layout: (r["cap"], r["delay_ms"]) == (cap, delay) and r["layout"] == l
            b50, b99 = baseline(runs, key)
            for subject, rs in by_subject(runs, key):
                p50, p99 = med([r["p50"] for r in rs]), med([r["p99"] for r in rs])
                rows.append([
                    subject, layout, len(rs), spread([r["rate"] for r in rs]), fmt(p50 * 1000), fmt(p99 * 1000),
                    fmt(med([r["p999"] for r in rs]) * 1000),
                    "-" if subject == "direct" else fmt(added(p50, b50)),
                    "-" if subject == "direct" else fmt(added(p99, b99)),
                    other_codes(rs), fmt(med([r["proxy_hwm_mb"] for r in rs]), 1),
                    fmt(med([r["proxy_cpu_us"] for r in rs]), 1),
                ])
        lines += markdown_table(HEAD, rows)
    return lines


def targets(runs, meta):
    out = []
    layout = main_layout(runs)
    where = "" if layout == "shared" else f", {layout} layout"
    for cap, delay in cases(runs):
        key = lambda r: (r["cap"], r["delay_ms"]) == (cap, delay) and r["layout"] == layout
        b50, _ = baseline(runs, key)
        rbs = by_subject(runs, key)

        def best_added(prefix):
            s, v = best(rbs, prefix, lambda r: r["p50"], higher=False)
            return s, v, added(v, b50)

        fs, fv, fa = best_added("floodgate")
        hs, hv, ha = best_added("haproxy")
        if fv is None:
            continue
        describe = lambda s, v, a: f"{s}: p50 {fmt(v * 1000)} µs" + (
            "" if a is None else f" ({'+' if a >= 0 else ''}{fmt(a)} µs)")
        out.append({
            "target": f"Added latency, one client, {delay} ms{where}: p50 <= direct's + {BOUND_US} µs",
            "floodgate": describe(fs, fv, fa),
            "peer": describe(hs, hv, ha) if hv is not None else "-",
            "verdict": "n/a" if fa is None else ("met" if fa <= BOUND_US else "gap"),
            "note": f"direct: p50 {fmt(b50 * 1000)} µs" if b50 is not None else "no direct run to compare with",
        })
    return out
