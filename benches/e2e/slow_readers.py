#!/usr/bin/env python3
"""Slow readers for the slow-readers scenario: M HTTP/1.1 clients that ask for a body and read it at a crawl.

Usage: python3 slow_readers.py HOST:PORT M RCVBUF BYTES_PER_SEC OUT.json [PATH]
Opens M connections, each with SO_RCVBUF = RCVBUF set before connecting (so the kernel keeps little of the answer
for it), sends `GET PATH HTTP/1.1` on each (PATH: / by default), then every second reads at most BYTES_PER_SEC bytes from each (non-blocking)
until SIGTERM/SIGINT. A connection whose response ends (it read Content-Length bytes of body) or that the peer
closes sends its next request / reconnects, so M requests are always outstanding. On exit writes OUT.json:
  {"readers", "rcvbuf", "bytes_per_sec", "bytes_read", "responses_completed", "reconnects", "connect_errors"}
and prints "slow readers ready" once every connection has sent its first request. Standard library only.
"""

import json
import signal
import socket
import sys
import time


class Reader:
    def __init__(self, host, port, rcvbuf, path):
        self.addr = (host, port)
        self.path = path
        self.rcvbuf = rcvbuf
        self.sock = None
        self.buf = b""
        self.body_left = None  # bytes of body still to read once the head is in; None: head not read yet

    def connect(self):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
        s.settimeout(5)
        s.connect(self.addr)
        s.setblocking(False)
        self.sock = s
        self.request()

    def request(self):
        self.sock.sendall(b"GET " + self.path.encode() + b" HTTP/1.1\r\nHost: bench\r\nUser-Agent: slow-reader\r\n\r\n")
        self.buf = b""
        self.body_left = None

    def read(self, budget):
        """Reads up to budget bytes; returns (bytes read, responses completed, closed)."""
        got, done = 0, 0
        while got < budget:
            try:
                chunk = self.sock.recv(budget - got)
            except BlockingIOError:
                break
            except OSError:
                return got, done, True
            if not chunk:
                return got, done, True
            got += len(chunk)
            if self.body_left is None:
                self.buf += chunk
                head, sep, rest = self.buf.partition(b"\r\n\r\n")
                if not sep:
                    continue
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    k, _, v = line.partition(b":")
                    if k.strip().lower() == b"content-length":
                        length = int(v.strip())
                self.body_left = length - len(rest)
            else:
                self.body_left -= len(chunk)
            if self.body_left is not None and self.body_left <= 0:
                done += 1
                self.request()
        return got, done, False


def main():
    target, m, rcvbuf, rate, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    path = sys.argv[6] if len(sys.argv) > 6 else "/"
    host, _, port = target.rpartition(":")
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    stats = {"readers": m, "rcvbuf": rcvbuf, "bytes_per_sec": rate, "bytes_read": 0, "responses_completed": 0,
             "reconnects": 0, "connect_errors": 0}
    readers = []
    for _ in range(m):
        r = Reader(host, int(port), rcvbuf, path)
        try:
            r.connect()
        except OSError:
            stats["connect_errors"] += 1
        readers.append(r)
    print("slow readers ready", flush=True)
    while not stop:
        t = time.monotonic()
        for r in readers:
            if r.sock is None:
                continue
            got, done, closed = r.read(rate)
            stats["bytes_read"] += got
            stats["responses_completed"] += done
            if closed:
                r.sock.close()
                stats["reconnects"] += 1
                try:
                    r.connect()
                except OSError:
                    stats["connect_errors"] += 1
                    r.sock = None
        while not stop and time.monotonic() < t + 1:
            time.sleep(0.05)
    for r in readers:
        if r.sock is not None:
            r.sock.close()
    with open(out, "w") as f:
        json.dump(stats, f)


if __name__ == "__main__":
    main()
