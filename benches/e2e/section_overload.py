"""Section of docs/overload.md for the "overload" scenario (queue disciplines under open-loop overload, clients with
a deadline); see report_common for the contract, scenarios/overload.sh for what a run is."""

from report_common import fmt, markdown_table, med, spread, med_of, times, ordered_groups

TITLE = "Queue disciplines at overload: FIFO, adaptive LIFO, CoDel"
DOC = "overload"

LABEL = {"fifo": "FIFO", "adaptive-lifo": "adaptive LIFO", "codel": "CoDel", "haproxy": "HAProxy (FIFO + timeout)"}
ORDER = ["fifo", "adaptive-lifo", "codel"]
REASONS = ["shed_queue_full", "shed_queue_timeout", "shed_overload", "shed_deadline"]


def row(run):
    """One run's figures."""
    load = run["load"]
    secs = max(load["duration_us"], 1) / 1e6
    codes = {int(k): v for k, v in load["codes"].items()}
    ok = sum(v for k, v in codes.items() if 200 <= k < 300)
    within = sum(v for k, v in (load.get("within") or {}).items() if 200 <= int(k) < 300)
    offered = run["rate"] * load.get("window_us", run["duration_s"] * 1e6) / 1e6
    s200 = (load.get("by_status") or {}).get("200") or {}
    ms = lambda v: v / 1000 if v is not None else None
    errors = sum(load.get(k, 0) for k in ("err_connect", "err_read", "err_write", "err_timeout", "err_deadline"))
    outcomes = load.get("outcomes") or {}
    if outcomes:
        shed = {k: outcomes.get(k, 0) for k in REASONS}
    else:  # not floodgate: its non-2xx answers by status code
        shed = {f"{k}": v for k, v in sorted(codes.items()) if not 200 <= k < 300}
    return {
        "discipline": run.get("discipline", run["subject"]),
        "subject": run["subject"],
        "offered_rate": run["rate"],
        "ok_rate": ok / secs,
        "in_time_rate": within / secs,
        "in_time_share": within / ok if ok else None,
        "in_time_of_offered": within / offered if offered else None,
        "p50": ms(s200.get("p50_us")),
        "p99": ms(s200.get("p99_us")),
        "p999": ms(s200.get("p999_us")),
        "responses": load["requests"],
        "shed": shed,
        "errors": errors,
        "unsent": load.get("unsent") or 0,
        "peak": max(run["upstream"]["peak_conns"], run["upstream_warmup"]["peak_conns"],
                    run["upstream"]["peak_inflight"], run["upstream_warmup"]["peak_inflight"]),
    }


def threads(runs):
    subjects = sorted({r["subject"] for r in runs if r["subject"].startswith("floodgate-")})
    return ", ".join(f"`--threads {s.split('-')[1]}`" for s in subjects)


def factors(runs):
    return sorted({r["factor"] for r in runs})


def groups(runs, factor):
    """[(discipline, [rows])] at one factor: floodgate's disciplines in ORDER, then the reference subjects."""
    return ordered_groups([row(r) for r in runs if r["factor"] == factor], "discipline", ORDER)


def pct(v):
    return f"{100 * v:.1f} %" if v is not None else "-"



def shed_text(rows):
    keys = sorted({k for x in rows for k in x["shed"]}, key=lambda k: (REASONS + [k]).index(k))
    parts = []
    for k in keys:
        share = med([100 * x["shed"].get(k, 0) / max(x["responses"], 1) for x in rows])
        if share:
            parts.append(f"{k.replace('shed_', '')} {share:.1f} %")
    return ", ".join(parts) or "0"



