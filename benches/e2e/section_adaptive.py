"""Section of docs/overload.md for the "adaptive" scenario (floodgate's adaptive concurrency limit against a static
cap above the upstream's knee); see report_common for the contract, scenarios/adaptive.sh for what a run is."""

from report_common import derive, fmt, markdown_table, med, med_of, ordered_groups, spread, times

TITLE = "Adaptive limit: settling near the upstream's knee"
DOC = "overload"

ORDER = ["static", "adaptive", "haproxy-knee", "haproxy-cap"]


def row(run):
    load, up, d = run["load"], run["upstream"], derive(run)
    half = run["duration_s"] / 2
    samples = load.get("samples") or []
    late = [s[1] for s in samples if s[0] >= half and s[1] is not None]
    in_use = [s[2] for s in samples if s[0] >= half and s[2] is not None]
    lm = med(late)
    # The climb: over the warm-up when it was sampled (the scenario's own, long enough to settle), else the window.
    climb = load.get("warmup_samples") or samples
    reached = next((s[0] for s in climb if s[1] is not None and lm is not None and s[1] >= lm - 1), None)
    first = climb[0][1] if climb else None
    return {
        "config": run["config"],
        "subject": run["subject"],
        "cap": run["cap"],
        "knee": run["knee"],
        "ok_rate": d["ok_rate"],
        "other": sum(d["other"].values()) + d["sock_err"],
        "p50": d["p50"],
        "p99": d["p99"],
        "peak": d["peak_inflight"],
        "svc_p50": up["service_p50_us"] / 1000 if up.get("service_p50_us") is not None else None,
        "svc_p99": up["service_p99_us"] / 1000 if up.get("service_p99_us") is not None else None,
        "limit_med": lm,
        "limit_first": first,
        "reached_s": reached,
        "limit_min": min(late) if late else None,
        "limit_max": max(late) if late else None,
        "in_use_med": med(in_use),
        "samples": len(samples),
        "late_samples": len(late),
    }



def describe(c, rows):
    x = rows[0]
    return {
        "static": f"floodgate, static cap {x['cap']} (`adaptive_limit = \"off\"`)",
        "adaptive": f"floodgate, cap {x['cap']}, `adaptive_limit = \"gradient\"`",
        "haproxy-knee": f"HAProxy, `maxconn {x['cap']}` (tuned to the knee by hand)",
        "haproxy-cap": f"HAProxy, `maxconn {x['cap']}` (untuned)",
    }.get(c, c)


def limit_text(rows):
    meds = [x["limit_med"] for x in rows if x["limit_med"] is not None]
    if not meds:
        return "-"
    lo = min(x["limit_min"] for x in rows if x["limit_min"] is not None)
    hi = max(x["limit_max"] for x in rows if x["limit_max"] is not None)
    return f"{fmt(med(meds), 1)} [{fmt(lo)}-{fmt(hi)}]"


def groups(runs):
    return ordered_groups([row(r) for r in runs], "config", ORDER)


