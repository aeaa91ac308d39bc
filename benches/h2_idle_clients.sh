#!/usr/bin/env bash
# Idle HTTP/2 clients (h2c, prior knowledge), floodgate against HAProxy side by side (docs/benchmarks.md, *Idle
# clients*): CLIENTS connections each make one request through the proxy (examples/idle_clients.rs --h2, 8 being
# set up at once) and then stay open, idle; each proxy's RSS 1 s after the last answer against its RSS before them,
# over CLIENTS. The upstream is examples/bench_upstream.rs at 0 ms, spoken to in HTTP/1.1 by both proxies; both are
# warmed by the same 200 requests on one h2c connection first (so "before" has its upstream connections and buffers).
# floodgate: --threads 1, cap 8; HAProxy: nbthread 1, `bind … proto h2`, server maxconn 8. Builds what it needs in
# release; HAProxy is installed by benches/e2e/run.sh's set-up.
#
# Usage: benches/h2_idle_clients.sh [ROUNDS] [CLIENTS]   (defaults 2 and 3000)
# FLOODGATE: the floodgate binary to measure (default: the release build).
set -euo pipefail
rounds=${1:-2}
clients=${2:-3000}
repo=$(cd "$(dirname "$0")/.." && pwd)
target=${CARGO_TARGET_DIR:-$repo/target}
(cd "$repo" && cargo build --release --quiet --bin floodgate --example bench_upstream --example idle_clients)
floodgate=${FLOODGATE:-$target/release/floodgate}
command -v haproxy >/dev/null || { echo "h2_idle_clients: haproxy is not installed (benches/e2e/run.sh installs it)" >&2; exit 2; }
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
rss() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; }
wait_port() { for _ in $(seq 100); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.05; done; return 1; }
ulimit -n 20000
echo "| subject | round | RSS before KiB | RSS with the clients idle KiB | increment KiB | idle clients | KiB per idle client |"
echo "|---|---|---|---|---|---|---|"
for round in $(seq "$rounds"); do
  for subject in floodgate haproxy; do
    up=$(free_port) control=$(free_port) listen=$(free_port)
    "$target/release/examples/bench_upstream" --listen "127.0.0.1:$up" --control "127.0.0.1:$control" --delay-ms 0 \
      >/dev/null 2>&1 &
    upstream=$!
    wait_port "$up"
    if [[ $subject == floodgate ]]; then
      "$floodgate" --listen "127.0.0.1:$listen" --admin 127.0.0.1:0 --upstream "http://127.0.0.1:$up" \
        --max-connections 8 --threads 1 >/dev/null 2>&1 &
    else
      cat >"$work/haproxy.cfg" <<CFG
global
    nbthread 1
    maxconn 8000
defaults
    mode http
    maxconn 8000
    timeout connect 2s
    timeout client 60s
    timeout server 60s
    timeout http-keep-alive 60s
    timeout queue 5s
frontend fe
    bind 127.0.0.1:$listen proto h2
    default_backend be
backend be
    http-reuse always
    server s1 127.0.0.1:$up maxconn 8
CFG
      haproxy -db -f "$work/haproxy.cfg" >/dev/null 2>&1 &
    fi
    proxy=$!
    wait_port "$listen"
    "$target/release/examples/idle_clients" --h2 --addr "127.0.0.1:$listen" --connections 1 >/dev/null 2>&1 &
    warm=$!
    sleep 0.5
    kill "$warm" 2>/dev/null || true
    wait "$warm" 2>/dev/null || true
    sleep 0.5
    before=$(rss "$proxy")
    "$target/release/examples/idle_clients" --h2 --addr "127.0.0.1:$listen" --connections "$clients" --parallel 8 \
      >"$work/idle.out" 2>"$work/idle.err" &
    idle=$!
    for _ in $(seq 600); do grep -q '"ready":true' "$work/idle.out" 2>/dev/null && break; sleep 0.1; done
    answered=$(python3 -c 'import json,sys; d=json.loads(open(sys.argv[1]).readline()); print(d["codes"].get("200", 0))' "$work/idle.out")
    sleep 1
    after=$(rss "$proxy")
    per=$(python3 -c "print(round(($after - $before) / max($answered, 1), 2))")
    echo "| $subject | $round | $before | $after | $((after - before)) | $answered | $per |"
    kill "$idle" "$proxy" "$upstream"; wait "$idle" "$proxy" "$upstream" 2>/dev/null || true
  done
done
