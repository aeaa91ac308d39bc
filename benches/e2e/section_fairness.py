"""Section of docs/overload.md for the "fairness" scenario (a greedy and a polite client, fair sharing off and on);
see report_common for the contract, scenarios/fairness.sh for what a run is."""

from report_common import fmt, markdown_table, med_of, ordered_groups, spread, times

TITLE = "Fair sharing: a greedy client beside a polite one"
DOC = "overload"

ORDER = ["off", "fair", "quota"]


def row(run):
    load = run["load"]
    greedy = load["greedy"]
    secs = max(load["duration_us"], 1) / 1e6
    gsecs = max(greedy["duration_us"], 1) / 1e6
    codes = {int(k): v for k, v in load["codes"].items()}
    gcodes = {int(k): v for k, v in greedy["codes"].items()}
    ok = sum(v for k, v in codes.items() if 200 <= k < 300)
    within = sum(v for k, v in (load.get("within") or {}).items() if 200 <= int(k) < 300)
    errors = sum(load.get(k, 0) for k in ("err_connect", "err_read", "err_write", "err_timeout", "err_deadline"))
    sent = load["requests"] + errors
    s200 = (load.get("by_status") or {}).get("200") or {}
    ms = lambda v: v / 1000 if v is not None else None
    gok = sum(v for k, v in gcodes.items() if 200 <= k < 300)
    outcomes = load.get("outcomes") or {}
    return {
        "config": run["config"],
        "fair_key": run["fair_key"],
        "fair_max_queue": run["fair_max_queue"],
        "polite_offered": run["polite_rate"],
        "polite_ok_share": ok / sent if sent else None,
        "polite_in_time_share": within / sent if sent else None,
        "polite_p50": ms(s200.get("p50_us")),
        "polite_p99": ms(s200.get("p99_us")),
        "polite_other": {k: v for k, v in codes.items() if not 200 <= k < 300},
        "greedy_ok_rate": gok / gsecs,
        "greedy_other_rate": (greedy["requests"] - gok) / gsecs,
        "greedy_other_codes": sorted(k for k in gcodes if not 200 <= k < 300),
        "quota_rate": outcomes.get("shed_quota", 0) / gsecs,
        "proxy_cores": (run["proxy_cpu_ticks"] or 0) / run["clk_tck"] / secs,
        "peak": max(run["upstream"]["peak_conns"], run["upstream_warmup"]["peak_conns"],
                    run["upstream"]["peak_inflight"], run["upstream_warmup"]["peak_inflight"]),
    }



def pct(v):
    return f"{fmt(100 * v, 1)} %" if v is not None else "-"


def describe(rows):
    x = rows[0]
    if not x["fair_key"]:
        return 'off (`fair_key = ""`)'
    text = f'`fair_key = "{x["fair_key"]}"`'
    if x["fair_max_queue"]:
        text += f', `fair_max_queue = {x["fair_max_queue"]}`'
    return text


def groups(runs):
    return ordered_groups([row(r) for r in runs], "config", ORDER)


