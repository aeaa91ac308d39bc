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
  holds    an upstream that holds every 200th request 3 s: hold_warn_after off and 1 s, when /status first counts it.
  discovery  a rolling replacement of two pods on one DNS name (the script's own name server): endpoints from DNS
           against a static list of the first two: failed POSTs.
  jvm-warm benches/e2e/jvm/JvmUpstream.java in its warming mode (a cache computed on a miss without single-flight,
           its code interpreted until the JIT compiles it; a fresh JVM per run): at cap, a time ramp, slow_start.

Usage: benches/upstream_aware.py [-r REPS] [-o FILE]  (-o: write the Markdown section there, else print it)
"""

import argparse
import asyncio
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- the upstream ----------------------------------------------------------------------------------------------

class Tally:
    """Connections and requests at work, now and at their peak, over one upstream or several (a set of pods): what
    the cap bounds, counted where the upstream sees it."""

    def __init__(self):
        self.conns = self.peak_conns = self.in_flight = self.peak = 0

    def connected(self, by):
        self.conns += by
        self.peak_conns = max(self.peak_conns, self.conns)

    def working(self, by):
        self.in_flight += by
        self.peak = max(self.peak, self.in_flight)


class Upstream:
    def __init__(self, base_ms=10.0, warm=0, collapse=False, first_on_connection_ms=0.0, hang_every=0, hang_s=0.0,
                 host="127.0.0.1", port=None, tally=None):
        self.base = base_ms / 1000
        # Every hang_every-th request is held hang_s longer (a stuck call: a lock, a slow dependency), and when the
        # first of them began is kept.
        self.hang_every, self.hang = hang_every, hang_s
        self.first_hang = None
        self.host = host
        self.tally = tally or Tally()
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
        self.port = port

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
        self.listening = await asyncio.start_server(self.connection, self.host, self.port or 0, reuse_address=True)
        self.port = self.listening.sockets[0].getsockname()[1]

    async def stop_listening(self):
        self.listening.close()
        for writer in list(self.writers):
            writer.transport.abort()
        await self.listening.wait_closed()

    async def connection(self, reader, writer):
        self.writers.add(writer)
        self.tally.connected(1)
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
                self.tally.working(1)
                try:
                    await self.stalled.wait()
                    service = self.service_time()
                    if self.hang_every and (self.served + self.in_flight) % self.hang_every == 0:
                        self.first_hang = self.first_hang or time.monotonic()
                        service += self.hang
                    await asyncio.sleep(service)
                finally:
                    self.in_flight -= 1
                    self.tally.working(-1)
                self.served += 1
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            self.tally.connected(-1)
            self.writers.discard(writer)
            writer.close()


class JvmUpstream:
    """The end-to-end benchmark's thread-per-connection JVM upstream (benches/e2e/jvm/JvmUpstream.java) in its
    warming mode: each request looks up one of KEYS keys in a cache that computes a miss without a lock (WORK rounds
    of SHA-256, interpreted until the JIT compiles it), then sleeps DELAY ms. A fresh JVM per run."""

    KEYS, WORK, DELAY = 64, 200000, 2

    def __init__(self, classes):
        self.classes = classes
        self.process = None
        self.port = self.control = None
        self.peak = 0

    async def start(self):
        self.control = free_port()
        self.process = subprocess.Popen(
            ["java", "-Xms256m", "-Xmx256m", "-cp", self.classes, "JvmUpstream", "--listen", "127.0.0.1:0",
             "--control", f"127.0.0.1:{self.control}", "--delay-ms", str(self.DELAY),
             "--cold-keys", str(self.KEYS), "--cold-work", str(self.WORK)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        ready = self.process.stdout.readline()
        found = re.search(r"listen=127\.0\.0\.1:(\d+)", ready)
        if not found:
            raise SystemExit("the JVM upstream did not start: " + ready)
        self.port = int(found.group(1))

    def stats(self):
        with socket.create_connection(("127.0.0.1", self.control)) as s:
            s.sendall(b"GET /stats HTTP/1.1\r\nhost: c\r\nconnection: close\r\n\r\n")
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        return json.loads(answer.split(b"\r\n\r\n", 1)[1])

    async def stop_listening(self):
        stats = self.stats()
        self.peak = stats["peak_inflight"]
        self.tally = Tally()
        self.tally.peak, self.tally.peak_conns = stats["peak_inflight"], stats["peak_conns"]
        self.computed = stats["cold_computed"]
        self.process.terminate()
        self.process.wait()


def jvm_classes():
    """The JVM upstream compiled where the end-to-end benchmark compiles it (javac from a JDK: run.sh installs one)."""
    target = json.loads(subprocess.run(["cargo", "metadata", "--format-version", "1", "--no-deps"], cwd=ROOT,
                                       check=True, capture_output=True, text=True).stdout)["target_directory"]
    classes = os.path.join(target, "e2e-jvm-upstream")
    os.makedirs(classes, exist_ok=True)
    subprocess.run(["javac", "-d", classes, os.path.join(ROOT, "benches", "e2e", "jvm", "JvmUpstream.java")],
                   check=True)
    return classes


class Dns(asyncio.DatagramProtocol):
    """A name server that answers every A question with the addresses it holds now (TTL 0) and every other question
    with none: what a headless Service's DNS does as its pods come and go."""

    def __init__(self, addresses):
        self.addresses = list(addresses)
        self.transport = None

    def connection_made(self, transport):
        self.transport = transport

    def datagram_received(self, data, peer):
        if len(data) < 12:
            return
        end = 12
        while end < len(data) and data[end]:
            end += data[end] + 1
        question = data[12:end + 5]
        qtype = int.from_bytes(data[end + 1:end + 3], "big")
        answers = [b"\xc0\x0c\x00\x01\x00\x01\x00\x00\x00\x00\x00\x04" + socket.inet_aton(address)
                   for address in self.addresses] if qtype == 1 else []
        header = data[:2] + b"\x81\x80\x00\x01" + len(answers).to_bytes(2, "big") + b"\x00\x00\x00\x00"
        self.transport.sendto(header + question + b"".join(answers), peer)


async def start_dns(addresses):
    port = free_port()
    _, dns = await asyncio.get_running_loop().create_datagram_endpoint(lambda: Dns(addresses),
                                                                       local_addr=("127.0.0.1", port))
    return dns, port


# ---- the clients ------------------------------------------------------------------------------------------------

def get(path=b"/x"):
    return b"GET " + path + b" HTTP/1.1\r\nhost: app\r\n\r\n"


def post():
    """A request that may not be sent twice: a POST with a small body."""
    return b"POST /x HTTP/1.1\r\nhost: app\r\ncontent-length: 5\r\n\r\nhello"


async def one_client(port, until, results, request=get):
    reader = writer = None
    while time.monotonic() < until:
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            start = time.monotonic()
            writer.write(request())
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


async def load(port, clients, seconds, request=get):
    results = []
    until = time.monotonic() + seconds
    await asyncio.gather(*(one_client(port, until, results, request) for _ in range(clients)))
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

    async def status(self):
        reader, writer = await asyncio.open_connection("127.0.0.1", self.admin)
        writer.write(b"GET /status HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n")
        await writer.drain()
        answer = await reader.read()
        writer.close()
        return json.loads(answer.split(b"\r\n\r\n", 1)[1])

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


def peaks(tally):
    """What the upstream (or every pod of it) saw at once, at most: the figures the cap bounds."""
    return {"peak_conns": tally.peak_conns, "peak": tally.peak}


# ---- the scenarios ----------------------------------------------------------------------------------------------

async def warm(binary, subject, collapse=False, upstream=None, request=get):
    upstream = upstream or Upstream(base_ms=10, warm=1500, collapse=collapse)
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
    results = await load(proxy.listen, 32, 12, request)
    if ramp:
        await ramp
    proxy.stop()
    await upstream.stop_listening()
    ok = [end - start for start, end, status in results if status == 200]
    first = [end - start for start, end, status in results if status == 200 and start - results[0][0] < 4]
    return {"ok": len(ok), "other": len(results) - len(ok), "p50": percentile(ok, 0.5), "p99": percentile(ok, 0.99),
            "p99_first_4s": percentile(first, 0.99), "peak": upstream.peak, "peak_conns": upstream.tally.peak_conns,
            "computed": getattr(upstream, "computed", float("nan"))}


async def collapse(binary, subject):
    return await warm(binary, subject, collapse=True)


JVM_CLASSES = None


async def jvm_warm(binary, subject):
    # Each client asks for a key at random, the popular ones more often (Zipf's 1 / rank): early on most requests
    # miss, several at a time on the same popular key.
    keys = [b"/x/%d" % key for key in range(JvmUpstream.KEYS)]
    weights = [1 / (rank + 1) for rank in range(JvmUpstream.KEYS)]
    return await warm(binary, subject, upstream=JvmUpstream(JVM_CLASSES),
                      request=lambda: get(random.choices(keys, weights)[0]))


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
            "other": sum(1 for r in results if r[2] not in (200, 502)), **peaks(upstream.tally)}


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
            "refused": len(refused), **peaks(upstream.tally)}


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
            "served_first_time": sum(1 for a in served if a == 1), "upstream_served": upstream.served,
            **peaks(upstream.tally)}


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
            "median": statistics.median(times) if times else float("nan"), **peaks(upstream.tally)}


