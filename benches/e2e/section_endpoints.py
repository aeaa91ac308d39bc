"""Section of docs/overload.md for the "endpoints" scenario (two endpoints, one killed halfway, passive ejection on
and off); see report_common for the contract, scenarios/endpoints.sh for what a run is."""

from report_common import fmt, markdown_table, med_of, ordered_groups, spread, times

TITLE = "Several endpoints: one killed under load, passive ejection on and off"
DOC = "overload"

ORDER = ["on", "off"]


def shrink(load):
    """Seconds from the kill to the first /status reading with a lower max_connections than before it, and that
    cap; (None, None) when it never fell."""
    kill, samples = load["kill_s"], load.get("samples") or []
    before = [s[1] for s in samples if s[0] < kill and s[1] is not None]
    if not before:
        return None, None
    for s in samples:
        if s[0] >= kill and s[1] is not None and s[1] < before[-1]:
            return s[0] - kill, s[1]
    return None, None


def row(run):
    load = run["load"]
    w = load["windows"]
    secs = max(load["duration_us"], 1) / 1e6
    ok = sum(v for k, v in load["codes"].items() if 200 <= int(k) < 300)
    shrink_s, cap_after = shrink(load)
    cpu_s = run["proxy_cpu_ticks"] / run["clk_tck"] if run["proxy_cpu_ticks"] is not None else None
    return {
        "config": run["config"],
        "eject_after": run["eject_after"],
        "ok_rate": ok / secs,
        "not_ok": load["requests"] - ok + load.get("err_read", 0),
        "not_ok_after": w["after"]["not_2xx"],
        "not_ok_2s": w["kill_2s"]["not_2xx"],
        "codes_after": w["after"]["codes"],
        "ok_2s": w["kill_2s"]["ok"],
        "p99_before": w["before"]["p99_ms"],
        "p99_2s": w["kill_2s"]["p99_ms"],
        "ok_p99_2s": w["kill_2s"]["ok_p99_ms"],
        "ok_p99_after": w["after"]["ok_p99_ms"],
        "shrink_ms": shrink_s * 1000 if shrink_s is not None else None,
        "cap_after": cap_after,
        "cpu_ms_per_s": 1000 * cpu_s / secs if cpu_s is not None else None,
        "second_served": load.get("second_served"),
        "kill_s": load["kill_s"],
    }


def groups(runs):
    return ordered_groups([row(r) for r in runs], "config", ORDER)


