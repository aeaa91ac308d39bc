"""Section of docs/overload.md for the "retry-after" scenario (clients retrying shed requests at once or after
Retry-After); see report_common for the contract, scenarios/retry-after.sh for what a run is."""

from report_common import fmt, markdown_table, med, med_of, ordered_groups, spread, times

TITLE = "Retrying clients: at once or after Retry-After"
DOC = "overload"

ORDER = ["immediate", "honour"]


def row(run):
    load = run["load"]
    jobs, whole = load["jobs"], load["all"]
    # The nominal length of the load (deadline + window + deadline): the client's own elapsed time can run past it
    # while the last counted jobs end, with almost no load left then.
    secs = 2 * run["deadline_s"] + run["duration_s"]
    served = run["upstream"]["served"]
    cpu_s = run["proxy_cpu_ticks"] / run["clk_tck"] if run["proxy_cpu_ticks"] is not None else None
    seen = sorted(int(k) for k, n in jobs["retry_after"].items() for _ in range(n))
    return {
        "config": run["config"],
        "goodput": served / secs,
        "elapsed": whole["seconds"],
        "attempt_rate": whole["attempts"] / secs,
        "served_share": 100 * jobs["served"] / max(jobs["started"], 1),
        "attempts_per_served": jobs["attempts"] / jobs["served"] if jobs["served"] else None,
        "cpu_ms_per_s": 1000 * cpu_s / secs if cpu_s is not None else None,
        "cpu_us_per_ok": 1e6 * cpu_s / served if cpu_s is not None and served else None,
        "ra_med": med(seen),
        "ra_min": seen[0] if seen else None,
        "ra_max": seen[-1] if seen else None,
        "p50": load["p50_us"] / 1000 if load["p50_us"] is not None else None,
        "p99": load["p99_us"] / 1000 if load["p99_us"] is not None else None,
        "reasons": jobs["reasons"],
        "started": jobs["started"],
    }


def groups(runs):
    return ordered_groups([row(r) for r in runs], "config", ORDER)


def describe(name, s):
    if name == "immediate":
        return "immediate (retries at once)"
    return f"honour (sleeps Retry-After x U[1, {1 + s['jitter']:g}])"


