#!/usr/bin/env python3
"""Turns one h2load run (its printed summary + its --log-file) into the load.json shape of lib.sh's run_case.

Usage: h2load_to_load.py H2LOAD_OUTPUT H2LOAD_LOG SECONDS > load.json

h2load's summary has no percentiles (min, max, mean and sd of "time for request") and counts status codes only by
class (2xx, 3xx, 4xx, 5xx), counting requests whose headers came but which were cut off by the end of the run. Its
--log-file has one row per finished request: start (µs since the epoch), status code, µs until the end of the
response. The codes and percentiles here come from that file (the finished requests); the summary's mean and its
class counts are kept beside them (summary_mean_us, summary_classes) to check against. When the log is empty the
percentiles are null and only the summary's mean is there.
"""

import json
import math
import re
import sys

UNITS = {"us": 1, "ms": 1e3, "s": 1e6}


def pct(sorted_values, q):
    return sorted_values[max(0, math.ceil(q / 100 * len(sorted_values)) - 1)] if sorted_values else None


def stats_us(values):
    v = sorted(values)
    return {
        "p50_us": pct(v, 50), "p99_us": pct(v, 99), "p999_us": pct(v, 99.9), "max_us": v[-1] if v else None,
        "mean_us": round(sum(v) / len(v), 1) if v else None, "n": len(v),
    }


def duration_us(text):
    m = re.fullmatch(r"([0-9.]+)(us|ms|s)", text)
    return float(m.group(1)) * UNITS[m.group(2)] if m else None


def main():
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    out_path, log_path, secs = sys.argv[1], sys.argv[2], float(sys.argv[3])
    text = open(out_path).read()
    finished = re.search(r"^finished in ([0-9.]+)s,", text, re.M)
    req = re.search(r"^requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
                    r"(\d+) errored, (\d+) timeout", text, re.M)
    classes = re.search(r"^status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", text, re.M)
    timing = re.search(r"^time for request:\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", text, re.M)
    if not (finished and req and classes):
        sys.exit(f"h2load_to_load: no h2load summary in {out_path}")
    latencies, by = [], {}
    with open(log_path) as f:
        for line in f:
            parts = line.split("\t")
            if len(parts) < 3:
                continue
            status, us = int(parts[1]), int(parts[2])
            if status <= 0:  # a stream that ended without a response; counted as errored by h2load
                continue
            latencies.append(us)
            by.setdefault(str(status), []).append(us)
    every = stats_us(latencies)
    out = {
        "generator": "h2load",
        "duration_us": round(float(finished.group(1)) * 1e6) or round(secs * 1e6),
        "requests": len(latencies),
        "codes": {k: len(v) for k, v in sorted(by.items())},
        "err_connect": text.count("could not connect"),
        "err_read": int(req.group(6)),
        "err_write": 0,
        "err_timeout": int(req.group(7)),
        "started": int(req.group(2)),
        "done": int(req.group(3)),
        **{k: every[k] for k in ("p50_us", "p99_us", "p999_us", "max_us", "mean_us")},
        "by_status": {k: stats_us(v) for k, v in sorted(by.items())},
        "summary_classes": dict(zip(("2xx", "3xx", "4xx", "5xx"), map(int, classes.groups()))),
        "summary_mean_us": duration_us(timing.group(3)) if timing else None,
        "summary_min_us": duration_us(timing.group(1)) if timing else None,
        "summary_max_us": duration_us(timing.group(2)) if timing else None,
        "latency_source": "h2load --log-file, per finished request",
    }
    if out["mean_us"] is None:
        out["mean_us"] = out["summary_mean_us"]
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
