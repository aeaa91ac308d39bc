#!/usr/bin/env python3
"""Open-loop clients that retry shed requests (scenario "retry-after", benches/e2e/scenarios/retry-after.sh).

Usage: python3 retry_client.py HOST:PORT RATE SECONDS MODE MAX_ATTEMPTS DEADLINE_S JITTER OUT.json
A new job (one logical request) starts every 1 / RATE seconds for DEADLINE_S + SECONDS + DEADLINE_S seconds. The
jobs counted are those started in the middle SECONDS: by then the population of retrying jobs has built up (a job
lives at most DEADLINE_S), and each of them ends before the arrivals stop, so every counted job ran under the same
sustained load. The others only keep that load up; those still under way at the end are cancelled. A job sends `GET /` on a new connection (`Connection: close`) and
reads the whole answer. On a 2xx it is served. On anything else (another status, a socket error) it tries again:
MODE "immediate" at once, MODE "honour" after sleeping the answer's `Retry-After` seconds (1 when there is none)
times a factor drawn uniformly from [1, 1 + JITTER]. A job gives up after MAX_ATTEMPTS attempts, or when its next
attempt could not start within DEADLINE_S of the job's start (an honouring client that would sleep past it stops
there). Each attempt is bounded by what is left of the deadline.

OUT.json has the load.json shape of lib.sh's run_case (requests, codes and errors per attempt of the counted jobs;
p50_us... the time from a served counted job's start to its 2xx, retries and sleeps included; duration_us the
SECONDS window), plus "jobs" (the counted ones): started, served, gave_up, attempts, retry_after (count by value
seen), reasons (X-Floodgate-Shed-Reason counts), attempts_served_p50/p99 (attempts per served job); and "all" (every
job, counted or not, over the whole time the load lasted): seconds, attempts, served (2xx answers).
Standard library only (asyncio, raw sockets).
"""

import asyncio
import json
import math
import random
import sys
import time


def pct(values, q):
    if not values:
        return None
    values = sorted(values)
    return values[max(0, math.ceil(q / 100 * len(values)) - 1)]


class Stats:
    def __init__(self):
        self.codes = {}
        self.errors = {"err_connect": 0, "err_read": 0, "err_write": 0, "err_timeout": 0}
        self.retry_after = {}
        self.reasons = {}
        self.started = self.served = self.gave_up = self.attempts = 0
        self.served_latency = []
        self.attempts_served = []


async def attempt(host, port, timeout):
    """One request on a new connection: (status, headers) or raises."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        writer.write(f"GET / HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        data = await asyncio.wait_for(reader.read(-1), timeout)
    finally:
        writer.close()
    head, _, _ = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines or not lines[0].startswith("HTTP/"):
        raise ConnectionError("no response head")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers


async def job(host, port, mode, max_attempts, deadline_s, jitter, st, tot):
    t0 = time.monotonic()
    end = t0 + deadline_s
    st.started += 1
    for n in range(1, max_attempts + 1):
        left = end - time.monotonic()
        if left <= 0:
            break
        st.attempts += 1
        tot.attempts += 1
        wait = 1.0
        try:
            status, headers = await attempt(host, port, left)
        except asyncio.TimeoutError:
            st.errors["err_timeout"] += 1
        except (ConnectionRefusedError, ConnectionResetError, OSError):
            st.errors["err_connect"] += 1
        else:
            st.codes[str(status)] = st.codes.get(str(status), 0) + 1
            if 200 <= status < 300:
                st.served += 1
                tot.served += 1
                st.served_latency.append(time.monotonic() - t0)
                st.attempts_served.append(n)
                return
            reason = headers.get("x-floodgate-shed-reason")
            if reason:
                st.reasons[reason] = st.reasons.get(reason, 0) + 1
            ra = headers.get("retry-after")
            if ra is not None and ra.isdigit():
                st.retry_after[ra] = st.retry_after.get(ra, 0) + 1
                wait = float(ra)
        if n == max_attempts:
            break
        if mode == "honour":
            pause = wait * random.uniform(1.0, 1.0 + jitter)
            if time.monotonic() + pause >= end:
                break
            await asyncio.sleep(pause)
    st.gave_up += 1


async def main():
    hostport, rate, secs, mode, max_attempts, deadline_s, jitter, out = sys.argv[1:9]
    host, _, port = hostport.rpartition(":")
    rate, secs, max_attempts = float(rate), float(secs), int(max_attempts)
    deadline_s, jitter = float(deadline_s), float(jitter)
    if mode not in ("immediate", "honour"):
        sys.exit(f"unknown mode: {mode}")
    st, tot, background = Stats(), Stats(), Stats()
    t0 = time.monotonic()
    window_start = t0 + deadline_s
    window_end = window_start + secs
    load_end = window_end + deadline_s
    counted, others = [], []
    i = 0
    while True:
        due = t0 + i / rate
        if due >= load_end:
            break
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        mine = window_start <= due < window_end
        task = asyncio.ensure_future(
            job(host, int(port), mode, max_attempts, deadline_s, jitter, st if mine else background, tot))
        (counted if mine else others).append(task)
        i += 1
    if counted:
        await asyncio.gather(*counted)
    await asyncio.sleep(max(load_end - time.monotonic(), 0))
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)
    load_secs = time.monotonic() - t0
    lat = [x * 1e6 for x in st.served_latency]
    load = {
        "duration_us": int(secs * 1e6),
        "elapsed_us": int((time.monotonic() - t0) * 1e6),
        "requests": sum(st.codes.values()),
        "codes": st.codes,
        **st.errors,
        "p50_us": pct(lat, 50),
        "p99_us": pct(lat, 99),
        "p999_us": pct(lat, 99.9),
        "max_us": max(lat) if lat else None,
        "jobs": {
            "mode": mode,
            "rate": rate,
            "started": st.started,
            "served": st.served,
            "gave_up": st.gave_up,
            "attempts": st.attempts,
            "retry_after": st.retry_after,
            "reasons": st.reasons,
            "attempts_served_p50": pct(st.attempts_served, 50),
            "attempts_served_p99": pct(st.attempts_served, 99),
        },
        "all": {"seconds": load_secs, "attempts": tot.attempts, "served": tot.served},
    }
    with open(out, "w") as f:
        json.dump(load, f)
    print(f"retry_client {mode}: {st.started} jobs, {st.served} served, {st.attempts} attempts", file=sys.stderr)


if __name__ == "__main__":
    asyncio.run(main())