async def holds(binary, subject):
    upstream = Upstream(base_ms=10, hang_every=200, hang_s=3)
    await upstream.start()
    extra = "max_connections = 8" + ('\nhold_warn_after = "1s"' if subject == "1s" else "")
    proxy = Floodgate(binary, upstream.port, extra)
    reported = {}

    async def watch():
        # When the hold is first counted where an operator looks (/status, as /metrics), polled every 50 ms.
        while True:
            await asyncio.sleep(0.05)
            holds = (await proxy.status())["upstreams"]["a"]["long_holds_total"]
            if holds and "at" not in reported:
                reported["at"] = time.monotonic()
            reported["holds"] = holds
    watching = asyncio.ensure_future(watch())
    results = await load(proxy.listen, 8, 8)
    await asyncio.sleep(0.2)
    watching.cancel()
    proxy.stop()
    await upstream.stop_listening()
    first = reported.get("at")
    return {"ok": sum(1 for r in results if r[2] == 200), "held": sum(1 for s, e, _ in results if e - s > 1),
            "reported": reported.get("holds", 0),
            "first_report_s": (first - upstream.first_hang) if first and upstream.first_hang else float("nan"),
            **peaks(upstream.tally)}


async def discovery(binary, subject):
    # A rolling replacement of two pods (127.0.0.1 and .2) by two new ones (.3 and .4), all on one port: each new
    # pod listens, then joins the name; each old one leaves the name, then stops 1 s later, dropping its connections.
    port = free_port()
    tally = Tally()
    pods = {ip: Upstream(base_ms=20, host=ip, port=port, tally=tally)
            for ip in ("127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4")}
    for ip in ("127.0.0.1", "127.0.0.2"):
        await pods[ip].start()
    dns, dns_port = await start_dns(["127.0.0.1", "127.0.0.2"])
    if subject == "discovery":
        extra = ("max_connections = 8\nendpoints = { dns = \"app.test\", port = %d, max_connections = 4, "
                 "interval = \"500ms\", nameserver = \"127.0.0.1:%d\" }" % (port, dns_port))
    else:
        extra = ("max_connections = 8\nendpoints = [\n"
                 + "".join(f'  {{ url = "http://{ip}:{port}", max_connections = 4 }},\n'
                           for ip in ("127.0.0.1", "127.0.0.2")) + "]")
    proxy = Floodgate(binary, port, extra)

    async def roll():
        for old, new in (("127.0.0.1", "127.0.0.3"), ("127.0.0.2", "127.0.0.4")):
            await asyncio.sleep(1.5)
            await pods[new].start()
            await asyncio.sleep(0.5)
            dns.addresses.append(new)
            await asyncio.sleep(1)
            dns.addresses.remove(old)
            await asyncio.sleep(1)
            await pods[old].stop_listening()
    rolling = asyncio.ensure_future(roll())
    results = await load(proxy.listen, 16, 10, post)
    await rolling
    proxy.stop()
    dns.transport.close()
    for ip in ("127.0.0.3", "127.0.0.4"):
        await pods[ip].stop_listening()
    return {"ok": sum(1 for r in results if r[2] == 200), "failed": sum(1 for r in results if r[2] != 200),
            "new_served": pods["127.0.0.3"].served + pods["127.0.0.4"].served, **peaks(tally),
            "pod_peak": max(pod.peak for pod in pods.values())}


