#!/usr/bin/env python3
"""Drives headless Chromium at floodgate's stats page and checks what it shows; run by stats_page_test.sh.

Chromium is driven over the DevTools protocol on a pipe (--remote-debugging-pipe: NUL-terminated JSON on file
descriptors 3 and 4), which needs nothing beyond Python's standard library: no WebSocket client, no debugging
port to discover or race for, no driver binary whose version must match the browser's. One page stays loaded
for the whole check, so a number that changes was changed by the page's own polling, not by a reload.

Checks, in order: the page loads without script errors or blocked loads, shows every configured upstream by
name, fits a 375 px wide phone screen without horizontal scrolling; then, while this script sends requests
through the proxy, its requests/s and queue-wait percentiles show traffic and its charts (connections, queue,
rates, latency) hold the readings with the load in them; and once traffic stops, its counters equal what this
script counted (requests, answered, shed). With --screenshot, a PNG of the page under load.
"""

import argparse
import http.client
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

PHONE_WIDTH = 375


class Failed(Exception):
    pass


class Browser:
    """A headless Chromium and one page in it, over the DevTools pipe."""

    def __init__(self, chromium, log_path):
        self.profile = tempfile.mkdtemp(prefix="floodgate-stats-chromium-")
        to_browser_r, self.to_browser = os.pipe()
        self.from_browser, from_browser_w = os.pipe()

        def on_fds_3_and_4():
            # Duplicated first, so neither pipe end is overwritten by the other's dup2 when one already is 3 or 4.
            reads, writes = os.dup(to_browser_r), os.dup(from_browser_w)
            os.dup2(reads, 3)
            os.dup2(writes, 4)

        args = [
            chromium,
            "--headless",
            "--remote-debugging-pipe",
            f"--user-data-dir={self.profile}",
            "--disable-gpu",
            # Containers often give /dev/shm only 64 MB, too little for Chromium's renderers.
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--mute-audio",
            "about:blank",
        ]
        if os.geteuid() == 0:
            # Chromium's sandbox refuses to run as root.
            args.insert(1, "--no-sandbox")
        self.log = open(log_path, "wb")
        self.process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=self.log,
            # Only the dup2'd descriptors are inheritable (Python opens everything else non-inheritable).
            close_fds=False,
            preexec_fn=on_fds_3_and_4,
            # Its own process group: Chromium's helper processes go when the group is ended, by its id.
            start_new_session=True,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self.buffer = b""
        self.next_id = 0
        self.events = []
        self.session = None

    def call(self, method, params=None, timeout=30, session=True):
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session and self.session:
            message["sessionId"] = self.session
        os.write(self.to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._next_message(deadline, method)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise Failed(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def _next_message(self, deadline, waiting_for):
        while b"\0" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Failed(f"Chromium did not answer {waiting_for} in time")
            ready, _, _ = select.select([self.from_browser], [], [], left)
            if not ready:
                continue
            chunk = os.read(self.from_browser, 1 << 16)
            if not chunk:
                raise Failed(f"Chromium closed the DevTools pipe while we waited for {waiting_for}")
            self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)

    def open_page(self, width, height):
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.call("Runtime.enable")
        self.call("Log.enable")
        self.call("Page.enable")
        self.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 2, "mobile": True},
        )

    def navigate(self, url):
        result = self.call("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise Failed(f"loading {url}: {result['errorText']}")

    def evaluate(self, expression):
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise Failed(f"evaluating in the page: {result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    def problems(self):
        """Script exceptions, console errors and browser log errors (a CSP-blocked load shows up there)."""
        found = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(f"exception: {params.get('exceptionDetails', {})}")
            elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
                found.append(f"console.error: {[a.get('value') for a in params.get('args', [])]}")
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                found.append(f"log: {params['entry'].get('text')} {params['entry'].get('url', '')}")
        return found

    def close(self):
        try:
            self.call("Browser.close", timeout=5, session=False)
        except (Failed, OSError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self.log.close()
        subprocess.run(["rm", "-rf", self.profile], check=False)


READ_PAGE = """(() => {
  if (!document.getElementById("state")) return null;
  const page = {
    state: document.getElementById("state").textContent.trim(),
    scrollWidth: document.documentElement.scrollWidth,
    viewportWidth: window.innerWidth,
    text: document.body.innerText,
    upstreams: {},
  };
  for (const card of document.querySelectorAll("[data-upstream]")) {
    const fields = { heading: card.querySelector("h2").innerText };
    for (const el of card.querySelectorAll("[data-field]")) fields[el.dataset.field] = el.textContent.trim();
    fields.charts = {};
    for (const fig of card.querySelectorAll("[data-chart]")) {
      fields.charts[fig.dataset.chart] = {
        points: Number(fig.dataset.points || 0),
        peak: Number(fig.dataset.peak || 0),
        drawn: [...fig.querySelectorAll("path")].filter((p) => (p.getAttribute("d") || "").includes("L")).length,
      };
    }
    page.upstreams[card.dataset.upstream] = fields;
  }
  for (const name of ["version", "uptime", "last_reload"]) {
    page[name] = document.querySelector(`[data-field="${name}"]`).textContent.trim();
  }
  return page;
})()"""


def number(text):
    """The page's integer counters ("1,234"); None for the placeholder dash."""
    cleaned = text.replace(",", "")
    return int(cleaned) if cleaned.isdigit() else None


def wait_for(browser, what, timeout, condition):
    deadline = time.monotonic() + timeout
    page = None
    while time.monotonic() < deadline:
        page = browser.evaluate(READ_PAGE)
        # Null until the page has loaded (navigating does not wait for that).
        if page is not None and condition(page):
            return page
        time.sleep(0.2)
    shown = json.dumps({k: v for k, v in (page or {}).items() if k != "text"}, indent=1)
    raise Failed(f"the page never showed {what} within {timeout} s; last reading:\n{shown}")


class Traffic:
    """Paced clients through the proxy, counting every answer by upstream and status."""

    def __init__(self, listen):
        self.host, port = listen.rsplit(":", 1)
        self.port = int(port)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.counts = {}
        self.errors = []
        self.threads = []

    def _record(self, upstream, status):
        with self.lock:
            key = (upstream, status)
            self.counts[key] = self.counts.get(key, 0) + 1

    def _get(self, conn, upstream, path):
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            response.read()
            self._record(upstream, response.status)
            return conn
        except (OSError, http.client.HTTPException) as error:
            with self.lock:
                self.errors.append(f"{upstream} {path}: {error!r}")
            conn.close()
            return http.client.HTTPConnection(self.host, self.port, timeout=10)

    def steady(self, upstream, path, pause):
        """One keep-alive client sending a request, then pausing, until stopped."""

        def run():
            conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
            while not self.stop.is_set():
                conn = self._get(conn, upstream, path)
                time.sleep(pause)
            conn.close()

        self._start(run)

    def bursts(self, upstream, path, clients, pause):
        """`clients` requests released at once, again and again: more than a small cap without a queue takes."""
        barrier = threading.Barrier(clients)

        def run():
            conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
            while not self.stop.is_set():
                try:
                    barrier.wait(timeout=5)
                except threading.BrokenBarrierError:
                    break
                conn = self._get(conn, upstream, path)
                time.sleep(pause)
            barrier.abort()
            conn.close()

        for _ in range(clients):
            self._start(run)

    def _start(self, run):
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)

    def finish(self):
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=15)
        if any(thread.is_alive() for thread in self.threads):
            raise Failed("a client thread did not finish")

    def count(self, upstream, status=None):
        with self.lock:
            return sum(n for (u, s), n in self.counts.items() if u == upstream and (status is None or s == status))


def check(args, browser):
    expected = dict(spec.split("=", 1) for spec in args.upstream)
    browser.open_page(PHONE_WIDTH, 740)
    browser.navigate(f"http://{args.admin}/")

    page = wait_for(
        browser,
        f"every upstream ({', '.join(expected)}) and a live state",
        30,
        lambda p: p["state"] == "live" and set(p["upstreams"]) == set(expected),
    )
    for name in expected:
        if name not in page["upstreams"][name]["heading"] or name not in page["text"]:
            raise Failed(f"upstream {name} is not visibly named: {page['upstreams'][name]['heading']!r}")
    print(f"page: live, shows {', '.join(sorted(page['upstreams']))}")
    if page["version"] in ("", "–") or page["uptime"] in ("", "–") or "start-up, no reload yet" not in page["last_reload"]:
        raise Failed(f"version, uptime or configuration not shown: {page['version']!r}, {page['uptime']!r}, "
                     f"{page['last_reload']!r}")
    print(f"page: version {page['version']}, up {page['uptime']}, configuration {page['last_reload']}")
    for name in expected:
        shown = page["upstreams"][name].get("endpoints", "")
        if ": " not in shown or "connections" not in shown:
            raise Failed(f"upstream {name} shows no endpoint line: {shown!r}")
        print(f"page: {name}'s endpoints: {shown}")
    for name in expected:
        up = page["upstreams"][name]
        for field in ("min_idle", "long_holds_total", "held_while_down_total", "stalls_total", "retry_budget_tokens"):
            if up.get(field, "–") == "–":
                raise Failed(f"upstream {name} shows no {field}: {up.get(field)!r}")
    if args.slow_start and "slow start" not in page["upstreams"][args.slow_start]["endpoints"]:
        raise Failed(f"{args.slow_start}'s ramp is not shown: {page['upstreams'][args.slow_start]['endpoints']!r}")
    if page["viewportWidth"] != PHONE_WIDTH or page["scrollWidth"] > page["viewportWidth"]:
        raise Failed(f"horizontal scroll on a phone: {page['scrollWidth']} px of content, {page['viewportWidth']} px wide")
    print(f"page: {page['scrollWidth']} px wide content in a {page['viewportWidth']} px viewport")
    check_quantiles(browser)
    counters = ("requests_total", "ok", "shed_queue_full")
    before = {(name, c): number(page["upstreams"][name][c]) for name in expected for c in counters}
    if any(value is None for value in before.values()):
        raise Failed(f"counters are not numbers before traffic: {before}")

    traffic = Traffic(args.listen)
    for name, path in expected.items():
        if name == args.shed:
            traffic.bursts(name, path, clients=4, pause=0.05)
        else:
            traffic.steady(name, path, pause=0.02)
            traffic.steady(name, path, pause=0.02)
    try:
        # While requests flow: a rate above zero and a measured queue wait for every upstream.
        during = wait_for(
            browser,
            "requests/s above zero and queue-wait percentiles for every upstream",
            20,
            lambda p: all(
                rate_of(p["upstreams"][name]) > 0
                and p["upstreams"][name]["queue_wait_p50"] != "–"
                and p["upstreams"][name]["queue_wait_p99"] != "–"
                for name in expected
            ),
        )
        # The charts hold the readings taken under load: lines drawn, and the load visible in them.
        charted = wait_for(
            browser,
            "charts with lines for connections, queue, rates and latency, and traffic in them",
            20,
            lambda p: all(charts_show_load(p["upstreams"][name]["charts"]) for name in expected),
        )
        for name in expected:
            shown = charted["upstreams"][name]["charts"]
            print(f"charts, {name}: " + ", ".join(f"{c} {v['points']} points, peak {v['peak']:.4g}" for c, v in shown.items()))
        if args.screenshot:
            # Long enough under load for the charts to have a shape.
            time.sleep(args.screenshot_after)
            screenshot(browser, args.screenshot)
        if args.shed:
            wait_for(
                browser,
                f"requests shed by {args.shed}",
                20,
                lambda p: (number(p["upstreams"][args.shed]["shed_queue_full"]) or 0) > 0,
            )
    finally:
        traffic.finish()
    for name in expected:
        up = during["upstreams"][name]
        print(
            f"during traffic, {name}: {up['requests_per_second']} requests/s, {up['requests_total']} requests, "
            f"queue wait p50 {up['queue_wait_p50']}, p99 {up['queue_wait_p99']}"
        )
    if traffic.errors:
        raise Failed(f"{len(traffic.errors)} requests failed, first: {traffic.errors[0]}")

    # Once traffic stops, the live page must catch up with exactly what was sent and answered.
    def agrees(p):
        for name in expected:
            up = p["upstreams"][name]
            sent = {
                "requests_total": traffic.count(name),
                "ok": traffic.count(name, 200),
                "shed_queue_full": traffic.count(name, 503),
            }
            if any(number(up[c]) != before[(name, c)] + sent[c] for c in counters):
                return False
        return True

    after = wait_for(browser, "counters equal to the requests sent and answered", 10, agrees)
    for name in expected:
        up = after["upstreams"][name]
        print(
            f"after traffic, {name}: page shows {up['requests_total']} requests "
            f"({before[(name, 'requests_total')]} before), "
            f"{up['ok']} answered, {up['shed_queue_full']} shed (queue full); "
            f"the clients saw {traffic.count(name, 200)} x 200 and {traffic.count(name, 503)} x 503"
        )
        if number(up["requests_total"]) <= before[(name, "requests_total")]:
            raise Failed(f"the request counter of {name} did not move")
    if args.shed and traffic.count(args.shed, 503) == 0:
        raise Failed(f"nothing was shed by {args.shed}; the shed counter was not exercised")

    problems = browser.problems()
    if problems:
        raise Failed("the page reported problems:\n  " + "\n  ".join(problems))
    print("page: no script errors, no blocked loads")


CHARTS = ("connections", "queue", "rates", "latency")


def charts_show_load(charts):
    """Every chart has readings and lines drawn; connections, rates and latency rose above zero."""
    if set(charts) != set(CHARTS):
        return False
    if any(charts[c]["points"] < 3 or charts[c]["drawn"] == 0 for c in CHARTS):
        return False
    return all(charts[c]["peak"] > 0 for c in ("connections", "rates", "latency"))


def screenshot(browser, path):
    """The page under load at a desktop width, saved as PNG; then back to the phone the checks use."""
    import base64

    browser.call("Emulation.setDeviceMetricsOverride", {"width": 1000, "height": 640, "deviceScaleFactor": 1, "mobile": False})
    # Two polls at the new width, so the layout and the charts are redrawn.
    time.sleep(2.5)
    shot = browser.call("Page.captureScreenshot", {"format": "png"})
    with open(path, "wb") as out:
        out.write(base64.b64decode(shot["data"]))
    browser.call("Emulation.setDeviceMetricsOverride", {"width": PHONE_WIDTH, "height": 740, "deviceScaleFactor": 2, "mobile": True})
    print(f"page: screenshot under load saved to {path}")


# The page's percentile arithmetic on histograms whose answer is known: (q, older, newer, expected text[, most]).
LE = [0.0001, 0.0002, 0.0004, 0.0008]
QUANTILE_CASES = [
    (0.5, {"count": 0, "cumulative": [0, 0, 0, 0]}, {"count": 0, "cumulative": [0, 0, 0, 0]}, None),
    (0.5, {"count": 0, "cumulative": [0, 0, 0, 0]}, {"count": 10, "cumulative": [10, 10, 10, 10]}, "≤ 100 µs"),
    # Ten waits in (100, 200] µs: the median interpolates to the middle of the bucket.
    (0.5, {"count": 0, "cumulative": [0, 0, 0, 0]}, {"count": 10, "cumulative": [0, 10, 10, 10]}, "150 µs"),
    # Only the difference between readings counts: the ninety waits before the older reading do not.
    (0.5, {"count": 90, "cumulative": [90, 90, 90, 90]}, {"count": 100, "cumulative": [90, 90, 100, 100]}, "300 µs"),
    (0.99, {"count": 0, "cumulative": [0, 0, 0, 0]}, {"count": 100, "cumulative": [98, 98, 98, 98]}, "> 800 µs"),
    # Never past the bound a reading cannot exceed (a queue wait's queue_timeout), interpolation or not.
    (0.99, {"count": 0, "cumulative": [0, 0, 0, 0]}, {"count": 10, "cumulative": [0, 0, 0, 10]}, "500 µs", 0.0005),
    (0.99, {"count": 0, "cumulative": [0, 0, 0, 0]}, {"count": 100, "cumulative": [98, 98, 98, 98]}, "500 µs", 0.0005),
]


def check_quantiles(browser):
    for q, older, newer, expected, *most in QUANTILE_CASES:
        newer = dict(newer, le=LE)
        bound = f", {most[0]}" if most else ""
        got = browser.evaluate(f"quantile({q}, {json.dumps(older)}, {json.dumps(newer)}{bound})")
        if got != expected:
            raise Failed(f"quantile({q}) of {older} -> {newer} shows {got!r}, not {expected!r}")
    print(f"page: queue-wait percentiles right on {len(QUANTILE_CASES)} known histograms")


def rate_of(fields):
    try:
        return float(fields["requests_per_second"].replace(",", ""))
    except ValueError:
        return 0.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--admin", required=True, help="floodgate's admin address, host:port")
    parser.add_argument("--listen", required=True, help="floodgate's client address, host:port")
    parser.add_argument("--upstream", action="append", required=True, help="NAME=PATH routed to it")
    parser.add_argument("--shed", help="the upstream whose cap and queue are small enough to shed bursts")
    parser.add_argument("--slow-start", help="the upstream whose endpoint ramps (slow_start) as the page first loads")
    parser.add_argument("--chromium", default="chromium")
    parser.add_argument("--browser-log", default=os.devnull)
    parser.add_argument("--screenshot", help="save a PNG of the page under load here (desktop width)")
    parser.add_argument("--screenshot-after", type=float, default=20, help="seconds of load before the screenshot")
    args = parser.parse_args()

    # Ended from outside (a CI timeout), the browser is still closed on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    browser = Browser(args.chromium, args.browser_log)
    try:
        check(args, browser)
    except Failed as failure:
        print(f"stats page check FAILED: {failure}", file=sys.stderr)
        return 1
    finally:
        browser.close()
    print("stats page check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