def render(runs, meta):
    sample = runs[0]
    cap, delay, capacity = sample["cap"], sample["delay_ms"], sample["capacity"]
    deadline = sample.get("deadline_ms") or 0
    lines = [
        f"One upstream at {delay} ms service time behind a cap of N = {cap}: capacity N / service time = "
        f"{fmt(capacity)} req/s. oha sends a fixed schedule at each multiple of that capacity (open loop, "
        "`-q RATE --latency-correction`: a request's latency counts from when the schedule made it due, so time "
        "queued anywhere is in it), every request with "
        + (f"`X-Request-Timeout: {deadline}`, the client's deadline: floodgate sheds a request that cannot start "
           "before it runs out with `504` (reason *deadline*) instead of serving a client that has given up. "
           if deadline else "no deadline header. ")
        + f"floodgate ({threads(runs)}) runs once per `queue_discipline`, with the same queue bound "
        f"({sample['queue']}) and queue timeout ({sample['queue_timeout_s']} s) in every run and CoDel's "
        "`codel_target` and `codel_interval` at their defaults (5 ms, 100 ms). HAProxy, where it ran, is the "
        "reference for a FIFO queue with a timeout (`timeout queue`, the same bound; it reads no deadline header "
        "and has no LIFO or CoDel).",
        "",
        "Columns: **served 2xx/s**, median [min-max] over the repetitions, over oha's whole run (the schedule's "
        "window plus the drain of what was queued at its end); **p50 / p99 / p99.9** of the served (2xx) "
        "requests' corrected latency; **in time** the served requests whose latency was within the client's "
        f"deadline ({deadline} ms), as a share of those served and of all offered (at k x capacity at most "
        "1/k can be); **in-time 2xx/s** the goodput a client with that deadline sees; **shed** the answers that "
        "were not served, by floodgate's reason (`floodgate_requests_total` by outcome over the measured load) "
        "or, for HAProxy, by status, as a share of all answers; **vs FIFO** the ratio of this row's median to "
        "FIFO's in the same run: served p99, and in-time 2xx/s.",
    ]
    head = ["discipline", "runs", "offered req/s", "served 2xx/s", "p50 / p99 / p99.9 ms", "in time (of served)",
            "in time (of offered)", "in-time 2xx/s", "shed (share of answers)", "socket errors, unsent",
            "upstream peak", "vs FIFO: p99", "vs FIFO: in-time 2xx/s"]
    for factor in factors(runs):
        gs = groups(runs, factor)
        rate = gs[0][1][0]["offered_rate"]
        fifo = dict(gs).get("fifo")
        lines += ["", f"### {fmt(rate)} req/s offered: {factor:g} x capacity", ""]
        table = []
        for d, rows in gs:
            table.append([
                LABEL.get(d, d), len(rows), fmt(rate), spread([x["ok_rate"] for x in rows]),
                " / ".join(fmt(med_of(rows, k), 1) for k in ("p50", "p99", "p999")),
                f"{fmt(100 * (med_of(rows, 'in_time_share') or 0), 1)} %",
                f"{fmt(100 * (med_of(rows, 'in_time_of_offered') or 0), 1)} %",
                fmt(med_of(rows, "in_time_rate")), shed_text(rows),
                f"{fmt(med_of(rows, 'errors'))}, {fmt(max(x['unsent'] for x in rows))}",
                max(x["peak"] for x in rows),
                times(med_of(rows, "p99"), med_of(fifo, "p99")) if fifo else "-",
                times(med_of(rows, "in_time_rate"), med_of(fifo, "in_time_rate")) if fifo else "-",
            ])
        lines += markdown_table(head, table)
    lines += [
        "",
        "**What this shows.** Below capacity the discipline hardly matters: the queue is rarely non-empty. Past "
        "it, a FIFO queue fills until the oldest request has waited as long as the client allows, and from then "
        "on every request served has waited nearly that long. floodgate sheds a request that cannot *start* "
        "before its deadline; one that starts just before it ends a service time later, just after it, so under "
        "FIFO most served requests arrive too late to be of use (*in time (of served)*), and HAProxy, which reads "
        "no deadline, serves them after up to its queue timeout. Adaptive LIFO serves the newest first once the "
        "queue has stood for `codel_interval`: the served requests are fresh and the old ones are the ones the "
        "deadline sheds, so the same upstream work arrives in time. CoDel sheds, while every request of an "
        "interval waited over `codel_target`, those that waited over twice it: the queue stays short and served "
        "latency low. Both pay for it near capacity, where a queue stands only now and then: they shed a small "
        "share that FIFO would still have served in time (*in time (of offered)* at 1x).",
        "",
        "**What limits it.** One upstream with a fixed service time and one schedule with even spacing: real "
        "arrivals are burstier and real services vary, which makes queues stand sooner (and the disciplines matter "
        "earlier). The runs are a few seconds each, so the first `codel_interval` of every run (FIFO order for "
        "adaptive LIFO, no shedding for CoDel) and the drain at the end weigh more than they would in a long "
        "episode. The deadline is the same for every client; with mixed deadlines FIFO's loss would be spread "
        "differently. Served 2xx/s includes the drain after the schedule ends, which is longer for a discipline "
        "that keeps a longer queue.",
    ]
    return lines