async def drain(binary, subject):
    tally = Tally()
    staying, leaving = Upstream(base_ms=20, tally=tally), Upstream(base_ms=20, tally=tally)
    await staying.start()
    await leaving.start()
    extra = ("max_connections = 8\nendpoints = [\n"
             f'  {{ url = "http://127.0.0.1:{staying.port}", max_connections = 4 }},\n'
             f'  {{ url = "http://127.0.0.1:{leaving.port}", max_connections = 4 }},\n]')
    proxy = Floodgate(binary, staying.port, extra)

    async def take_away():
        await asyncio.sleep(2)
        if subject.startswith("drain first"):
            await proxy.admin_put(f"/upstreams/a/endpoints/127.0.0.1:{leaving.port}/state", "drain")
        await asyncio.sleep(2)
        await leaving.stop_listening()
    going = asyncio.ensure_future(take_away())
    results = await load(proxy.listen, 16, 7, post if subject.endswith("POST") else get)
    await going
    proxy.stop()
    await staying.stop_listening()
    codes = {}
    for r in results:
        codes[r[2]] = codes.get(r[2], 0) + 1
    first_failure = min((r[0] for r in results if r[2] != 200), default=None)
    return {"ok": codes.get(200, 0), "failed": sum(n for code, n in codes.items() if code != 200),
            "left_served": leaving.served, "codes": codes, **peaks(tally),
            "first_failure_s": (first_failure - results[0][0]) if first_failure else None}


