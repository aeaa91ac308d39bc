#!/usr/bin/env python3
"""Admission that reads the upstream: slow start, hold through a restart, the stall guard (issue 30's figures).

Builds floodgate (release) and runs its scenarios against an upstream this script serves itself (asyncio, on
loopback), each subject side by side in one run, closed-loop keep-alive clients written here too:

  warm     an upstream that warms up like a JVM: each request takes BASE x (1 + 4c) x (1 + c x (in flight - 1)),
           c = its coldness, 1 falling to 0 over its first WARM requests (slow and worse under concurrency while
           cold). Subjects: floodgate at its cap from the start, a time ramp of the cap (1 to N over RAMP s through
           the admin API, as HAProxy's slowstart ramps maxconn), and slow_start. Reports p50/p99 and 2xx.
  collapse the same upstream, but each request beside another while cold costs the square of the crowding:
           BASE x (1 + 4c) x (1 + c x (in flight - 1))^2, so its throughput falls as concurrency rises until warm.
  restart  an upstream that stops listening (and drops its connections) for 2 s mid-run: 502s with hold_while_down
           off and on.
  stall    an upstream that stops answering (a deadlock) mid-run: time from the deadlock to floodgate's first
           refusal, stall_timeout off (queue_timeout 10 s) and 1 s.
  retries  clients that retry every 503 at once (x-retry-attempt), retry_budget off and on: jobs served, attempts
           per served job.
  drain    two endpoints, the second taken away mid-run, drained through the admin API first or not: failures.
  prewarm  a burst of 8 right after a quiet start against an upstream that reads a new connection 100 ms after
           accepting it: min_idle off and 8.

Usage: benches/upstream_aware.py [-r REPS] [-o FILE]  (-o: write the Markdown section there, else print it)
"""

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- the upstream ----------------------------------------------------------------------------------------------

class Upstream:
    def __init__(self, base_ms=10.0, warm=0, collapse=False, first_on_connection_ms=0.0):
        self.base = base_ms / 1000
        self.warm = warm
        self.collapse = collapse
        # What a new connection costs before it is read (a thread-per-connection server starting its thread).
        self.first_on_connection = first_on_connection_ms / 1000
        self.served = 0
        self.in_flight = 0
        self.peak = 0
        self.listening = None
        self.writers = set()
        self.stalled = None  # an Event set while answers flow; cleared: every request hangs
        self.port = None

    def service_time(self):
        cold = max(0.0, 1 - self.served / self.warm) if self.warm else 0.0
        crowding = 1 + cold * max(0, self.in_flight - 1)
        # Collapsing: each request beside it while cold costs more than its share, so throughput falls as
        # concurrency rises (a JVM compiling and collecting while its threads contend); otherwise it stays level.
        return self.base * (1 + 4 * cold) * (crowding ** 2 if self.collapse else crowding)

    async def start(self):
        # Handlers cancelled when a scenario's loop ends are expected: nothing to report about them.
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: None)
        self.stalled = asyncio.Event()
        self.stalled.set()
        await self.listen()

    async def listen(self):
        self.listening = await asyncio.start_server(self.connection, "127.0.0.1", self.port or 0, reuse_address=True)
        self.port = self.listening.sockets[0].getsockname()[1]

    async def stop_listening(self):
        self.listening.close()
        for writer in list(self.writers):
            writer.transport.abort()
        await self.listening.wait_closed()

    async def connection(self, reader, writer):
        self.writers.add(writer)
        try:
            # A new connection is ready to be read only after this (a thread started for it, say).
            await asyncio.sleep(self.first_on_connection)
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length:\s*(\d+)", head)
                if length:
                    await reader.readexactly(int(length.group(1)))
                self.in_flight += 1
                self.peak = max(self.peak, self.in_flight)
                try:
                    await self.stalled.wait()
                    await asyncio.sleep(self.service_time())
                finally:
                    self.in_flight -= 1
                self.served += 1
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            self.writers.discard(writer)
            writer.close()


# ---- the clients ------------------------------------------------------------------------------------------------

async def one_client(port, until, results):
    reader = writer = None
    while time.monotonic() < until:
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            start = time.monotonic()
            writer.write(b"GET /x HTTP/1.1\r\nhost: app\r\n\r\n")
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = re.search(rb"(?i)content-length:\s*(\d+)", head)
            if length:
                await reader.readexactly(int(length.group(1)))
            results.append((start, time.monotonic(), status))
            if re.search(rb"(?i)connection:\s*close", head):
                writer.close()
                writer = None
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            results.append((time.monotonic(), time.monotonic(), 0))
            writer = None
            await asyncio.sleep(0.01)
    if writer is not None:
        writer.close()


