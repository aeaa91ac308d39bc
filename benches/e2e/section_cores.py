"""Section for the "cores" scenario: floodgate at --threads 1, 2, 4 against HAProxy at nbthread 1, 2, 4, at
capacity (N = 64, 0 ms) and in the retry storm (N = 8, 50 ms); see report_common for the contract."""

from report_common import derive, fmt, markdown_table, med, pct0 as pct, present_subjects, proxy_cores, spread
from section_storm import capacity

TITLE = "Cores: what each proxy does with the threads it is given"

SUBJECTS = ["floodgate-1", "floodgate-2", "floodgate-4", "haproxy-1", "haproxy-2", "haproxy-4"]
KINDS = {"capacity": "capacity, N = 64, 0 ms", "storm": "retry storm, N = 8, 50 ms"}

HEAD = ["subject", "runs", "2xx/s med [min-max]", "share of N / service", "proxy CPU-us per response",
        "proxy CPU (cores)", "busiest thread's share", "threads over 5 %"]


def row(run):
    d = derive(run)
    threads = run.get("proxy_threads") or {}
    d.update({
        # Capacity runs have a 0 ms upstream: no share of a service rate to give.
        "share": d["ok_rate"] / capacity(run) if run["delay_ms"] else None,
        "cores": proxy_cores(run),
        "busiest": threads.get("busiest"),
        "over_5pct": threads.get("over_5pct"),
    })
    return d


def table(runs):
    rows = []
    for subject in present_subjects(runs, SUBJECTS):
        ds = [row(r) for r in runs if r["subject"] == subject]
        rows.append([
            subject, len(ds), spread([d["ok_rate"] for d in ds]), pct(med([d["share"] for d in ds])),
            fmt(med([d["proxy_cpu_us"] for d in ds]), 1), fmt(med([d["cores"] for d in ds]), 2),
            pct(med([d["busiest"] for d in ds])), fmt(med([d["over_5pct"] for d in ds])),
        ])
    return rows


def render(runs, meta):
    s = meta["settings"]
    lines = [
        "Each proxy at 1, 2 and 4 threads (floodgate `--threads`, HAProxy `nbthread`) on the same machine: capacity "
        f"(wrk closed loop, {s.get('cores_capacity_clients', '1000')} clients, the 0 ms upstream, N = 64) and the "
        f"retry storm ({s.get('cores_storm_clients', '4000')} clients, no think time, 2 s client timeout, N = 8 "
        "at 50 ms). **busiest thread's share**: the busiest thread's part of the proxy's CPU over the window "
        "(`/proc/PID/task/*/stat`); a serial part shows as a share that does not fall as threads are added. "
        "**threads over 5 %**: how many threads carry more than 5 % of it.",
    ]
    for kind, title in KINDS.items():
        sel = [r for r in runs if r.get("kind") == kind]
        if sel:
            lines += ["", f"### {title}", ""]
            lines += markdown_table(HEAD, table(sel))
    return lines


def targets(runs, meta):
    out = []
    for subject, bound, most in (("floodgate-4", 0.35, None), ("floodgate-2", 0.60, 2)):
        ds = [row(r) for r in runs if r.get("kind") == "capacity" and r["subject"] == subject]
        busiest, over = med([d["busiest"] for d in ds]), med([d["over_5pct"] for d in ds])
        if busiest is None:
            continue
        met = busiest <= bound and (most is None or (over is not None and over <= most))
        out.append({
            "target": f"Capacity load at {subject}: no thread over {100 * bound:.0f} % of the CPU"
                      + (f", at most {most} over 5 %" if most else ""),
            "floodgate": f"busiest {pct(busiest)}, {fmt(over)} over 5 %",
            "peer": "-",
            "verdict": "met" if met else "gap",
            "note": "",
        })
    return out