SCENARIOS = {
    "warm": (warm, ["at cap", "time ramp", "slow_start"]),
    "collapse": (collapse, ["at cap", "time ramp", "slow_start"]),
    "jvm-warm": (jvm_warm, ["at cap", "time ramp", "slow_start"]),
    "restart": (restart, ["off", "hold_while_down"]),
    "stall": (stall, ["off", "1s"]),
    "retries": (retries, ["off", "budget"]),
    "prewarm": (prewarm, ["off", "min_idle = 8"]),
    "holds": (holds, ["off", "1s"]),
    "drain": (drain, ["taken away", "drain first", "taken away, POST", "drain first, POST"]),
    "discovery": (discovery, ["static list", "discovery"]),
}


def median(runs, key):
    values = [run[key] for run in runs if run[key] == run[key]]
    return statistics.median(values) if values else float("nan")


def ms(seconds):
    return f"{seconds * 1000:.0f}"


def count(value):
    return f"{value:.0f}"


# What the upstream saw at once, at most (connections, requests at work), over every run of a row: the cap's figures.
PEAKS = [("upstream peak conns", "peak_conns", count), ("upstream peak in flight", "peak", count)]
PEAK_KEYS = ("peak_conns", "peak", "pod_peak")

RAMP_COLUMNS = [("subject", None, None), ("2xx", "ok", count), ("p50 ms", "p50", ms), ("p99 ms", "p99", ms),
                ("p99 ms, first 4 s", "p99_first_4s", ms)] + PEAKS