def render(runs, meta):
    s = runs[0]
    cap, delay = s["cap"], s["delay_ms"]
    capacity = cap * 1000 / delay if delay else None
    lines = [
        f"One upstream at {delay} ms behind a cap of N = {cap} (capacity {fmt(capacity)} req/s), two clients "
        "started together for the same seconds: **greedy**, wrk in a closed loop on "
        f"{s['greedy_conns']} connections with `X-Api-Key: greedy` (so it always has about "
        f"{s['greedy_conns'] - cap} requests queued), and **polite**, oha in an open loop at "
        f"{s['polite_rate']} req/s with `X-Api-Key: polite` (`--latency-correction`). floodgate (`--threads 1`) "
        f"with queue bound {s['queue']} and queue timeout {s['queue_timeout_s']} s in every run; fair sharing off, "
        "on (a lane per `X-Api-Key`, served by deficit round robin), and on with a per-key queue bound "
        "(`fair_max_queue`, past which the key's requests get `429`, reason *quota*). The polite client sends no "
        "deadline, so floodgate serves all of its requests; **in time** is the share of the polite client's "
        f"requests answered 2xx within {s['polite_slo_ms']} ms, as an interactive client would want.",
        "",
        "Columns: **polite 2xx** and **in time** as shares of the requests it sent; **polite p50 / p99** of its "
        "served requests (corrected latency); **greedy 2xx/s** over wrk's run, median [min-max]; **greedy "
        "refused/s** its answers that were not 2xx (the quota's 429s); **proxy CPU** floodgate's user + system "
        "time over the run, in cores; **vs off** the ratio of this row's median to the run without fair sharing.",
        "",
    ]
    gs = groups(runs)
    off = dict(gs).get("off")
    head = ["fair sharing", "runs", "polite req/s", "polite 2xx", "polite in time", "polite p50 / p99 ms",
            "greedy 2xx/s", "greedy refused/s", "proxy CPU (cores)", "upstream peak", "vs off: polite p50",
            "vs off: polite p99", "vs off: greedy 2xx/s"]
    table = []
    for c, rows in gs:
        table.append([
            describe(rows), len(rows), fmt(rows[0]["polite_offered"]), pct(med_of(rows, "polite_ok_share")),
            pct(med_of(rows, "polite_in_time_share")),
            f"{fmt(med_of(rows, 'polite_p50'), 1)} / {fmt(med_of(rows, 'polite_p99'), 1)}",
            spread([x["greedy_ok_rate"] for x in rows]),
            fmt(med_of(rows, "greedy_other_rate")) + (
                f" ({', '.join(map(str, sorted({k for x in rows for k in x['greedy_other_codes']})))})"
                if any(x["greedy_other_codes"] for x in rows) else ""),
            fmt(med_of(rows, "proxy_cores"), 2), max(x["peak"] for x in rows),
            times(med_of(rows, "polite_p50"), med_of(off, "polite_p50")) if off else "-",
            times(med_of(rows, "polite_p99"), med_of(off, "polite_p99")) if off else "-",
            times(med_of(rows, "greedy_ok_rate"), med_of(off, "greedy_ok_rate")) if off else "-",
        ])
    lines += markdown_table(head, table)
    lines += [
        "",
        "**What this shows.** With one lane a polite request waits behind every greedy request queued before it "
        "(about greedy connections - N of them, at N / service time), so its latency is the greedy client's queue, "
        "however little it asks for. With a lane per key the polite request waits for the next free slot, its "
        "lane's turn coming before the greedy lane's next; the greedy client keeps the rest of the capacity (its "
        "2xx/s hardly move), only its place in line changes. The per-key bound turns the greedy client's excess "
        "into immediate 429s; a closed-loop client that resends at once then spins against the proxy, which costs "
        "CPU (see the proxy CPU column) while the polite client stays served.",
        "",
        "**What limits it.** Two keys only, one of them much smaller than capacity: with many keys of similar "
        "weight the wait of each is the number of active lanes times the service time, not one slot. The greedy "
        "client ignores `Retry-After`; a real one may back off, which changes the quota row's CPU. Load generators, "
        "proxy and upstream share 2 CPUs, so the quota row's spinning client also takes CPU from the others.",
    ]
    return lines


def headline(runs, meta):
    gs = dict(groups(runs))
    off, fair = gs.get("off"), gs.get("fair")
    if not off or not fair:
        return []
    s = runs[0]
    text = (
        f"**Fair sharing**, a greedy client ({s['greedy_conns']} connections, closed loop) beside a polite one "
        f"({s['polite_rate']} req/s) at N = {s['cap']}: the polite client's p50 {fmt(med_of(off, 'polite_p50'))} ms "
        f"without fair sharing, {fmt(med_of(fair, 'polite_p50'))} ms with `fair_key` "
        f"({times(med_of(fair, 'polite_p50'), med_of(off, 'polite_p50'))}); p99 {fmt(med_of(off, 'polite_p99'))} vs "
        f"{fmt(med_of(fair, 'polite_p99'))} ms ({times(med_of(fair, 'polite_p99'), med_of(off, 'polite_p99'))}); answered 2xx "
        f"within {s['polite_slo_ms']} ms {pct(med_of(off, 'polite_in_time_share'))} vs "
        f"{pct(med_of(fair, 'polite_in_time_share'))}; the greedy client's 2xx/s "
        f"{times(med_of(fair, 'greedy_ok_rate'), med_of(off, 'greedy_ok_rate'))} of what it got without."
    )
    q = gs.get("quota")
    if q:
        text += (
            f" With `fair_max_queue = {q[0]['fair_max_queue']}` the greedy client got "
            f"{fmt(med_of(q, 'greedy_other_rate'))} 429/s and floodgate used {fmt(med_of(q, 'proxy_cores'), 2)} cores "
            f"(without: {fmt(med_of(fair, 'proxy_cores'), 2)}); the polite p99 was {fmt(med_of(q, 'polite_p99'))} ms.")
    return [text]