def render(runs, meta):
    s = runs[0]
    cap, delay = s["cap"], s["delay_ms"]
    lines = [
        f"One upstream at {delay} ms behind a cap of N = {cap} (capacity {fmt(cap * 1000 / delay)} req/s) and a "
        f"small queue ({s['queue']}, queue timeout {s['queue_timeout_s']} s), so that floodgate sheds with `503`, "
        "`X-Floodgate-Shed-Reason: queue_full` and `Retry-After`. The load is `benches/e2e/retry_client.py`: new "
        f"jobs (logical requests) at {fmt(s['rate'])} /s ({s['factor']:g}x capacity), each `GET /` on a new "
        "connection, retried on anything but a 2xx, up to "
        f"{s['attempts']} attempts within {s['deadline_s']:g} s of the job's start; one population per run, run in "
        f"turn: **immediate** retries at once, **honour** sleeps `Retry-After` times a factor drawn from [1, "
        f"{1 + s['jitter']:g}] first and gives up when that sleep would end past the deadline. The load lasts "
        f"{s['deadline_s']:g} + {s['duration_s']} + {s['deadline_s']:g} s; the jobs counted are those started in the "
        "middle seconds (the retrying population has built up by then, and new jobs keep arriving until each "
        "counted one has ended).",
        "",
        "Columns: **goodput** the upstream's own count of requests served, per second of the nominal length of the "
        "load; **attempts/s** what the clients sent, over the same; **served** the "
        "share of counted jobs that got a 2xx at all; **attempts per served job** the counted jobs' attempts over "
        "their 2xx (the load a served request costs, shed attempts included); **floodgate CPU** over the client's whole "
        "run (`/proc/PID/stat`), per second of the nominal load and per request served; **Retry-After seen** median [min-max] over every shed answer; "
        "**job p50 / p99** a served job's time from its start to its 2xx, retries and sleeps included; "
        "**honour / immediate** ratios of medians over the repetitions.",
        "",
    ]
    gs = groups(runs)
    by = dict(gs)
    imm = by.get("immediate")
    head = ["population", "runs", "goodput 2xx/s", "attempts/s", "served %", "attempts per served job",
            "floodgate CPU ms/s", "CPU µs per 2xx", "Retry-After seen s", "job p50 / p99 ms", "shed reasons",
            "honour / immediate: goodput", "served", "attempts per served", "CPU"]
    table = []
    for name, rows in gs:
        vs = name == "honour" and imm
        reasons = sorted({k for x in rows for k in x["reasons"]})
        table.append([
            describe(name, s), len(rows), spread([x["goodput"] for x in rows]), fmt(med_of(rows, "attempt_rate")),
            fmt(med_of(rows, "served_share"), 1), fmt(med_of(rows, "attempts_per_served"), 2),
            fmt(med_of(rows, "cpu_ms_per_s")), fmt(med_of(rows, "cpu_us_per_ok")),
            f"{fmt(med_of(rows, 'ra_med'))} [{fmt(min((x['ra_min'] for x in rows if x['ra_min'] is not None), default=None))}-"
            f"{fmt(max((x['ra_max'] for x in rows if x['ra_max'] is not None), default=None))}]",
            f"{fmt(med_of(rows, 'p50'))} / {fmt(med_of(rows, 'p99'))}",
            ", ".join(reasons) or "-",
            times(med_of(rows, "goodput"), med_of(imm, "goodput")) if vs else "-",
            times(med_of(rows, "served_share"), med_of(imm, "served_share")) if vs else "-",
            times(med_of(rows, "attempts_per_served"), med_of(imm, "attempts_per_served")) if vs else "-",
            times(med_of(rows, "cpu_ms_per_s"), med_of(imm, "cpu_ms_per_s")) if vs else "-",
        ])
    lines += markdown_table(head, table)
    el = [x["elapsed"] for _, rows in gs for x in rows]
    lines += [
        "",
        f"The client's own elapsed time per run was {fmt(min(el), 1)}-{fmt(max(el), 1)} s against "
        f"{fmt(2 * s['deadline_s'] + s['duration_s'], 1)} s nominal: in some runs the last counted jobs ended up to "
        "1.5 s after the arrivals stopped (not explained yet; with no load left then it adds nothing to the rates "
        "above, which are over the nominal length).",
        "",
        "**What this shows.** Under sustained overload the upstream's capacity, not the clients' manners, bounds "
        "what is served: both populations get the same goodput and the same share of their jobs served (about "
        "capacity / arrival rate). What `Retry-After` changes is the cost of the refusals: clients that wait before "
        "trying again send fewer attempts per served request, and floodgate spends less CPU refusing them. The "
        "price is their latency: a served job that was shed once has slept at least `Retry-After` (whole seconds, "
        "at least 1) first.",
        "",
        "**What limits it.** Here `Retry-After` is always the floor of 1 s: it is the drain time of the queue "
        "ahead, rounded up to whole seconds, and a queue of 4 at this service time drains in tens of "
        "milliseconds, so the clients are told to wait far longer than the queue needs; a longer queue or a slower "
        "upstream would give larger values, which this run does not show. One new connection per attempt "
        "(`Connection: close`) makes each refusal cost an accept and a handshake; keep-alive clients would cost "
        "floodgate less per refusal. The client is Python on the same 2 CPUs as floodgate and the upstream; an "
        "immediate retry loop is bounded by the attempt limit, which is what bounds its waste here. The attempts per "
        "served job depend on the budget: an immediate client spends all its attempts on a refused job within "
        "milliseconds, an honouring one fits at most a few 1-1.5 s sleeps into its deadline, so a larger attempt "
        "limit widens the gap and a shorter deadline narrows it.",
    ]
    return lines


def headline(runs, meta):
    by = dict(groups(runs))
    imm, hon = by.get("immediate"), by.get("honour")
    if not imm or not hon:
        return []
    s = runs[0]
    return [
        f"**Retry-After**, clients retrying shed requests at {s['factor']:g}x capacity (N = {s['cap']}, queue "
        f"{s['queue']}): honouring `Retry-After` (seen: {fmt(med_of(hon, 'ra_med'))} s) instead of retrying at once "
        f"took {fmt(med_of(hon, 'attempts_per_served'), 1)} vs {fmt(med_of(imm, 'attempts_per_served'), 1)} attempts "
        f"per served request ({times(med_of(hon, 'attempts_per_served'), med_of(imm, 'attempts_per_served'))}) and "
        f"{times(med_of(hon, 'cpu_ms_per_s'), med_of(imm, 'cpu_ms_per_s'))} the floodgate CPU, at the same goodput "
        f"({times(med_of(hon, 'goodput'), med_of(imm, 'goodput'))}) and share served "
        f"({fmt(med_of(hon, 'served_share'), 1)} % vs {fmt(med_of(imm, 'served_share'), 1)} %); a served job's p50 "
        f"rose from {fmt(med_of(imm, 'p50'))} to {fmt(med_of(hon, 'p50'))} ms (the sleeps)."
    ]
