#!/usr/bin/env bash
# Idle HTTP/2 connections, floodgate against HAProxy side by side, each proxy's RSS with them idle against before.
#
# Upstream connections (the default; docs/benchmarks.md, *gRPC upstream*): 64 tonic callers (examples/grpc_load.rs)
# keep 64 one-stream upstream connections busy for 2 s (the upstream, examples/grpc_upstream.rs, allows one stream
# per connection), then the RSS 1 s later with those connections idle. floodgate: --max-connections 64
# --max-streams-per-connection 1; HAProxy: server maxconn 64, http-reuse always, idle connections kept
# (pool-max-conn -1, pool-purge-delay 60s).
#
# Clients (`clients`; docs/benchmarks.md, *Idle HTTP/2 clients*): CLIENTS h2c connections (prior knowledge) each make
# one request through the proxy (examples/idle_clients.rs --h2, 8 being set up at once) and then stay open, idle; the
# RSS 1 s after the last answer. Both proxies speak HTTP/1.1 to examples/bench_upstream.rs at 0 ms, cap 8, and are
# warmed by one client's request first (so "before" has its upstream connection and buffers).
#
# floodgate --threads 1, HAProxy nbthread 1. Builds what it needs in release; HAProxy is installed by
# benches/e2e/run.sh's set-up. FLOODGATE: the floodgate binary to measure (default: the release build).
#
# Usage: benches/h2_idle.sh [ROUNDS]                       (upstream connections; default 2)
#        benches/h2_idle.sh clients [ROUNDS] [CLIENTS]     (defaults 2 and 3000)
set -euo pipefail
mode=upstream
if [[ ${1:-} == clients ]]; then
  mode=clients
  shift
fi
rounds=${1:-2}
clients=${2:-3000}
repo=$(cd "$(dirname "$0")/.." && pwd)
target=${CARGO_TARGET_DIR:-$repo/target}
(cd "$repo" && cargo build --release --quiet --bin floodgate --example grpc_upstream --example grpc_load \
  --example bench_upstream --example idle_clients)
floodgate=${FLOODGATE:-$target/release/floodgate}
command -v haproxy >/dev/null || { echo "h2_idle: haproxy is not installed (benches/e2e/run.sh installs it)" >&2; exit 2; }
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
rss() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; }
wait_port() { for _ in $(seq 100); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.05; done; return 1; }
# HAProxy asks for twice its maxconn in file descriptors: thousands of idle clients need the hard limit.
ulimit -n "$(ulimit -Hn)"

# Starts the upstream of the mode in the background; its PID in $upstream.
start_upstream() { # PORT CONTROL
  if [[ $mode == upstream ]]; then
    "$target/release/examples/grpc_upstream" --listen "127.0.0.1:$1" --control "127.0.0.1:$2" --max-streams 1 \
      --delay-ms 20 >/dev/null 2>&1 &
  else
    "$target/release/examples/bench_upstream" --listen "127.0.0.1:$1" --control "127.0.0.1:$2" --delay-ms 0 \
      >/dev/null 2>&1 &
  fi
  upstream=$!
}

# Starts the proxy in the background; its PID in $proxy.
start_proxy() { # SUBJECT LISTEN UPSTREAM_PORT
  local server
  if [[ $1 == floodgate ]]; then
    if [[ $mode == upstream ]]; then
      "$floodgate" --listen "127.0.0.1:$2" --admin 127.0.0.1:0 --upstream "http://127.0.0.1:$3" --max-connections 64 \
        --max-streams-per-connection 1 --upstream-protocol http2 --threads 1 --idle-timeout 60s >/dev/null 2>&1 &
    else
      "$floodgate" --listen "127.0.0.1:$2" --admin 127.0.0.1:0 --upstream "http://127.0.0.1:$3" --max-connections 8 \
        --threads 1 >/dev/null 2>&1 &
    fi
    proxy=$!
    return
  fi
  if [[ $mode == upstream ]]; then
    server="server s1 127.0.0.1:$3 proto h2 maxconn 64 pool-max-conn -1 pool-purge-delay 60s"
  else
    server="server s1 127.0.0.1:$3 maxconn 8"
  fi
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
    bind 127.0.0.1:$2 proto h2
    default_backend be
backend be
    http-reuse always
    $server
CFG
  haproxy -db -f "$work/haproxy.cfg" >/dev/null 2>&1 &
  proxy=$!
}

# Makes the mode's connections idle; how many are idle in $idle, the load's PID (to stop later) in $load.
idle_connections() { # LISTEN CONTROL
  load=""
  if [[ $mode == upstream ]]; then
    "$target/release/examples/grpc_load" --target "127.0.0.1:$1" --clients 64 --connections 8 --seconds 2 >/dev/null
    sleep 1
    idle=$(curl -s "http://127.0.0.1:$2/" | python3 -c 'import json,sys; print(json.load(sys.stdin)["connections"]["now"])')
    return
  fi
  "$target/release/examples/idle_clients" --h2 --addr "127.0.0.1:$1" --connections "$clients" --parallel 8 \
    >"$work/idle.out" 2>"$work/idle.err" &
  load=$!
  for _ in $(seq 600); do grep -q '"ready":true' "$work/idle.out" 2>/dev/null && break; sleep 0.1; done
  idle=$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["codes"].get("200", 0))' \
    "$work/idle.out")
  sleep 1
}

what=$([[ $mode == upstream ]] && echo "idle upstream connections" || echo "idle clients")
echo "| subject | round | RSS before KiB | RSS with the connections idle KiB | increment KiB | $what | KiB each |"
echo "|---|---|---|---|---|---|---|"
for round in $(seq "$rounds"); do
  for subject in floodgate haproxy; do
    up=$(free_port) control=$(free_port) listen=$(free_port)
    start_upstream "$up" "$control"
    wait_port "$up"
    start_proxy "$subject" "$listen" "$up"
    wait_port "$listen"
    if [[ $mode == clients ]]; then
      "$target/release/examples/idle_clients" --h2 --addr "127.0.0.1:$listen" --connections 1 >/dev/null 2>&1 &
      sleep 0.5
      kill $! 2>/dev/null || true
      wait $! 2>/dev/null || true
    fi
    before=$(rss "$proxy")
    idle_connections "$listen" "$control"
    after=$(rss "$proxy")
    per=$(python3 -c "print(round(($after - $before) / max($idle, 1), 2))")
    echo "| $subject | $round | $before | $after | $((after - before)) | $idle | $per |"
    kill $load "$proxy" "$upstream" 2>/dev/null || true
    wait $load "$proxy" "$upstream" 2>/dev/null || true
  done
done