def headline(runs, meta):
    """One line for docs/overload.md's headline, which docs/testing.md quotes: the largest factor, each discipline
    against FIFO."""
    top = max(factors(runs))
    gs = dict(groups(runs, top))
    fifo = gs.get("fifo")
    if not fifo:
        return []
    sample = next(r for r in runs if r["factor"] == top)
    parts = []
    for d in ORDER[1:]:
        rows = gs.get(d)
        if not rows:
            continue
        parts.append(
            f"{LABEL[d]} {fmt(med_of(rows, 'p99'))} ms ({times(med_of(rows, 'p99'), med_of(fifo, 'p99'))}), "
            f"{fmt(100 * med_of(rows, 'in_time_of_offered'))} % of offered in time "
            f"({times(med_of(rows, 'in_time_rate'), med_of(fifo, 'in_time_rate'))} FIFO's in-time goodput)")
    ref = ""
    if "haproxy" in gs:
        h = gs["haproxy"]
        ref = (f"; HAProxy's FIFO with `timeout queue`, which reads no deadline: p99 {fmt(med_of(h, 'p99'))} ms, "
               f"{fmt(100 * med_of(h, 'in_time_of_offered'))} % in time")
    low = []
    for f in [f for f in factors(runs) if f < top]:
        g = dict(groups(runs, f))
        if "fifo" not in g:
            continue
        low.append(f"at {f:g}x FIFO's p99 {fmt(med_of(g['fifo'], 'p99'))} ms, {pct(med_of(g['fifo'], 'in_time_of_offered'))} "
                   "of offered in time; " + ", ".join(
                       f"{LABEL[d]} {times(med_of(g[d], 'p99'), med_of(g['fifo'], 'p99'))} that p99, "
                       f"{pct(med_of(g[d], 'in_time_of_offered'))} in time" for d in ORDER[1:] if d in g))
    lines = [
        f"**Disciplines at {top:g}x overload** ({fmt(sample['rate'])} req/s offered to {fmt(sample['capacity'])}/s "
        f"of capacity, clients with a {sample.get('deadline_ms')} ms deadline): served p99 FIFO "
        f"{fmt(med_of(fifo, 'p99'))} ms with {fmt(100 * med_of(fifo, 'in_time_of_offered'))} % of offered requests answered "
        f"in time; " + "; ".join(parts) + ref + ". Served 2xx/s: " + ", ".join(
            f"{LABEL.get(d, d)} {fmt(med_of(rs, 'ok_rate'))}" for d, rs in gs.items()) + "."
    ]
    if low:
        lines.append("**At less overload** (the same run; what a proxy really serves is 95-98 % of N / service time in "
                     "docs/benchmarks.md's closed loop, so 1x is already slightly over it): " + "; ".join(low) + ".")
    return lines