# Each scenario's table in the report: its title, then (column, the run's key, how it is written); the first
# column is the subject.
TABLES = [
    ("warm", "**Slow start against a warming upstream** (32 clients, cap 8, 12 s; the upstream takes 10 ms warm, up "
             "to 5x that cold and more with each request beside it while cold, warm after 1,500 requests; the time "
             "ramp raises the cap from 1 to 8 over 4 s through the admin API, HAProxy's `slowstart` shape):",
     RAMP_COLUMNS),
    ("collapse", "**Slow start against a warming upstream whose throughput collapses under concurrency** (the same, "
                 "but the crowding factor squared while cold):", RAMP_COLUMNS),
    ("jvm-warm", "**Slow start against a warming JVM** (benches/e2e/jvm/JvmUpstream.java, a fresh JVM each run: each "
                 "request looks up one of 64 keys, popular ones more often (1 / rank), in a cache that computes a "
                 "miss without single-flight, 200,000 rounds of SHA-256, interpreted until the JIT compiles it, then "
                 "2 ms; 32 clients, cap 8, 12 s; the time ramp as above; `slow_start = { initial = 1, window = "
                 "\"500ms\", min_samples = 5 }`):",
     RAMP_COLUMNS + [("misses computed", "computed", count)]),
    ("restart", "**Hold through a restart** (8 clients, cap 4, 10 ms, 7 s; the upstream stops listening and drops "
                "its connections 2 s in, for 2 s):",
     [("hold_while_down", None, None), ("2xx", "ok", count), ("502", "502", count),
      ("other", "other", count)] + PEAKS),
    ("stall", "**Stall guard against a deadlocked upstream** (8 clients, cap 4, queue_timeout 10 s; the upstream "
              "stops answering 1 s in):",
     [("stall_timeout", None, None), ("first refusal after the deadlock, s", "first_refusal_s", "{:.2f}".format),
      ("refusals", "refused", count)] + PEAKS),
    ("retries", "**Retry budget against clients that retry every shed at once** (64 closed-loop clients, each job "
                "retried up to 4 times marked `x-retry-attempt`; cap 4, 20 ms, max_queue 8, queue_timeout 200 ms, "
                "8 s; budget `{ ratio = 0.1, min_per_second = 1 }`):",
     [("retry_budget", None, None), ("jobs", "jobs", count), ("served", "served", count),
      ("served at the first attempt", "served_first_time", count),
      ("attempts per served job", "attempts_per_served", "{:.1f}".format),
      ("upstream served", "upstream_served", count)] + PEAKS),
    ("prewarm", "**Prewarmed connections against a burst after a quiet start** (8 requests at once 1 s after start, "
                "cap 8; the upstream takes 5 ms, and reads a new connection only 100 ms after accepting it, as a "
                "thread-per-connection server starting its thread):",
     [("min_idle", None, None), ("served", "served", count), ("median ms", "median", ms),
      ("slowest ms", "slowest", ms)] + PEAKS),
    ("holds", "**Hold alarm against stuck exchanges** (8 clients, cap 8, 10 ms, 8 s; every 200th request is held 3 s "
              "by the upstream; `hold_warn_after` off or 1 s; the first report is when `/status`, polled every 50 ms, "
              "first counts a long hold, after the first stuck request reached the upstream):",
     [("hold_warn_after", None, None), ("2xx", "ok", count), ("requests held over 1 s", "held", count),
      ("long holds reported", "reported", count),
      ("first report after the first stuck request, s", "first_report_s", "{:.2f}".format)] + PEAKS),
    ("drain", "**Per-endpoint drain before an endpoint goes away** (two endpoints of 4 connections each, 16 clients, "
              "20 ms, 7 s; the second stops listening and drops its connections 4 s in, drained through the admin "
              "API 2 s before that, or not; GETs, or POSTs with a 5-byte body):",
     [("subject", None, None), ("2xx", "ok", count), ("failed", "failed", count),
      ("served by the endpoint that left", "left_served", count)] + PEAKS),
    ("discovery", "**Endpoints discovered from DNS through a rolling replacement** (16 clients sending POSTs, 20 ms, "
                  "10 s; two pods at 127.0.0.1 and .2 replaced one at a time by .3 and .4 on the same port: each new "
                  "pod listens, joins the name 0.5 s later, its old one leaves the name 1 s after that and stops "
                  "listening, dropping its connections, 1 s later; 4 connections a pod, cap 8; the name served by "
                  "the script's own DNS server with TTL 0, `interval = \"500ms\"`, against the same two pods as a "
                  "static list):",
     [("endpoints", None, None), ("2xx", "ok", count), ("failed", "failed", count),
      ("served by the new pods", "new_served", count)] + PEAKS
     + [("busiest pod's peak in flight (its cap 4)", "pod_peak", count)]),
]


def render(results, reps):
    """The Markdown section: a table per scenario that ran."""
    lines = ["## Admission that reads the upstream (benches/upstream_aware.py)", "",
             f"`benches/upstream_aware.py -r {reps}` (medians of {reps}, peaks the highest of them; every subject in one run, one after the "
             "other, floodgate `--threads 1`, the upstream and the clients in the script's own asyncio loop on the "
             "same 2 CPUs). The upstreams are simulated (jvm-warm's is a real JVM): their shape is in the script's "
             "docstring.", ""]
    for name, title, columns in TABLES:
        if name not in results:
            continue
        lines += [title, "", "| " + " | ".join(column for column, _, _ in columns) + " |",
                  "|" + "---|" * len(columns)]
        for subject, runs in results[name].items():
            # A peak is the highest of the runs (the cap must hold in each); the rest are medians.
            values = [max(run[key] for run in runs) if key in PEAK_KEYS else median(runs, key)
                      for _, key, _ in columns[1:]]
            cells = [subject] + [written(value) if value == value else "-"
                                 for value, (_, _, written) in zip(values, columns[1:])]
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
    global JVM_CLASSES
    if not args.only or args.only == "jvm-warm":
        JVM_CLASSES = jvm_classes()
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
