"""Helpers shared by benches/e2e/report.py and its per-scenario sections (section_<scenario>.py).

A section module has: TITLE (str); render(runs, meta) -> list of Markdown lines (runs: this scenario's JSON lines);
optionally targets(runs, meta) -> list of dicts {"target", "floodgate", "peer", "verdict", "note"} for the targets
table (verdict: "met", "tie" (inside the noise band), "gap", or "n/a"), and plot(runs, meta, ax) to draw one panel.
Standard library only.
"""

import statistics

SUBJECT_ORDER = ["direct", "floodgate-1", "floodgate-2", "floodgate-4", "haproxy-1", "haproxy-2", "haproxy-4", "nginx-1",
                 "nginx-2", "nginx-4"]
# The stand's noise band: differences below these are reported as ties.
NOISE_RATE = 0.15
NOISE_P99 = 0.20


def derive(run):
    """Per-run numbers, as the tables show them, from one JSON line of lib.sh's run_case."""
    w, up = run["load"], run["upstream"]
    secs = max(w["duration_us"], 1) / 1e6
    codes = {int(k): v for k, v in w["codes"].items()}
    ok = sum(v for k, v in codes.items() if 200 <= k < 300)
    other = {k: v for k, v in codes.items() if not 200 <= k < 300}
    responses = w["requests"]
    return {
        "ok_rate": ok / secs,
        "rate": responses / secs,
        "p50": w["p50_us"] / 1000,
        "p99": w["p99_us"] / 1000,
        "p999": w["p999_us"] / 1000,
        "by_status": {
            int(k): {q: v / 1000 for q, v in d.items()} for k, d in (w.get("by_status") or {}).items()
        },
        "ok": ok,
        "other": other,
        "responses": responses,
        "sock_err": w.get("err_connect", 0) + w.get("err_read", 0) + w.get("err_write", 0) + w.get("err_timeout", 0),
        "timeouts": w.get("err_timeout", 0),
        "peak_conns": up["peak_conns"],
        "peak_conns_life": max(up["peak_conns"], run["upstream_warmup"]["peak_conns"]),
        "peak_inflight": up["peak_inflight"],
        "peak_inflight_life": max(up["peak_inflight"], run["upstream_warmup"]["peak_inflight"]),
        "accepted": up["accepted"],
        "gap_p50": up["gap_p50_us"] / 1000 if up.get("gap_p50_us") is not None else None,
        "gap_p99": up["gap_p99_us"] / 1000 if up.get("gap_p99_us") is not None else None,
        "up_hwm_mb": run["upstream_hwm_kb"] / 1024,
        "up_threads": run["upstream_threads"],
        "up_peak_threads": up.get("peak_threads"),
        "up_cpu_us": run["upstream_cpu_ticks"] * 1e6 / run["clk_tck"] / max(responses, 1),
        "proxy_hwm_mb": run["proxy_hwm_kb"] / 1024 if run["proxy_cpu_ticks"] is not None else None,
        "proxy_rss_mb": run.get("proxy_rss_kb", 0) / 1024 if run["proxy_cpu_ticks"] is not None else None,
        "proxy_cpu_us": (
            run["proxy_cpu_ticks"] * 1e6 / run["clk_tck"] / max(responses, 1)
            if run["proxy_cpu_ticks"] is not None
            else None
        ),
    }


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
    values = [v for v in values if v is not None]
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


def layouts(runs):
    """The CPU layouts present, shared first."""
    return [l for l in ("shared", "pinned") if any(r["layout"] == l for r in runs)]


def main_layout(runs):
    """The layout a targets row speaks for: shared when it ran, else the first there is."""
    return (layouts(runs) or ["shared"])[0]


def by_subject(runs, key=None, derive_fn=derive):
    """[(subject, [derived rows])] in the report's subject order; key(run) filters the runs first, derive_fn turns
    each run into its row (a section may extend `derive`)."""
    present = {r["subject"] for r in runs}
    out = []
    for subject in SUBJECT_ORDER + sorted(present - set(SUBJECT_ORDER)):
        rows = [derive_fn(r) for r in runs if r["subject"] == subject and (key is None or key(r))]
        if rows:
            out.append((subject, rows))
    return out


def by_layout_and_subject(runs, key=None):
    """[(subject, layout, its raw runs)]: layouts shared first, subjects in the report's order."""
    return [
        (subject, layout, rs)
        for layout in layouts(runs)
        for subject, rs in by_subject(runs, lambda r, l=layout: r["layout"] == l and (key is None or key(r)), lambda r: r)
    ]


def markdown_table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def best(rows_by_subject, prefix, metric, higher=True):
    """The best variant of a peer ("haproxy", "floodgate"...): (subject, median) by a metric's median."""
    cands = [(s, med([metric(r) for r in rows])) for s, rows in rows_by_subject if s.startswith(prefix)]
    cands = [(s, v) for s, v in cands if v is not None]
    if not cands:
        return None, None
    return (max if higher else min)(cands, key=lambda c: c[1])


def compare(ours, theirs, higher_is_better, band):
    """'met' when ours is at least as good, 'tie' when worse by less than the band, else 'gap'."""
    if ours is None or theirs is None:
        return "n/a"
    if (ours >= theirs) if higher_is_better else (ours <= theirs):
        return "met"
    worse = (theirs - ours) / theirs if higher_is_better else (ours - theirs) / max(theirs, 1e-9)
    return "tie" if worse < band else "gap"


def ordered_groups(rows, key, order):
    """[(name, [rows])] by row[key]: the names of `order` that occur, in that order, then any others sorted."""
    names = [n for n in order if any(x[key] == n for x in rows)]
    names += sorted({x[key] for x in rows} - set(names))
    return [(n, [x for x in rows if x[key] == n]) for n in names]


def med_of(rows, key):
    """The median of one column over a group's rows (None values left out)."""
    return med([x[key] for x in rows])


def times(a, b):
    """a / b as "1.23x", or "-" when either is missing."""
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}x"


def ratio(a, b, digits=2):
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.{digits}f}"


def present_subjects(runs, order):
    """The subjects that ran, those of `order` first in its order, then any others sorted."""
    present = {r["subject"] for r in runs}
    return [s for s in order if s in present] + sorted(present - set(order))


def proxy_cores(run):
    """Cores the proxy used over the measured window, or None for a run with no proxy."""
    if run["proxy_cpu_ticks"] is None:
        return None
    return run["proxy_cpu_ticks"] / run["clk_tck"] / run["duration_s"]


def pct0(v):
    """A share as a whole percentage, or "-"."""
    return "-" if v is None else f"{100 * v:.0f} %"
