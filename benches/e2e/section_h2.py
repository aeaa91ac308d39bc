"""Section of docs/benchmarks.md for the "h2" scenario (h2load, HTTP/2 cleartext clients); see report_common."""

from report_common import (
    NOISE_RATE, best, by_subject, compare, derive, fmt, layouts, main_layout, markdown_table, med,
    other_codes, ratio, spread,
)

TITLE = "HTTP/2 clients (h2c)"

HEAD = [
    "subject", "layout", "runs", "2xx/s med [min-max]", "p50 ms", "p99 ms", "p99.9 ms", "mean ms (h2load)",
    "non-2xx (share)", "stream errors (timeouts)", "upstream peak conns / in flight (life)", "upstream conns accepted",
    "proxy RSS MB", "proxy CPU-µs / response",
]

LATENCIES = ("p50_us", "p99_us", "p999_us", "max_us")


def ext(run):
    """derive() of a line whose percentiles may be null (no finished request), plus h2load's own mean."""
    load = run["load"]
    missing = [k for k in LATENCIES if load.get(k) is None]
    if missing:
        run = dict(run, load=dict(load, **{k: 0 for k in missing}))
    d = derive(run)
    for k, name in (("p50_us", "p50"), ("p99_us", "p99"), ("p999_us", "p999")):
        if k in missing:
            d[name] = None
    mean = load.get("summary_mean_us", load.get("mean_us"))
    d["mean"] = mean / 1000 if mean is not None else None
    return d




def grouped(runs, key=None):
    return by_subject(runs, key, ext)


def cases(runs):
    return sorted({(r["cap"], r["delay_ms"], r["clients"], r.get("streams", 1)) for r in runs})


def case_of(r):
    return (r["cap"], r["delay_ms"], r["clients"], r.get("streams", 1))


def render(runs, meta):
    lines = [
        "h2load, closed loop over HTTP/2 cleartext with prior knowledge (h2c): each connection keeps its streams "
        "busy, a new request on a stream as soon as the last is answered. The proxies speak HTTP/1.1 to the upstream "
        "as everywhere else. Subjects: those that take h2c on their listener: floodgate (it tells the HTTP/2 preface "
        "from HTTP/1 on its one port), HAProxy (a plain `bind` in mode http detects the preface), nginx with "
        "`listen ... http2` (which makes that port h2c only). direct is not run: the bench upstream speaks HTTP/1.1 "
        "only. h2load's summary gives only min / max / mean / sd of the request time (**mean** column); the "
        "percentiles come from its per-request log (`--log-file`: status and time of every finished request), as do "
        "the status counts. **stream errors**: h2load's *errored* requests (reset or cut off).",
    ]
    for cap, delay, clients, streams in cases(runs):
        key = lambda r, k=(cap, delay, clients, streams): case_of(r) == k
        lines += ["", f"### N = {cap}, {clients} connections x {streams} streams, {delay} ms service time", ""]
        if delay > 0:
            lines += [f"Upper bound through any proxy: N / service time = {cap * 1000 / delay:,.0f} 2xx/s.", ""]
        rows = []
        for layout in layouts(runs):
            for subject, rs in grouped(runs, lambda r, l=layout: key(r) and r["layout"] == l):
                rows.append([
                    subject, layout, len(rs), spread([r["ok_rate"] for r in rs]),
                    fmt(med([r["p50"] for r in rs]), 1), fmt(med([r["p99"] for r in rs]), 1),
                    fmt(med([r["p999"] for r in rs]), 1), fmt(med([r["mean"] for r in rs]), 1), other_codes(rs),
                    f'{fmt(med([r["sock_err"] for r in rs]))} ({fmt(med([r["timeouts"] for r in rs]))})',
                    f'{max(r["peak_conns_life"] for r in rs)} / {max(r["peak_inflight_life"] for r in rs)}',
                    fmt(med([r["accepted"] for r in rs])), fmt(med([r["proxy_hwm_mb"] for r in rs]), 1),
                    fmt(med([r["proxy_cpu_us"] for r in rs]), 1),
                ])
        lines += markdown_table(HEAD, rows)
    return lines


def targets(runs, meta):
    """No h2 target is set; one report row per case: 2xx/s, floodgate's best against HAProxy's."""
    out = []
    layout = main_layout(runs)
    where = "" if layout == "shared" else f", {layout} layout"
    for k in cases(runs):
        cap, delay, clients, streams = k
        rbs = grouped(runs, lambda r: case_of(r) == k and r["layout"] == layout)
        fs, fv = best(rbs, "floodgate", lambda r: r["ok_rate"])
        hs, hv = best(rbs, "haproxy", lambda r: r["ok_rate"])
        if fv is None:
            continue
        out.append({
            "target": f"HTTP/2 clients, {clients} x {streams} streams, {delay} ms, N = {cap}{where}: 2xx/s (report; "
                      "higher is better)",
            "floodgate": f"{fs}: {fmt(fv)}",
            "peer": f"{hs}: {fmt(hv)}" if hv is not None else "-",
            "verdict": compare(fv, hv, True, NOISE_RATE),
            "note": f"reported, no bound set; floodgate / HAProxy = {ratio(fv, hv)}",
        })
    return out