def render(runs, meta):
    s = runs[0]
    knee, delay = s["knee"], s["delay_ms"]
    lines = [
        f"One upstream that does K = {knee} requests' work at a time (`bench_upstream --delay-ms {delay} --knee "
        f"{knee}`: a request that starts with n in flight takes {delay} ms x max(1, n / {knee}), so throughput stops "
        f"at K / {delay} ms = {fmt(knee * 1000 / delay)} req/s and past K in flight only latency grows), a cap of "
        f"{s['static_cap']} in front of it (well above K), and a closed loop of {s['clients']} wrk connections, so a "
        f"queue always stands (queue bound {s['queue']}, timeout {s['queue_timeout_s']} s). floodgate (`--threads "
        "1`) with the adaptive limit off and on (`adaptive_limit = \"gradient\"`, its other keys at their defaults: "
        "`min_connections` 1, `adaptive_window` 100 ms, tolerance 1.5, smoothing 0.2), HAProxy at `maxconn` K and "
        "at the same cap as references. floodgate's `/status` was read every "
        f"{s['sample_s']} s during the measured load; each run starts a fresh floodgate, so the adaptive limit "
        "starts from `min_connections` at the warm-up.",
        "",
        "Columns: **limit** the adaptive limit read from `/status` over the second half of the measured window, "
        "median of the runs' medians [lowest-highest reading]; **limit at start, settled after** its first reading "
        "under load and the seconds of load after which it first came within 1 of that median (medians over runs; "
        f"read over the warm-up, which runs the same load for {s.get('warmup_s', '-')} s so that the measured window "
        "sees the settled limit); **limit / K** that median over the knee; **upstream "
        "peak in flight** the upstream's own count (highest over runs); **upstream service p50 / p99** what its "
        "handlers took (the knee's slowdown), medians over runs; **2xx/s** median [min-max]; **client p50 / p99** "
        "wrk's; **vs static** this row's median over the static-cap floodgate run's.",
        "",
    ]
    gs = groups(runs)
    static = dict(gs).get("static")
    head = ["configuration", "runs", "limit (last half)", "limit at start, settled after", "limit / K", "upstream peak in flight",
            "upstream service p50 / p99 ms", "2xx/s", "not 2xx", "client p50 / p99 ms",
            "vs static: peak", "vs static: service p99", "vs static: 2xx/s", "vs static: client p50",
            "vs static: client p99"]
    table = []
    for c, rows in gs:
        lm = med([x["limit_med"] for x in rows if x["limit_med"] is not None])
        table.append([
            describe(c, rows), len(rows), limit_text(rows) if c == "adaptive" else "-",
            f"{fmt(med_of(rows, 'limit_first'))}, {fmt(med_of(rows, 'reached_s'), 1)} s" if c == "adaptive" else "-",
            times(lm, knee) if c == "adaptive" else "-",
            max(x["peak"] for x in rows),
            f"{fmt(med_of(rows, 'svc_p50'), 1)} / {fmt(med_of(rows, 'svc_p99'), 1)}",
            spread([x["ok_rate"] for x in rows]), fmt(med_of(rows, "other")),
            f"{fmt(med_of(rows, 'p50'), 1)} / {fmt(med_of(rows, 'p99'), 1)}",
            times(med_of(rows, "peak"), med_of(static, "peak")) if static else "-",
            times(med_of(rows, "svc_p99"), med_of(static, "svc_p99")) if static else "-",
            times(med_of(rows, "ok_rate"), med_of(static, "ok_rate")) if static else "-",
            times(med_of(rows, "p50"), med_of(static, "p50")) if static else "-",
            times(med_of(rows, "p99"), med_of(static, "p99")) if static else "-",
        ])
    lines += markdown_table(head, table)
    lines += [
        "",
        "**What this shows.** Past the knee the upstream's throughput does not grow, so every configuration serves "
        "about K / service time; what differs is where the excess waits. With a static cap above the knee it "
        "waits *inside the upstream* (every request there takes cap / K times the service time); with the adaptive "
        "limit floodgate finds the concurrency past which responses only slow down and keeps the excess in its own "
        "queue, so the upstream sees a few requests above K instead of the cap. The gradient's fixed point for "
        "this upstream is about tolerance x K + sqrt(limit) ([concepts.md](concepts.md), *Adaptive concurrency "
        "limit*), not K itself: "
        "it stops above the knee, so the upstream still holds more than K at a time. The clients of a closed loop "
        "see the same total wait either way (Little's law: clients / throughput), so client latency ratios near "
        "1x are expected; the gain is the upstream's: fewer requests in flight, shorter service times, and room "
        "for whatever else it serves. HAProxy at `maxconn` K is what a cap tuned by hand to the knee gives: fewer "
        "requests in flight and shorter service times than the adaptive limit's, at about the same goodput; the "
        "adaptive limit goes part of the way from the static cap towards it (the *vs static* columns) without "
        "anyone knowing K.",
        "",
        "**What limits it.** One upstream whose slowdown is exactly proportional past the knee, short windows, "
        "and no probe (`adaptive_probe_interval` is 30 s, longer than a run). Load generator, proxy "
        "and upstream share 2 CPUs; the sampler adds a `/status` and a `/metrics` request every "
        f"{s['sample_s']} s.",
    ]
    return lines


def headline(runs, meta):
    gs = dict(groups(runs))
    st, ad = gs.get("static"), gs.get("adaptive")
    if not st or not ad:
        return []
    s = runs[0]
    knee = s["knee"]
    lm = med([x["limit_med"] for x in ad if x["limit_med"] is not None])
    text = (
        f"**Adaptive limit**, an upstream with its knee at K = {knee} ({s['delay_ms']} ms, slower in proportion "
        f"past it) behind a cap of {s['static_cap']}, {s['clients']} closed-loop clients: the limit settled at "
        f"{limit_text(ad)} over the second half of the window ({times(lm, knee)} K; from "
        f"{fmt(med_of(ad, 'limit_first'))} under the first load, within 1 of it after {fmt(med_of(ad, 'reached_s'), 1)} s); "
        "the upstream's peak in flight "
        f"{fmt(med_of(ad, 'peak'))} against {fmt(med_of(st, 'peak'))} with the static cap "
        f"({times(med_of(ad, 'peak'), med_of(st, 'peak'))}), its service p99 {fmt(med_of(ad, 'svc_p99'), 1)} against "
        f"{fmt(med_of(st, 'svc_p99'), 1)} ms ({times(med_of(ad, 'svc_p99'), med_of(st, 'svc_p99'))}), at "
        f"{times(med_of(ad, 'ok_rate'), med_of(st, 'ok_rate'))} the goodput; client p50 "
        f"{times(med_of(ad, 'p50'), med_of(st, 'p50'))}, p99 {times(med_of(ad, 'p99'), med_of(st, 'p99'))} of the static cap's."
    )
    hk = gs.get("haproxy-knee")
    if hk:
        text += (f" HAProxy with `maxconn {hk[0]['cap']}` set to the knee by hand: upstream service p99 "
                 f"{fmt(med_of(hk, 'svc_p99'), 1)} ms, goodput {times(med_of(hk, 'ok_rate'), med_of(st, 'ok_rate'))}.")
    return [text]
