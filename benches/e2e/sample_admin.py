#!/usr/bin/env python3
"""Samples floodgate's admin listener while a measured load runs (scenarios adaptive, slow-readers and endpoints).

Usage: python3 sample_admin.py ADMIN_ADDR OUT.jsonl INTERVAL_S
Every INTERVAL_S seconds until SIGTERM/SIGINT, appends one JSON line to OUT.jsonl:
  {"t": seconds since the sampler started, "wall": time.time() (to line readings up with other events),
   "upstream": /status's object for the upstream "default" (or the first),
   "metrics": {"floodgate_buffered_bytes": v, "floodgate_buffer_fallbacks_total": v}}
A reading that fails (the proxy busy past the 1 s timeout) is skipped, not fatal. Standard library only.
The scenarios read OUT.jsonl back with read_samples (and a /status snapshot with upstream_of).
"""

import json
import os
import signal
import sys
import time
import urllib.request

METRICS = ("floodgate_buffered_bytes", "floodgate_buffer_fallbacks_total")


def get(url):
    with urllib.request.urlopen(url, timeout=1) as r:
        return r.read().decode()


def upstream_of(status):
    ups = status.get("upstreams", status)
    if isinstance(ups, dict):
        if "default" in ups:
            return ups["default"]
        for v in ups.values():
            if isinstance(v, dict):
                return v
    if isinstance(ups, list) and ups:
        return ups[0]
    return status


def read_samples(path):
    """The readings in OUT.jsonl, in order: [] when there is none; a line that does not parse (the last one, cut
    short when the sampler was stopped) is left out."""
    out = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    return out


def metrics_of(text):
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in METRICS:
            try:
                out[name] = float(value.split()[0])
            except (ValueError, IndexError):
                pass
    return out


def main():
    admin, path, interval = sys.argv[1], sys.argv[2], float(sys.argv[3])
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    t0 = time.monotonic()
    with open(path, "a") as f:
        while not stop:
            t = time.monotonic() - t0
            try:
                line = {"t": round(t, 3), "wall": round(time.time(), 3), "upstream": upstream_of(json.loads(get(f"http://{admin}/status"))),
                        "metrics": metrics_of(get(f"http://{admin}/metrics"))}
                f.write(json.dumps(line) + "\n")
                f.flush()
            except Exception:  # noqa: BLE001 - a missed sample is a gap in the series, not a failed run
                pass
            next_t = t0 + t + interval
            while not stop and time.monotonic() < next_t:
                time.sleep(min(0.05, max(next_t - time.monotonic(), 0)))


if __name__ == "__main__":
    main()
