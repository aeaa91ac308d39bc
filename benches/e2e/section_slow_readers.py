"""Section of docs/overload.md for the "slow-readers" scenario (slow readers beside fast clients, response buffering
off and on); see report_common for the contract, scenarios/slow-readers.sh for what a run is."""

from report_common import derive, fmt, markdown_table, med, med_of, ordered_groups, spread, times

TITLE = "Slow readers: response buffering off and on"
DOC = "overload"

ORDER = ["off", "on"]
MIB = 1024 * 1024


def row(run):
    load, d = run["load"], derive(run)
    secs = max(load["duration_us"], 1) / 1e6
    samples = load.get("samples") or []
    buffered = [s[3] for s in samples if s[3] is not None]
    fallbacks = [s[4] for s in samples if len(s) > 4 and s[4] is not None]
    return {
        "config": run["config"],
        "m": run["slow_readers"],
        "buffer": run["buffer_response_bytes"],
        "max_buffered": run.get("max_buffered_bytes"),
        "ok_rate": d["ok_rate"],
        "other_rate": (sum(d["other"].values()) + d["sock_err"]) / secs,
        "other_codes": sorted(d["other"]),
        "p50": d["p50"],
        "p99": d["p99"],
        "held_before": load.get("held_before"),
        "in_use_med": med([s[1] for s in samples if s[1] is not None]),
        "peak_inflight": d["peak_inflight"],
        "peak_conns": d["peak_conns"],
        "buffered_med": med(buffered) / MIB if buffered else None,
        "buffered_max": max(buffered) / MIB if buffered else None,
        "fallbacks": max(fallbacks) if fallbacks else None,
        "rss": run["proxy_hwm_kb"] / 1024,
        "slow_read": (load.get("slow") or {}).get("bytes_read"),
    }


def groups(runs):
    """[(M, config, rows)]: M ascending, and within an M the configs in ORDER."""
    rows = [row(r) for r in runs]
    return [
        (mm, c, rs)
        for mm in sorted({x["m"] for x in rows})
        for c, rs in ordered_groups([x for x in rows if x["m"] == mm], "config", ORDER)
    ]


def describe(rows):
    x = rows[0]
    if not x["buffer"]:
        return "off (`buffer_response_bytes = 0`)"
    return f"on (`buffer_response_bytes = {x['buffer']}`, `max_buffered_bytes = {x['max_buffered']}`)"


