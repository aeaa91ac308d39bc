"""Section of docs/benchmarks.md for the "closed" scenario (wrk closed loop); see report_common for the contract."""

from report_common import (
    NOISE_P99, best, by_subject, compare, fmt, layouts, markdown_table, med, other_codes, spread,
)

TITLE = "Closed loop: clients x service time"

HEAD = [
    "subject", "layout", "runs", "2xx/s med [min-max]", "p50 ms", "p99 ms", "p99.9 ms", "non-2xx (share)",
    "socket errors (timeouts)", "upstream peak conns (window / life)", "upstream peak in flight",
    "upstream conns accepted", "upstream gap p50 / p99 ms", "proxy RSS MB", "proxy CPU-µs / response",
]


def cases(runs):
    return sorted({(r["cap"], r["delay_ms"], r["clients"]) for r in runs})



def table_rows(runs, key):
    rows = []
    for layout in layouts(runs):
        for subject, rs in by_subject(runs, lambda r: key(r) and r["layout"] == layout):
            rows.append([
                subject, layout, len(rs), spread([r["ok_rate"] for r in rs]),
                fmt(med([r["p50"] for r in rs]), 1), fmt(med([r["p99"] for r in rs]), 1),
                fmt(med([r["p999"] for r in rs]), 1), other_codes(rs),
                f'{fmt(med([r["sock_err"] for r in rs]))} ({fmt(med([r["timeouts"] for r in rs]))})',
                f'{max(r["peak_conns"] for r in rs)} / {max(r["peak_conns_life"] for r in rs)}',
                max(r["peak_inflight_life"] for r in rs), fmt(med([r["accepted"] for r in rs])),
                f'{fmt(med([r["gap_p50"] for r in rs]), 3)} / {fmt(med([r["gap_p99"] for r in rs]), 3)}',
                fmt(med([r["proxy_hwm_mb"] for r in rs]), 1), fmt(med([r["proxy_cpu_us"] for r in rs]), 1),
            ])
    return rows


def render(runs, meta):
    lines = [
        "wrk, closed loop (each client sends its next request when the last one is answered), "
        f"{meta['settings'].get('wrk_threads', '2')} threads, against `examples/bench_upstream.rs` with a fixed service "
        "time. At 0 ms the proxy itself is the bottleneck; at 2 ms and more the cap is (N / service time bounds any "
        "proxy). **upstream gap**: on each upstream connection, the time from one response leaving the upstream's "
        "handler to the next request arriving on it (the part of the hand-off the proxy controls), median over runs "
        "of each run's p50 / p99.",
    ]
    for cap, delay, clients in cases(runs):
        key = lambda r, c=cap, d=delay, k=clients: (r["cap"], r["delay_ms"], r["clients"]) == (c, d, k)
        lines += ["", f"### N = {cap}, {clients} clients, {delay} ms service time", ""]
        if delay > 0:
            lines += [f"Upper bound through any proxy: N / service time = {cap * 1000 / delay:,.0f} 2xx/s.", ""]
        lines += markdown_table(HEAD, table_rows(runs, key))
        held, broke = [], []
        for subject, rs in by_subject(runs, key):
            if subject == "direct":
                continue
            peak = max(max(r["peak_conns_life"], r["peak_inflight_life"]) for r in rs)
            (held if peak <= cap else broke).append(f"{subject} ({peak})")
        lines += ["", f"Upstream connections and requests in flight within the cap of {cap} over every run's whole "
                  f"life: {', '.join(held) or 'none'}; above it: {', '.join(broke) or 'none'}."]
    return lines


def targets(runs, meta):
    out = []
    for cap, delay, clients in cases(runs):
        if delay not in (20, 50):
            continue
        shared = [r for r in runs if (r["cap"], r["delay_ms"], r["clients"]) == (cap, delay, clients)
                  and r["layout"] == "shared"]
        rbs = by_subject(shared)
        bound = cap * 1000 / delay
        fs, fv = best(rbs, "floodgate", lambda r: r["ok_rate"])
        hs, hv = best(rbs, "haproxy", lambda r: r["ok_rate"])
        if fv is None:
            continue
        out.append({
            "target": f"Utilisation, {delay} ms, {clients} clients: 2xx/s >= 95 % of N / service time ({0.95 * bound:,.0f})",
            "floodgate": f"{fs}: {fmt(fv)} ({100 * fv / bound:.1f} %)",
            "peer": f"{hs}: {fmt(hv)} ({100 * hv / bound:.1f} %)" if hv else "-",
            "verdict": "met" if fv >= 0.95 * bound else "gap",
            "note": "",
        })
    for cap, delay, clients in cases(runs):
        if delay != 2:
            continue
        shared = [r for r in runs if (r["cap"], r["delay_ms"], r["clients"]) == (cap, delay, clients)
                  and r["layout"] == "shared"]
        rbs = by_subject(shared)
        fs, fv = best(rbs, "floodgate", lambda r: r["gap_p99"], higher=False)
        hs, hv = best(rbs, "haproxy", lambda r: r["gap_p99"], higher=False)
        if fv is None:
            continue
        f50 = med([r["gap_p50"] for s, rs in rbs if s == fs for r in rs])
        h50 = med([r["gap_p50"] for s, rs in rbs if s == hs for r in rs])
        out.append({
            "target": f"Hand-off gap on each upstream connection, 2 ms, {clients} clients (report; lower is better)",
            "floodgate": f"{fs}: p50 {fmt(f50, 3)} / p99 {fmt(fv, 3)} ms",
            "peer": f"{hs}: p50 {fmt(h50, 3)} / p99 {fmt(hv, 3)} ms" if hv is not None else "-",
            "verdict": compare(fv, hv, False, NOISE_P99),
            "note": "reported, no bound set",
        })
    return out


def plot(runs, meta, ax):
    """2xx/s by subject at each (service time, clients), shared layout: the first figure of the report."""
    shared = [r for r in runs if r["layout"] == "shared"]
    keys = cases(shared)
    subjects = [s for s, _ in by_subject(shared)]
    width = 0.8 / max(len(subjects), 1)
    for i, subject in enumerate(subjects):
        vals = []
        for cap, delay, clients in keys:
            rs = [d for s, ds in by_subject(shared, lambda r: (r["cap"], r["delay_ms"], r["clients"]) == (cap, delay, clients))
                  if s == subject for d in ds]
            vals.append(med([r["ok_rate"] for r in rs]) or 0)
        ax.bar([k + i * width for k in range(len(keys))], vals, width, label=subject)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))])
    ax.set_xticklabels([f"N={c}\n{d} ms\n{k} cl." for c, d, k in keys], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("2xx/s (log)")
    ax.set_title("Closed loop: successful responses per second (shared CPUs)")
    ax.legend(fontsize=7, ncol=2)
