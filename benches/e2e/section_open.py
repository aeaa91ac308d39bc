"""Section of docs/benchmarks.md for the "open" scenario (oha at fixed rates); see report_common for the contract."""

from report_common import (
    NOISE_P99, NOISE_RATE, best, by_subject, compare, derive, fmt, layouts, markdown_table, med, other_codes,
    spread,
)

TITLE = "Open loop: fixed request rates"

HEAD = [
    "subject", "layout", "runs", "offered req/s", "2xx/s med [min-max]", "2xx p50 / p99 / p99.9 ms",
    "non-2xx p50 / p99 ms", "non-2xx (share)", "socket errors (timeouts)", "unsent",
    "upstream peak conns / in flight (life)", "proxy RSS MB", "proxy CPU-µs / response",
]


def ext(run):
    """derive() plus what this section needs: latency of 2xx and of each other code apart, from the raw line."""
    d = derive(run)
    load = run["load"]
    by = load.get("by_status") or {}
    ms = lambda v: v / 1000 if v is not None else None
    if "200" in by:
        s = by["200"]
        d["ok_lat"] = (ms(s["p50_us"]), ms(s["p99_us"]), ms(s["p999_us"]))
    elif not d["other"]:  # only 2xx answers: the percentiles of every response are theirs
        d["ok_lat"] = (d["p50"], d["p99"], d["p999"])
    else:
        d["ok_lat"] = (None, None, None)
    d["other_lat"] = {int(k): (ms(s["p50_us"]), ms(s["p99_us"])) for k, s in by.items() if not 200 <= int(k) < 300}
    d["unsent"] = load.get("unsent")
    d["offered"] = run.get("rate")
    return d



def grouped(runs, key=None):
    return by_subject(runs, key, ext)


def case_of(r):
    return (0 if r.get("part") == "cost" else 1, r["cap"], r["delay_ms"], r.get("rate", 0))


def cases(runs):
    return sorted({case_of(r) for r in runs})



def other_latency(rows):
    codes = sorted({c for r in rows for c in r["other_lat"]})
    if not codes:
        return "-"
    return ", ".join(
        f'{c}: {fmt(med([r["other_lat"].get(c, (None, None))[0] for r in rows]), 2)} / '
        f'{fmt(med([r["other_lat"].get(c, (None, None))[1] for r in rows]), 2)}' for c in codes)


def table_rows(runs, key):
    rows = []
    for layout in layouts(runs):
        for subject, rs in grouped(runs, lambda r: key(r) and r["layout"] == layout):
            rows.append([
                subject, layout, len(rs), fmt(med([r["offered"] for r in rs])), spread([r["ok_rate"] for r in rs]),
                " / ".join(fmt(med([r["ok_lat"][i] for r in rs]), 1) for i in range(3)),
                other_latency(rs), other_codes(rs),
                f'{fmt(med([r["sock_err"] for r in rs]))} ({fmt(med([r["timeouts"] for r in rs]))})',
                fmt(max((r["unsent"] or 0) for r in rs)),
                f'{max(r["peak_conns_life"] for r in rs)} / {max(r["peak_inflight_life"] for r in rs)}',
                fmt(med([r["proxy_hwm_mb"] for r in rs]), 1), fmt(med([r["proxy_cpu_us"] for r in rs]), 1),
            ])
    return rows


def render(runs, meta):
    conns = sorted({r["clients"] for r in runs})
    lines = [
        "oha, open loop: requests go out on a fixed schedule (`-q RATE`) whatever the answers do, and each one's "
        "latency counts from when the schedule made it due (`--latency-correction`), so time spent queued anywhere, "
        "in the proxy or waiting for one of oha's connections, is in it (no coordinated omission). oha gets "
        f"2 x rate x the worst latency expected connections, at most 1,000 (here: {', '.join(map(str, conns))}; the "
        "*clients* of the run) so it stays open-loop; **unsent** counts requests the schedule made that it never "
        "sent, and any above 0 mean it fell behind. The measured run waits for the requests in flight when the "
        "schedule ends, so every request of the window is counted; **2xx/s** is over oha's whole run (the window "
        "plus that drain). Latency per status code comes from oha's per-response record (`--db-url`): **2xx** are "
        "the served requests, **non-2xx** mostly the shed ones (503 from floodgate and HAProxy when the queue is "
        "full, 502 from nginx, which cannot queue). **offered** is the schedule's rate.",
    ]
    for part, cap, delay, rate in cases(runs):
        key = lambda r, k=(part, cap, delay, rate): case_of(r) == k
        sample = next(r for r in runs if key(r))
        capacity = cap * 1000 / delay if delay else None
        if part == 0:
            lines += ["", f"### Cost: {rate:,} req/s, N = {cap}, {delay} ms service time", ""]
            lines += [
                f"Far below capacity ({'N / service time = ' + fmt(capacity) + ' req/s' if capacity else 'no bound'}): "
                "what the proxy costs per response at a fixed rate, and its latency when nothing needs to queue. "
                f"Queue bound {sample['queue']}, queue timeout {sample.get('queue_timeout_s', '-')} s.", "",
            ]
        else:
            bound_ms = sample.get("queue_timeout_s", 0) * 1000 + delay
            lines += ["", f"### Overload: {fmt(rate)} req/s offered ({sample.get('factor', '?')} x capacity), "
                      f"N = {cap}, {delay} ms service time", ""]
            lines += [
                f"Capacity N / service time = {fmt(capacity)} 2xx/s. Queue bound {sample['queue']} (capacity x "
                f"{1000 * sample['queue'] / capacity:,.0f} ms), queue timeout {sample.get('queue_timeout_s', '-')} s, "
                "the same for floodgate and HAProxy, so that above capacity the excess is answered 503 at once "
                f"rather than after the timeout. Targets: 2xx/s >= 95 % of capacity ({fmt(0.95 * capacity)}), served "
                f"p99 <= queue timeout + service time ({fmt(bound_ms)} ms), shed p99 < 1 ms.", "",
            ]
        lines += markdown_table(HEAD, table_rows(runs, key))
    return lines


