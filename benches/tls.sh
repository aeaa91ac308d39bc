#!/usr/bin/env bash
# HTTPS clients over HTTP/1.1, side by side for floodgate binaries (one run each, in turn): throughput and CPU-µs per
# response of a closed loop of keep-alive TLS clients, then the memory each idle TLS client costs. The upstream
# (bench_upstream) answers at once over plain HTTP; the listener's certificate is a throwaway self-signed one.
#
#   benches/tls.sh BINARY... [-- CLIENTS SECONDS IDLE]   (defaults 32 8 2000)
#
# Needs oha (cargo install oha), openssl and python3; bench_upstream (cargo build --release --examples). CPU is the
# proxy's user + system ticks over the run, from /proc/PID/stat; idle cost is the proxy's RSS with IDLE kept-alive
# TLS clients (each has made one request) less its RSS before, over IDLE.
set -euo pipefail
binaries=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do binaries+=("$1"); shift; done
[ $# -gt 0 ] && shift
clients=${1:-32}
seconds=${2:-8}
idle=${3:-2000}
[ ${#binaries[@]} -gt 0 ] || { sed -n '2,10p' "$0" >&2; exit 2; }
target=${CARGO_TARGET_DIR:-$(dirname "$0")/../target}
upstream="$target/release/examples/bench_upstream"
[ -x "$upstream" ] || { echo "build it first: cargo build --release --examples" >&2; exit 2; }
for tool in oha openssl python3; do
  command -v "$tool" >/dev/null || { echo "needs $tool (see the header of $0)" >&2; exit 2; }
done
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
work=$(mktemp -d)
up_port=$(port); ctl_port=$(port)
"$upstream" --listen "127.0.0.1:$up_port" --control "127.0.0.1:$ctl_port" --delay-ms 0 >/dev/null 2>&1 &
up_pid=$!
trap 'kill $up_pid 2>/dev/null || true; rm -rf "$work"' EXIT
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj /CN=localhost \
  -keyout "$work/key.pem" -out "$work/cert.pem" >/dev/null 2>&1
ulimit -n 65536 2>/dev/null || true
tick=$(getconf CLK_TCK)
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
rss_kib() { awk '/^VmRSS/{print $2}' "/proc/$1/status"; }

for binary in "${binaries[@]}"; do
  listen=$(port); admin=$(port)
  "$binary" --listen "127.0.0.1:$listen" --admin "127.0.0.1:$admin" --upstream "http://127.0.0.1:$up_port" \
    --max-connections 64 --threads 1 --config <(printf 'tls_cert = "%s"\ntls_key = "%s"\nlog_level = "warn"\n%s\n' \
      "$work/cert.pem" "$work/key.pem" "max_client_connections = $((idle + 100))") >"$work/log" 2>&1 &
  pid=$!
  for _ in $(seq 1 100); do
    curl -fs "http://127.0.0.1:$admin/healthz" >/dev/null 2>&1 && break
    kill -0 "$pid" 2>/dev/null || { echo "$binary did not start:" >&2; cat "$work/log" >&2; exit 1; }
    sleep 0.1
  done
  oha -z 1s -c "$clients" --insecure --no-tui "https://localhost:$listen/" >/dev/null 2>&1
  before=$(ticks "$pid")
  oha -z "${seconds}s" -c "$clients" --insecure --no-tui --output-format json "https://localhost:$listen/" >"$work/oha.json" 2>/dev/null
  after=$(ticks "$pid")
  rss_before=$(rss_kib "$pid")
  rss_idle=$(python3 - "$listen" "$idle" "$pid" <<'EOF'
import socket, ssl, sys
port, count, pid = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
context = ssl.create_default_context()
context.check_hostname = False
context.verify_mode = ssl.CERT_NONE
context.set_alpn_protocols(["http/1.1"])
held = []
for _ in range(count):
    conn = context.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="localhost")
    conn.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
    got = b""
    while b"\r\n\r\n" not in got:
        got += conn.recv(4096)
    held.append(conn)
with open(f"/proc/{pid}/status") as status:
    print(next(line.split()[1] for line in status if line.startswith("VmRSS")))
EOF
)
  kill -TERM "$pid"; wait "$pid" 2>/dev/null || true
  python3 - "$binary" "$work/oha.json" "$before" "$after" "$tick" "$rss_before" "$rss_idle" "$idle" <<'EOF'
import json, sys
binary, path, before, after, tick, rss_before, rss_idle, idle = sys.argv[1:]
summary = json.load(open(path))
ok = summary.get("statusCodeDistribution", {}).get("200", 0)
cpu_us = (int(after) - int(before)) / int(tick) * 1e6
per_idle = (int(rss_idle) - int(rss_before)) / int(idle)
print(f"{binary} responses_per_s={summary['summary']['requestsPerSec']:.0f} ok={ok} "
      f"cpu_us_per_response={cpu_us / max(ok, 1):.1f} idle_tls_client_kib={per_idle:.1f}")
EOF
done
