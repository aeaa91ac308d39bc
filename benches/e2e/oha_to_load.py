#!/usr/bin/env python3
"""Turns one oha run (JSON summary + the SQLite file of --db-url) into the load.json shape of lib.sh's run_case.

Usage: oha_to_load.py OHA_JSON OHA_DB RATE SECONDS [WITHIN_MS] > load.json

oha's JSON has status counts, errors and percentiles of every response together (with --stats-success-breakdown,
split only into 2xx and not 2xx). Its SQLite file holds every response with its status and its latency (corrected
for coordinated omission when --latency-correction is given: from when the request was due, not when it was sent),
so percentiles per status code come from there. Requests that ended in an error (connect, timeout...) have no row;
they are in the JSON's errorDistribution.

The measured run waits for the requests still in flight when the schedule ends (oha -w), so every request made in
the window of SECONDS is counted, the slowest too. duration_us is therefore oha's elapsed time, from the first
request to the last response (the window plus the drain, about the queue wait in overload), and the counts are of
every response: 2xx / duration_us is the rate the proxy served while it had work, and CPU per response (the proxy's
CPU is measured over the same stretch) divides by the same responses. window_us is SECONDS. "unsent" is how many
requests the schedule made that oha never sent or finished: above 0 the generator ran short of connections and
stopped being open-loop at the end. The schedule is RATE x SECONDS requests, less those of its last 2 ms: oha drops
a tick that fires after the deadline, and tokio's timer fires up to about a millisecond late.

With WITHIN_MS (the overload scenarios: the client's deadline), "within" counts, per status code, the responses
whose latency was at most that many milliseconds, e.g. {"200": 1990, "504": 0}: the served requests that came in
time for a client that gives up then.
"""

import json
import math
import os
import sqlite3
import sys


def pct(sorted_values, q):
    """Nearest-rank percentile of an ascending list; None when empty."""
    if not sorted_values:
        return None
    return sorted_values[max(0, math.ceil(q / 100 * len(sorted_values)) - 1)]


def stats_us(durations_s):
    v = sorted(d * 1e6 for d in durations_s)
    out = {k: (round(pct(v, q)) if v else None) for k, q in (("p50_us", 50), ("p99_us", 99), ("p999_us", 99.9))}
    out["max_us"] = round(v[-1]) if v else None
    out["mean_us"] = round(sum(v) / len(v), 1) if v else None
    out["n"] = len(v)
    return out


def error_kind(message):
    m = message.lower()
    if "deadline" in m:
        return "err_deadline"
    if "timeout" in m or "timed out" in m:
        return "err_timeout"
    if "connect" in m or "dns" in m:
        return "err_connect"
    if "write" in m or "broken pipe" in m:
        return "err_write"
    return "err_read"


def main():
    if len(sys.argv) not in (5, 6):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    js_path, db_path, rate, secs = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
    within_s = float(sys.argv[5]) / 1000 if len(sys.argv) == 6 else None
    with open(js_path) as f:
        summary = json.load(f)
    codes = {str(k): int(v) for k, v in summary.get("statusCodeDistribution", {}).items()}
    errors = {"err_connect": 0, "err_read": 0, "err_write": 0, "err_timeout": 0, "err_deadline": 0}
    for message, n in summary.get("errorDistribution", {}).items():
        errors[error_kind(message)] += int(n)
    responses = sum(codes.values())
    out = {
        "generator": "oha",
        "duration_us": round(summary["summary"]["total"] * 1e6),
        "window_us": round(secs * 1e6),
        "rate": rate,
        "requests": responses,
        "codes": codes,
        **errors,
        "error_messages": summary.get("errorDistribution", {}),
        "unsent": max(0, math.ceil(rate * (secs - 0.002)) - responses - sum(errors.values())),
    }
    rows = []
    if os.path.exists(db_path):
        con = sqlite3.connect(db_path)
        rows = con.execute("SELECT status, duration FROM oha").fetchall()
        con.close()
    if rows:
        if len(rows) != responses:
            print(f"oha_to_load: {len(rows)} rows in {db_path}, {responses} responses in {js_path}", file=sys.stderr)
        every = stats_us([d for _, d in rows])
        out.update({k: every[k] for k in ("p50_us", "p99_us", "p999_us", "max_us", "mean_us")})
        by = {}
        for status, d in rows:
            by.setdefault(str(status), []).append(d)
        out["by_status"] = {k: stats_us(v) for k, v in sorted(by.items())}
        if within_s is not None:
            out["within_ms"] = within_s * 1000
            out["within"] = {k: sum(1 for d in v if d <= within_s) for k, v in sorted(by.items())}
        out["latency_source"] = "oha --db-url, per response"
    else:
        # No per-response file: oha's own percentiles of every response, nothing per status.
        p = summary.get("latencyPercentiles") or {}
        us = lambda v: round(v * 1e6) if v is not None else None
        out.update({"p50_us": us(p.get("p50")), "p99_us": us(p.get("p99")), "p999_us": us(p.get("p99.9")),
                    "max_us": us(summary["summary"].get("slowest")),
                    "mean_us": us(summary["summary"].get("average"))})
        out["latency_source"] = "oha JSON summary"
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