async def load(port, clients, seconds):
    results = []
    until = time.monotonic() + seconds
    await asyncio.gather(*(one_client(port, until, results) for _ in range(clients)))
    return results


# ---- floodgate ------------------------------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Floodgate:
    def __init__(self, binary, upstream_port, extra):
        self.listen, self.admin = free_port(), free_port()
        self.config = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
        self.config.write(f"""listen = "127.0.0.1:{self.listen}"
admin = "127.0.0.1:{self.admin}"
threads = 1
shutdown_timeout = "1s"

[upstreams.a]
{"" if "endpoints" in extra else f'url = "http://127.0.0.1:{upstream_port}"'}
{"" if "max_queue" in extra else "max_queue = 1000"}
{extra}

[[routes]]
upstream = "a"
""")
        self.config.close()
        self.process = subprocess.Popen([binary, "--config", self.config.name], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        for line in self.process.stdout:
            if line.startswith("floodgate ready "):
                break
        else:
            raise SystemExit("floodgate did not start: " + self.process.stderr.read()[-2000:])
        # Its log is not read: a thread would have to drain it, and nothing here needs it.
        self.process.stderr.close()

    async def admin_put(self, path, body):
        reader, writer = await asyncio.open_connection("127.0.0.1", self.admin)
        writer.write(f"PUT {path} HTTP/1.1\r\nhost: a\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n{body}"
                     .encode())
        await writer.drain()
        await reader.read()
        writer.close()

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.unlink(self.config.name)


def percentile(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# ---- the scenarios ----------------------------------------------------------------------------------------------

async def warm(binary, subject, collapse=False):
    upstream = Upstream(base_ms=10, warm=1500, collapse=collapse)
    await upstream.start()
    extra = {"at cap": "max_connections = 8", "time ramp": "max_connections = 1",
             "slow_start": "max_connections = 8\n"
                           "slow_start = { initial = 1, window = \"500ms\", min_samples = 5 }"}[subject]
    proxy = Floodgate(binary, upstream.port, extra + '\nqueue_timeout = "30s"')
    ramp = None
    if subject == "time ramp":
        async def ramp_cap():
            for cap in range(2, 9):
                await asyncio.sleep(4 / 7)
                await proxy.admin_put("/upstreams/a/max_connections", str(cap))
        ramp = asyncio.ensure_future(ramp_cap())
    results = await load(proxy.listen, 32, 12)
    if ramp:
        await ramp
    proxy.stop()
    await upstream.stop_listening()
    ok = [end - start for start, end, status in results if status == 200]
    first = [end - start for start, end, status in results if status == 200 and start - results[0][0] < 4]
    return {"ok": len(ok), "other": len(results) - len(ok), "p50": percentile(ok, 0.5), "p99": percentile(ok, 0.99),
            "p99_first_4s": percentile(first, 0.99), "peak": upstream.peak}


async def collapse(binary, subject):
    return await warm(binary, subject, collapse=True)


async def restart(binary, subject):
    upstream = Upstream(base_ms=10)
    await upstream.start()
    extra = 'max_connections = 4\nqueue_timeout = "30s"' + ("\nhold_while_down = true" if subject == "hold_while_down" else "")
    proxy = Floodgate(binary, upstream.port, extra)

    async def bounce():
        await asyncio.sleep(2)
        await upstream.stop_listening()
        await asyncio.sleep(2)
        await upstream.listen()
    bouncing = asyncio.ensure_future(bounce())
    results = await load(proxy.listen, 8, 7)
    await bouncing
    proxy.stop()
    await upstream.stop_listening()
    return {"ok": sum(1 for r in results if r[2] == 200), "502": sum(1 for r in results if r[2] == 502),
            "other": sum(1 for r in results if r[2] not in (200, 502))}


async def stall(binary, subject):
    upstream = Upstream(base_ms=10)
    await upstream.start()
    extra = 'max_connections = 4\nqueue_timeout = "10s"' + ('\nstall_timeout = "1s"' if subject == "1s" else "")
    proxy = Floodgate(binary, upstream.port, extra)
    deadlock = {}

    async def freeze():
        await asyncio.sleep(1)
        deadlock["at"] = time.monotonic()
        upstream.stalled.clear()
    asyncio.ensure_future(freeze())
    results = await load(proxy.listen, 8, 13)
    proxy.stop()
    upstream.stalled.set()
    await upstream.stop_listening()
    refused = [end for start, end, status in results if status == 503 and end >= deadlock["at"]]
    return {"first_refusal_s": (min(refused) - deadlock["at"]) if refused else float("nan"),
            "refused": len(refused)}


async def retrying_client(port, until, jobs):
    """Jobs one after another; each attempt shed (503) is retried at once, marked x-retry-attempt, four times at
    most. `jobs` gets (served, attempts) per job."""
    reader = writer = None
    while time.monotonic() < until:
        attempts, served = 0, False
        while attempts < 5 and not served and time.monotonic() < until:
            retry = b"x-retry-attempt: %d\r\n" % attempts if attempts else b""
            attempts += 1
            try:
                if writer is None:
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /x HTTP/1.1\r\nhost: app\r\n" + retry + b"\r\n")
                await writer.drain()
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length:\s*(\d+)", head)
                if length:
                    await reader.readexactly(int(length.group(1)))
                served = int(head.split(b" ", 2)[1]) == 200
            except (ConnectionError, asyncio.IncompleteReadError, OSError):
                writer = None
        jobs.append((served, attempts))
    if writer is not None:
        writer.close()


async def retries(binary, subject):
    upstream = Upstream(base_ms=20)
    await upstream.start()
    extra = 'max_connections = 4\nmax_queue = 8\nqueue_timeout = "200ms"' + (
        "\nretry_budget = { ratio = 0.1, min_per_second = 1 }" if subject == "budget" else "")
    proxy = Floodgate(binary, upstream.port, extra)
    jobs = []
    until = time.monotonic() + 8
    await asyncio.gather(*(retrying_client(proxy.listen, until, jobs) for _ in range(64)))
    proxy.stop()
    await upstream.stop_listening()
    served = [attempts for ok, attempts in jobs if ok]
    attempts = sum(attempts for _, attempts in jobs)
    return {"jobs": len(jobs), "served": len(served), "attempts_per_served": attempts / max(1, len(served)),
            "served_first_time": sum(1 for a in served if a == 1), "upstream_served": upstream.served}


async def prewarm(binary, subject):
    upstream = Upstream(base_ms=5, first_on_connection_ms=100)
    await upstream.start()
    extra = "max_connections = 8" + ("\nmin_idle = 8" if subject == "min_idle = 8" else "")
    proxy = Floodgate(binary, upstream.port, extra)
    # Time for the connections min_idle asks for; then a burst of 8 after the quiet start.
    await asyncio.sleep(1)
    results = []

    async def one_request():
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.listen)
        start = time.monotonic()
        writer.write(b"GET /x HTTP/1.1\r\nhost: app\r\n\r\n")
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        results.append((start, time.monotonic(), int(head.split(b" ", 2)[1])))
        writer.close()
    await asyncio.gather(*(one_request() for _ in range(8)))
    proxy.stop()
    await upstream.stop_listening()
    times = [end - start for start, end, status in results if status == 200]
    return {"served": len(times), "slowest": max(times) if times else float("nan"),
            "median": statistics.median(times) if times else float("nan")}


async def drain(binary, subject):
    staying, leaving = Upstream(base_ms=20), Upstream(base_ms=20)
    await staying.start()
    await leaving.start()
    extra = ("max_connections = 8\nendpoints = [\n"
             f'  {{ url = "http://127.0.0.1:{staying.port}", max_connections = 4 }},\n'
             f'  {{ url = "http://127.0.0.1:{leaving.port}", max_connections = 4 }},\n]')
    proxy = Floodgate(binary, staying.port, extra)

    async def take_away():
        await asyncio.sleep(2)
        if subject == "drain first":
            await proxy.admin_put(f"/upstreams/a/endpoints/127.0.0.1:{leaving.port}/state", "drain")
        await asyncio.sleep(2)
        await leaving.stop_listening()
    going = asyncio.ensure_future(take_away())
    results = await load(proxy.listen, 16, 7)
    await going
    proxy.stop()
    await staying.stop_listening()
    codes = {}
    for r in results:
        codes[r[2]] = codes.get(r[2], 0) + 1
    first_failure = min((r[0] for r in results if r[2] != 200), default=None)
    return {"ok": codes.get(200, 0), "failed": sum(n for code, n in codes.items() if code != 200),
            "left_served": leaving.served, "codes": codes,
            "first_failure_s": (first_failure - results[0][0]) if first_failure else None}


SCENARIOS = {
    "warm": (warm, ["at cap", "time ramp", "slow_start"]),
    "collapse": (collapse, ["at cap", "time ramp", "slow_start"]),
    "restart": (restart, ["off", "hold_while_down"]),
    "stall": (stall, ["off", "1s"]),
    "retries": (retries, ["off", "budget"]),
    "prewarm": (prewarm, ["off", "min_idle = 8"]),
    "drain": (drain, ["taken away", "drain first"]),
}


def median(runs, key):
    values = [run[key] for run in runs if run[key] == run[key]]
    return statistics.median(values) if values else float("nan")


def ms(seconds):
    return f"{seconds * 1000:.0f}"


def count(value):
    return f"{value:.0f}"


RAMP_COLUMNS = [("subject", None, None), ("2xx", "ok", count), ("p50 ms", "p50", ms), ("p99 ms", "p99", ms),
                ("p99 ms, first 4 s", "p99_first_4s", ms), ("upstream peak in flight", "peak", count)]

# Each scenario's table in the report: its title, then (column, the run's key, how it is written); the first
# column is the subject.
TABLES = [
    ("warm", "**Slow start against a warming upstream** (32 clients, cap 8, 12 s; the upstream takes 10 ms warm, up "
             "to 5x that cold and more with each request beside it while cold, warm after 1,500 requests; the time "
             "ramp raises the cap from 1 to 8 over 4 s through the admin API, HAProxy's `slowstart` shape):",
     RAMP_COLUMNS),
    ("collapse", "**Slow start against a warming upstream whose throughput collapses under concurrency** (the same, "
                 "but the crowding factor squared while cold):", RAMP_COLUMNS),
    ("restart", "**Hold through a restart** (8 clients, cap 4, 10 ms, 7 s; the upstream stops listening and drops "
                "its connections 2 s in, for 2 s):",
     [("hold_while_down", None, None), ("2xx", "ok", count), ("502", "502", count), ("other", "other", count)]),
    ("stall", "**Stall guard against a deadlocked upstream** (8 clients, cap 4, queue_timeout 10 s; the upstream "
              "stops answering 1 s in):",
     [("stall_timeout", None, None), ("first refusal after the deadlock, s", "first_refusal_s", "{:.2f}".format),
      ("refusals", "refused", count)]),
    ("retries", "**Retry budget against clients that retry every shed at once** (64 closed-loop clients, each job "
                "retried up to 4 times marked `x-retry-attempt`; cap 4, 20 ms, max_queue 8, queue_timeout 200 ms, "
                "8 s; budget `{ ratio = 0.1, min_per_second = 1 }`):",
     [("retry_budget", None, None), ("jobs", "jobs", count), ("served", "served", count),
      ("served at the first attempt", "served_first_time", count),
      ("attempts per served job", "attempts_per_served", "{:.1f}".format),
      ("upstream served", "upstream_served", count)]),
    ("prewarm", "**Prewarmed connections against a burst after a quiet start** (8 requests at once 1 s after start, "
                "cap 8; the upstream takes 5 ms, and reads a new connection only 100 ms after accepting it, as a "
                "thread-per-connection server starting its thread):",
     [("min_idle", None, None), ("served", "served", count), ("median ms", "median", ms),
      ("slowest ms", "slowest", ms)]),
    ("drain", "**Per-endpoint drain before an endpoint goes away** (two endpoints of 4 connections each, 16 clients, "
              "20 ms, 7 s; the second stops listening and drops its connections 4 s in, drained through the admin "
              "API 2 s before that, or not):",
     [("subject", None, None), ("2xx", "ok", count), ("failed", "failed", count),
      ("served by the endpoint that left", "left_served", count)]),
]


def render(results, reps):
    """The Markdown section: a table per scenario that ran."""
    lines = ["## Admission that reads the upstream (benches/upstream_aware.py)", "",
             f"`benches/upstream_aware.py -r {reps}` (medians of {reps}; every subject in one run, one after the "
             "other, floodgate `--threads 1`, the upstream and the clients in the script's own asyncio loop on the "
             "same 2 CPUs). The upstreams are simulated: their shape is in the script's docstring.", ""]
    for name, title, columns in TABLES:
        if name not in results:
            continue
        lines += [title, "", "| " + " | ".join(column for column, _, _ in columns) + " |",
                  "|" + "---|" * len(columns)]
        for subject, runs in results[name].items():
            cells = [subject] + [written(median(runs, key)) for _, key, written in columns[1:]]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-r", "--reps", type=int, default=1)
    parser.add_argument("-o", "--out")
    parser.add_argument("--only", choices=sorted(SCENARIOS), help="run one scenario; its table alone is printed")
    args = parser.parse_args()
    subprocess.run(["cargo", "build", "--release", "--locked", "--quiet", "--bin", "floodgate"], cwd=ROOT, check=True)
    target = json.loads(subprocess.run(["cargo", "metadata", "--format-version", "1", "--no-deps"], cwd=ROOT,
                                       check=True, capture_output=True, text=True).stdout)["target_directory"]
    binary = os.path.join(target, "release", "floodgate")
    results = {}
    for name, (run, subjects) in SCENARIOS.items():
        if args.only and name != args.only:
            continue
        results[name] = {subject: [] for subject in subjects}
        for rep in range(args.reps):
            for subject in subjects:
                outcome = asyncio.run(run(binary, subject))
                print(f"{name} / {subject} / rep {rep + 1}: {outcome}", file=sys.stderr)
                results[name][subject].append(outcome)
    text = render(results, args.reps)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