def render(runs, meta):
    s = runs[0]
    delay, each, clients = s["delay_ms"], s["cap_each"], s["clients"]
    lines = [
        f"One upstream of two endpoints (two `bench_upstream --delay-ms {delay}` processes), each with "
        f"`max_connections = {each}`, the upstream's cap their sum ({s['cap']}; capacity "
        f"{fmt(s['cap'] * 1000 / delay)} req/s, half that on one endpoint), queue {s['queue']}, queue timeout "
        f"{s['queue_timeout_s']} s. A closed loop of {clients} oha connections runs {s['duration_s']} s; halfway "
        "through, the second endpoint is killed (SIGKILL: its open connections break, new dials are refused). "
        "floodgate-1 gets the endpoints from a TOML file the scenario writes (`--config`; lib.sh's "
        "`floodgate_config_fn`), with `eject_after = 3` (on, the default; `eject_backoff` 1 s) and `eject_after = "
        "0` (off), in turn. `benches/e2e/sample_admin.py` reads `/status` every 0.05 s.",
        "",
        "Columns: **2xx/s** over the window; **not 2xx** answers other than 2xx (and oha's socket errors) over the "
        "window, and from the kill on (their codes); **p99 before** all answers before the kill; **2 s after the "
        "kill**: p99 of all answers and of the 2xx, the 2xx count; **cap shrank by** the time from the kill to "
        "the first `/status` reading whose `max_connections` (the cap in force) was lower, and that cap: an upper "
        "bound, since readings are 0.05 s apart (a small figure means the first reading after the kill already "
        "showed it); **CPU** floodgate's over the window. Windows around the kill start "
        "0.25 s before it: the kill's time is taken from the wall clock and oha's own clock starts a little later. "
        "**on / off** ratios of medians over the repetitions.",
        "",
    ]
    gs = groups(runs)
    off = dict(gs).get("off")
    head = ["passive ejection", "runs", "2xx/s", "not 2xx (window)", "not 2xx from the kill (codes)",
            "p99 before ms", "2 s after the kill: p99 all / 2xx ms", "2xx in those 2 s", "cap shrank by ms (to)",
            "floodgate CPU ms/s", "on / off: not 2xx", "on / off: 2xx p99 after", "on / off: CPU"]
    table = []
    for name, rows in gs:
        vs = name == "on" and off
        codes = sorted({c for x in rows for c in x["codes_after"] if not 200 <= int(c) < 300})
        shrunk = [x["shrink_ms"] for x in rows if x["shrink_ms"] is not None]
        table.append([
            f"{name} (`eject_after = {rows[0]['eject_after']}`)", len(rows), spread([x["ok_rate"] for x in rows]),
            spread([x["not_ok"] for x in rows]),
            fmt(med_of(rows, "not_ok_after")) + (f" ({', '.join(codes)})" if codes else ""),
            fmt(med_of(rows, "p99_before"), 1),
            f"{fmt(med_of(rows, 'p99_2s'), 1)} / {fmt(med_of(rows, 'ok_p99_2s'), 1)}",
            fmt(med_of(rows, "ok_2s")),
            (f"{spread(shrunk)} (to {fmt(med_of(rows, 'cap_after'))})" if shrunk else "never")
            + (f", {len(shrunk)} of {len(rows)} runs" if shrunk and len(shrunk) < len(rows) else ""),
            fmt(med_of(rows, "cpu_ms_per_s")),
            times(med_of(rows, "not_ok"), med_of(off, "not_ok")) if vs else "-",
            times(med_of(rows, "ok_p99_after"), med_of(off, "ok_p99_after")) if vs else "-",
            times(med_of(rows, "cpu_ms_per_s"), med_of(off, "cpu_ms_per_s")) if vs else "-",
        ])
    lines += markdown_table(head, table)
    lines += [
        "",
        "**What this shows.** With ejection on, the first failed dials to the dead endpoint are retried on the "
        "live one, the third in a row ejects it, and the cap in force falls to the live endpoint's: requests wait "
        "in the queue for its slots instead of being sent to the dead one, so the clients see slower answers (half "
        "the capacity) but no failures. With ejection off the dead endpoint keeps its share of the cap; while the "
        "live one is full, a request's only room is a dial to the dead one, which fails, and after its attempts it "
        "is answered `502` within milliseconds. A closed loop turns those fast failures into a flood of them: the "
        "clients' requests per second grow, and floodgate's CPU with them, while the 2xx stay what the live "
        "endpoint serves. The 2xx are faster without ejection only because the clients bounced with a `502` are not "
        "waiting in the queue in front of them: the same throughput with fewer requests queued.",
        "",
        "**What limits it.** A crash on loopback refuses dials at once; a host that vanishes on a real network "
        "makes dials wait for `connect_timeout` instead, which this run does not show. Active health checks "
        "(`health_check_path`) were off. The ejection's backoff (1 s, doubled while dials keep failing) means the "
        "dead endpoint is tried again now and then; each probe that fails is retried on the live one. One run per "
        "configuration per repetition, a few seconds each: the time to shrink is within the 0.05 s sampling. The "
        "requests in flight on the killed endpoint at the kill (up to its 4) did not show up as failures in any run; "
        "how floodgate answered them (retried elsewhere, or they had just finished) was not looked into.",
    ]
    return lines


def headline(runs, meta):
    by = dict(groups(runs))
    on, off = by.get("on"), by.get("off")
    if not on or not off:
        return []
    s = runs[0]
    shrunk = [x["shrink_ms"] for x in on if x["shrink_ms"] is not None]
    return [
        f"**Endpoints**, one of two killed halfway through a closed loop ({s['clients']} connections, "
        f"{s['cap_each']} + {s['cap_each']} slots): with passive ejection (`eject_after = 3`) "
        f"{fmt(med_of(on, 'not_ok'))} requests failed and the cap in force fell to "
        f"{fmt(med_of(on, 'cap_after'))} by the first `/status` reading after the kill (within "
        f"{fmt(max(shrunk) if shrunk else None)} ms); without it (`eject_after = 0`) "
        f"{fmt(med_of(off, 'not_ok'))} failed (fast `502`s, a closed loop re-sending them), the cap never shrank and "
        f"floodgate used {times(med_of(off, 'cpu_ms_per_s'), med_of(on, 'cpu_ms_per_s'))} the CPU; the 2xx p99 after the kill was "
        f"{fmt(med_of(on, 'ok_p99_after'), 1)} vs {fmt(med_of(off, 'ok_p99_after'), 1)} ms "
        f"({times(med_of(on, 'ok_p99_after'), med_of(off, 'ok_p99_after'))}: half the capacity, and nobody bounced "
        f"out of the queue), at "
        f"{times(med_of(on, 'ok_rate'), med_of(off, 'ok_rate'))} the 2xx/s."
    ]
