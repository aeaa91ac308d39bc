#!/usr/bin/env bash
# Idle HTTP/2 upstream connections, floodgate against HAProxy side by side (docs/benchmarks.md, *gRPC upstream*):
# 64 tonic callers (examples/grpc_load.rs) keep 64 one-stream upstream connections busy for 2 s (the upstream,
# examples/grpc_upstream.rs, allows one stream per connection), then the proxy's RSS is read 1 s later with those
# connections idle, against its RSS before the load. floodgate: --max-connections 64 --max-streams-per-connection 1;
# HAProxy: server maxconn 64, http-reuse always, idle connections kept (pool-max-conn -1, pool-purge-delay 60s).
# Builds what it needs in release; HAProxy is installed by benches/e2e/run.sh's set-up.
#
# Usage: benches/h2_idle.sh [ROUNDS]
set -euo pipefail
rounds=${1:-2}
repo=$(cd "$(dirname "$0")/.." && pwd)
target=${CARGO_TARGET_DIR:-$repo/target}
(cd "$repo" && cargo build --release --quiet --bin floodgate --example grpc_upstream --example grpc_load)
command -v haproxy >/dev/null || { echo "h2_idle: haproxy is not installed (benches/e2e/run.sh installs it)" >&2; exit 2; }
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
rss() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; }
wait_port() { for _ in $(seq 100); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.05; done; return 1; }
echo "| subject | round | RSS before KiB | RSS with the connections idle KiB | increment KiB | idle upstream connections | KiB per idle connection |"
echo "|---|---|---|---|---|---|---|"
for round in $(seq "$rounds"); do
  for subject in floodgate haproxy; do
    up=$(free_port) control=$(free_port) listen=$(free_port)
    "$target/release/examples/grpc_upstream" --listen "127.0.0.1:$up" --control "127.0.0.1:$control" --max-streams 1 \
      --delay-ms 20 >/dev/null 2>&1 &
    upstream=$!
    wait_port "$up"
    if [[ $subject == floodgate ]]; then
      "$target/release/floodgate" --listen "127.0.0.1:$listen" --admin 127.0.0.1:0 --upstream "http://127.0.0.1:$up" \
        --max-connections 64 --max-streams-per-connection 1 --upstream-protocol http2 --threads 1 --idle-timeout 60s \
        >/dev/null 2>&1 &
    else
      cat >"$work/haproxy.cfg" <<CFG
global
    nbthread 1
    maxconn 4000
defaults
    mode http
    maxconn 4000
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
    server s1 127.0.0.1:$up proto h2 maxconn 64 pool-max-conn -1 pool-purge-delay 60s
CFG
      haproxy -db -f "$work/haproxy.cfg" >/dev/null 2>&1 &
    fi
    proxy=$!
    wait_port "$listen"
    before=$(rss "$proxy")
    "$target/release/examples/grpc_load" --target "127.0.0.1:$listen" --clients 64 --connections 8 --seconds 2 >/dev/null
    sleep 1
    after=$(rss "$proxy")
    idle=$(curl -s "http://127.0.0.1:$control/" | python3 -c 'import json,sys; print(json.load(sys.stdin)["connections"]["now"])')
    per=$(python3 -c "print(round(($after - $before) / max($idle, 1), 1))")
    echo "| $subject | $round | $before | $after | $((after - before)) | $idle | $per |"
    kill "$proxy" "$upstream"; wait "$proxy" "$upstream" 2>/dev/null || true
  done
done