def target_layout(runs):
    return "shared" if any(r["layout"] == "shared" for r in runs) else (layouts(runs) or ["shared"])[0]


def targets(runs, meta):
    out = []
    layout = target_layout(runs)
    where = "" if layout == "shared" else f" ({layout} layout)"
    for part, cap, delay, rate in cases(runs):
        rbs = grouped(runs, lambda r, k=(part, cap, delay, rate): case_of(r) == k and r["layout"] == layout)
        if not rbs:
            continue
        if part == 0:
            for label, metric, digits, unit, band in (
                ("proxy CPU-µs per response", lambda r: r["proxy_cpu_us"], 1, " µs", NOISE_RATE),
                ("proxy RSS (peak)", lambda r: r["proxy_hwm_mb"], 1, " MB", NOISE_RATE),
                ("p99 of 2xx", lambda r: r["ok_lat"][1], 1, " ms", NOISE_P99),
            ):
                fs, fv = best(rbs, "floodgate", metric, higher=False)
                hs, hv = best(rbs, "haproxy", metric, higher=False)
                if fv is None:
                    continue
                kind = "Below capacity" if label.startswith("p99") else "Cost"
                out.append({
                    "target": f"{kind}, {rate:,} req/s, N = {cap}, {delay} ms{where}: {label} <= HAProxy's",
                    "floodgate": f"{fs}: {fmt(fv, digits)}{unit}",
                    "peer": f"{hs}: {fmt(hv, digits)}{unit}" if hv is not None else "-",
                    "verdict": compare(fv, hv, False, band),
                    "note": "",
                })
            continue
        capacity = cap * 1000 / delay
        if rate <= capacity:
            continue
        sample = next(r for r in runs if case_of(r) == (part, cap, delay, rate))
        bound_ms = sample.get("queue_timeout_s", 0) * 1000 + delay
        head = f"Overload, {fmt(rate)} req/s offered to N = {cap} x {delay} ms (capacity {fmt(capacity)}/s){where}"
        fs, fv = best(rbs, "floodgate", lambda r: r["ok_rate"])
        hs, hv = best(rbs, "haproxy", lambda r: r["ok_rate"])
        if fv is not None:
            out.append({
                "target": f"{head}: goodput (2xx/s) >= 95 % of capacity ({fmt(0.95 * capacity)})",
                "floodgate": f"{fs}: {fmt(fv)} ({100 * fv / capacity:.1f} %)",
                "peer": f"{hs}: {fmt(hv)} ({100 * hv / capacity:.1f} %)" if hv is not None else "-",
                "verdict": "met" if fv >= 0.95 * capacity else "gap",
                "note": "",
            })
        fs, fv = best(rbs, "floodgate", lambda r: r["ok_lat"][1], higher=False)
        hs, hv = best(rbs, "haproxy", lambda r: r["ok_lat"][1], higher=False)
        if fv is not None:
            out.append({
                "target": f"{head}: p99 of served (2xx) <= queue timeout + service time ({fmt(bound_ms)} ms)",
                "floodgate": f"{fs}: {fmt(fv, 1)} ms",
                "peer": f"{hs}: {fmt(hv, 1)} ms" if hv is not None else "-",
                "verdict": "met" if fv <= bound_ms else "gap",
                "note": "",
            })
        shed = lambda r: r["other_lat"].get(503, (None, None))[1]
        fs, fv = best(rbs, "floodgate", shed, higher=False)
        hs, hv = best(rbs, "haproxy", shed, higher=False)
        shed_any = any(503 in r["other"] for s, rs in rbs if s.startswith("floodgate") for r in rs)
        out.append({
            "target": f"{head}: p99 of shed answers (503) < 1 ms",
            "floodgate": f"{fs}: {fmt(fv, 2)} ms" if fv is not None else (
                "503 answers, but no latency per status" if shed_any else "no 503 answers"),
            "peer": f"{hs}: {fmt(hv, 2)} ms" if hv is not None else "-",
            "verdict": "n/a" if fv is None else ("met" if fv < 1 else "gap"),
            "note": "",
        })
    return out


def plot(runs, meta, ax):
    """p99 of the 2xx answers by subject at each open-loop case, shared layout (or the one there is)."""
    layout = target_layout(runs)
    these = [r for r in runs if r["layout"] == layout]
    keys = cases(these)
    subjects = [s for s, _ in grouped(these)]
    width = 0.8 / max(len(subjects), 1)
    for i, subject in enumerate(subjects):
        vals = []
        for k in keys:
            rs = [d for s, ds in grouped(these, lambda r, k=k: case_of(r) == k) if s == subject for d in ds]
            vals.append(med([r["ok_lat"][1] for r in rs]) or 0)
        ax.bar([k + i * width for k in range(len(keys))], vals, width, label=subject)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))])
    ax.set_xticklabels([f"{'cost' if p == 0 else 'overload'}\nN={c}, {d} ms\n{rate:,} req/s" for p, c, d, rate in keys],
                       fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("p99 of 2xx, ms (log)")
    ax.set_title(f"Open loop (oha, latency corrected): p99 of served requests ({layout} CPUs)")
    ax.legend(fontsize=7, ncol=2)
