#!/usr/bin/env bash
# Memory given back after floods: floodgate's RSS while N idle clients are connected, then 1 s and 5 s after they
# have all left, for several rounds in a row (docs/memory.md). Builds floodgate and the example clients/upstream in
# release, uses free loopback ports, stops what it started.
#
# Usage: benches/memory_return.sh [-n CLIENTS] [-r ROUNDS] [-b BINARY] [-p BYTES]
#   -n CLIENTS  idle clients per round (each makes one request, then stays connected)   [8000]
#   -r ROUNDS   floods in a row                                                          [4]
#   -b BINARY   a floodgate binary to measure instead of this checkout's (to compare builds)
#   -p BYTES    pad each client's one request head with this many bytes (a large head, then idle)    [0]
set -euo pipefail
clients=8000 rounds=4 binary="" pad=0
while getopts "n:r:b:p:h" opt; do
  case $opt in
    n) clients=$OPTARG ;;
    r) rounds=$OPTARG ;;
    b) binary=$OPTARG ;;
    p) pad=$OPTARG ;;
    *) sed -n '2,10p' "$0"; exit 0 ;;
  esac
done
repo=$(cd "$(dirname "$0")/.." && pwd)
target=${CARGO_TARGET_DIR:-$repo/target}
(cd "$repo" && cargo build --release --quiet --bin floodgate --example bench_upstream --example idle_clients)
binary=${binary:-$target/release/floodgate}
ulimit -n "$(ulimit -Hn)"
((clients + 500 <= $(ulimit -n))) || { echo "memory_return: $clients clients need more file descriptors than $(ulimit -n)" >&2; exit 2; }

work=$(mktemp -d)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
wait_for() { # FILE PATTERN
  for _ in $(seq 1 100); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  echo "memory_return: no '$2' in $1" >&2; cat "$1" >&2; exit 1
}

"$target/release/examples/bench_upstream" --delay-ms 0 >"$work/upstream.out" 2>&1 &
pids+=($!)
wait_for "$work/upstream.out" "upstream ready"
upstream=$(sed -n 's/.* listen=\([^ ]*\).*/\1/p' "$work/upstream.out")
"$binary" --listen 127.0.0.1:0 --admin 127.0.0.1:0 --upstream "http://$upstream" --max-connections 8 \
  --threads 1 >"$work/floodgate.out" 2>"$work/floodgate.err" &
proxy=$!
pids+=($proxy)
wait_for "$work/floodgate.out" "floodgate ready"
listen=$(sed -n 's/.* listen=\([^ ]*\) .*/\1/p' "$work/floodgate.out")
rss() { awk '/^VmRSS/ { printf "%.1f", $2 / 1024 }' "/proc/$proxy/status"; }

echo "floodgate: $binary ($("$binary" --version 2>/dev/null || echo '?')), $clients idle clients per round"
echo "start: $(rss) MiB"
echo "| round | RSS with the clients, MiB | 1 s after they left | 5 s after |"
echo "|---|---|---|---|"
for round in $(seq 1 "$rounds"); do
  "$target/release/examples/idle_clients" --addr "$listen" --connections "$clients" --parallel 64 --pad-bytes "$pad" >"$work/idle.out" 2>&1 &
  idle=$!
  wait_for "$work/idle.out" '"ready":true'
  held=$(rss)
  kill "$idle"; wait "$idle" 2>/dev/null || true
  sleep 1; after1=$(rss)
  sleep 4; after5=$(rss)
  echo "| $round | $held | $after1 | $after5 |"
done