def render(runs, meta):
    s = runs[0]
    cap, delay = s["cap"], s["delay_ms"]
    lines = [
        f"One upstream at {delay} ms behind a cap of N = {cap} (capacity {fmt(cap * 1000 / delay)} req/s), "
        f"answering `GET /` with {fmt(s['body_bytes'] / MIB, 0)} MiB and `GET /?bytes={s['fast_bytes']}` with "
        f"{s['fast_bytes']} bytes (`bench_upstream --body-bytes {s['body_bytes']}`). Per run, M slow readers "
        f"(`benches/e2e/slow_readers.py`: SO_RCVBUF {s['rcvbuf']} bytes, one `GET /` each, then at most "
        f"{s['read_rate']} bytes a second; a finished or refused answer is followed by the next request) connect "
        f"first; one second later a fast closed loop (wrk, {s['clients']} connections, the small body) runs the "
        "measured seconds beside them. floodgate (`--threads 1`, queue bound "
        f"{s['queue']}, queue timeout {s['queue_timeout_s']} s) with response buffering off and on, in turn.",
        "",
        "Why 4 MiB rather than a body within the default 64 KiB limit: on loopback Linux grows the proxy's send "
        "buffer towards a client that reads nothing up to `net.ipv4.tcp_wmem`'s maximum (4 MiB on this machine), "
        "so a smaller body leaves the proxy at once, buffering or not (by hand: 64 KiB, 256 KiB and 1 MiB bodies "
        "to 4 such readers held no slot with buffering off, `/status` `in_use` 0). A slow reader holds a slot only "
        "with a body larger than what the kernel takes; here the limit is raised above the body for the *on* run.",
        "",
        "Columns: **slots held by slow readers** `/status` `in_use` read just before the fast clients start "
        "(median over runs); **in use** its median while they ran; **upstream peak** the upstream's own peak "
        "requests in flight / connections; **buffered** `floodgate_buffered_bytes` median / highest reading "
        "during the load, MiB; **fallbacks** `floodgate_buffer_fallbacks_total`; **RSS** floodgate's VmHWM; "
        "**fast 2xx/s** median [min-max]; **not 2xx/s** the fast clients' other answers and socket errors; **fast "
        "p50 / p99** wrk's, over all its answers (where it got only 503s, theirs: the queue timeout); "
        "**on / off** the ratio of the buffered run's median to the unbuffered one's at the same M.",
        "",
    ]
    gs = groups(runs)
    by = {(mm, c): rows for mm, c, rows in gs}
    head = ["M slow readers", "buffering", "runs", "slots held by slow readers", "in use (median)",
            "upstream peak in flight / conns", "buffered MiB (median / max)", "fallbacks", "floodgate RSS MB",
            "fast 2xx/s", "fast not 2xx/s", "fast p50 / p99 ms", "on / off: 2xx/s", "on / off: p50",
            "on / off: p99"]
    table = []
    for mm, c, rows in gs:
        off = by.get((mm, "off"))
        is_on = c == "on" and off
        table.append([
            mm, describe(rows), len(rows), fmt(med_of(rows, "held_before")), fmt(med_of(rows, "in_use_med")),
            f"{max(x['peak_inflight'] for x in rows)} / {max(x['peak_conns'] for x in rows)}",
            f"{fmt(med_of(rows, 'buffered_med'), 1)} / {fmt(max((x['buffered_max'] or 0) for x in rows), 1)}",
            fmt(med_of(rows, "fallbacks")), fmt(med_of(rows, "rss"), 1),
            spread([x["ok_rate"] for x in rows]),
            fmt(med_of(rows, "other_rate")) + (
                f" ({', '.join(map(str, sorted({k for x in rows for k in x['other_codes']})))})"
                if any(x["other_codes"] for x in rows) else ""),
            f"{fmt(med_of(rows, 'p50'), 1)} / {fmt(med_of(rows, 'p99'), 1)}",
            times(med_of(rows, "ok_rate"), med_of(off, "ok_rate")) if is_on else "-",
            times(med_of(rows, "p50"), med_of(off, "p50")) if is_on else "-",
            times(med_of(rows, "p99"), med_of(off, "p99")) if is_on else "-",
        ])
    lines += markdown_table(head, table)
    lines += [
        "",
        "**What this shows.** Without buffering a slow reader's request keeps its upstream slot until the proxy "
        "has passed the body's last byte on, which a client reading a few bytes a second does not take within the "
        "run: M readers hold min(M, N) slots and the fast clients share what is left (none at M >= N: they wait "
        "in the queue until its timeout). With buffering the body is read from the upstream at its own speed, the "
        "slot goes back at once and the reader is fed from memory; the fast clients get the whole cap, and the "
        "price is the buffered bytes in floodgate's memory (bounded by `max_buffered_bytes`; a body that does not "
        "fit streams and holds its slot as before, counted as a fallback).",
        "",
        "**What limits it.** The readers here never finish within a run; real slow clients do, and hold a slot "
        "(without buffering) for as long as their body takes to cross their link, so the share they take is "
        "their number times that time. On this stand the kernel's send buffer already takes bodies below about "
        "4 MiB, so the default 64 KiB limit changes nothing here; how far the send buffer grows towards a slow "
        "client on a real network, and so which bodies buffering decides for there, was not measured. Buffering "
        "costs memory in proportion: the *on* rows' RSS. Load generators, proxy and upstream share 2 CPUs.",
    ]
    return lines


def headline(runs, meta):
    gs = groups(runs)
    by = {(mm, c): rows for mm, c, rows in gs}
    parts = []
    for mm in sorted({mm for mm, _, _ in gs}):
        off, on = by.get((mm, "off")), by.get((mm, "on"))
        if not off or not on:
            continue
        parts.append(
            f"with {mm} slow readers the fast clients got {fmt(med_of(off, 'ok_rate'))} 2xx/s without buffering and "
            f"{fmt(med_of(on, 'ok_rate'))} with it ("
            + (times(med_of(on, 'ok_rate'), med_of(off, 'ok_rate')) if med_of(off, 'ok_rate') else "none at all without: every "
               "fast request waited out the queue timeout") + "), p50 "
            f"{fmt(med_of(off, 'p50'), 1)} vs {fmt(med_of(on, 'p50'), 1)} ms ({times(med_of(on, 'p50'), med_of(off, 'p50'))}), p99 "
            f"{fmt(med_of(off, 'p99'), 1)} vs {fmt(med_of(on, 'p99'), 1)} ms ({times(med_of(on, 'p99'), med_of(off, 'p99'))}); the "
            f"slow readers held {fmt(med_of(off, 'held_before'))} vs {fmt(med_of(on, 'held_before'))} slots, floodgate "
            f"buffered {fmt(med_of(on, 'buffered_med'), 1)} MiB (RSS {fmt(med_of(on, 'rss'), 1)} vs {fmt(med_of(off, 'rss'), 1)} MB)")
    if not parts:
        return []
    s = runs[0]
    return [
        f"**Slow readers**, a {fmt(s['body_bytes'] / MIB, 0)} MiB body read at {s['read_rate']} bytes/s beside "
        f"a fast closed loop ({s['clients']} connections) at N = {s['cap']}, {s['delay_ms']} ms: "
        + "; ".join(parts) + "."
    ]
