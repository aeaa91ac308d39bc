#!/usr/bin/env bash
# floodgate binaries side by side, alternating in one run: CPU-µs per response of each, its RSS at the end of the
# load (and 2xx/s in a closed loop). For a change's cost on the hot path where the machine's noise would hide it
# between separate runs.
#
#   benches/side_by_side.sh BINARY BINARY... [REPS] [LOAD] [DELAY_MS] [THREADS]
#
# The binaries come first (paths to executables: OLD NEW, or several to compare); REPS rounds (3) each run every
# binary once. LOAD is a request rate (1000: oha sends that many requests a second over 50 connections; cargo
# install oha) or closed:CLIENTS (wrk, CLIENTS connections on 2 threads with no pause, where the proxy is the
# bottleneck when DELAY_MS is 0; apt-get install wrk). bench_upstream (cargo build --release --examples) answers
# after DELAY_MS (2); each run measures 8 s after a warm-up; the proxy runs `--threads THREADS` (1) with a cap of 8.
# Prints one line per run.
set -euo pipefail
binaries=()
while [ $# -gt 0 ] && [ -f "$1" ] && [ -x "$1" ]; do binaries+=("$1"); shift; done
[ ${#binaries[@]} -ge 1 ] || { sed -n '2,13p' "$0" >&2; exit 2; }
reps=${1:-3}
load=${2:-1000}
delay=${3:-2}
threads=${4:-1}
target=${CARGO_TARGET_DIR:-$(dirname "$0")/../target}
upstream="$target/release/examples/bench_upstream"
[ -x "$upstream" ] || { echo "build it first: cargo build --release --examples" >&2; exit 2; }
case $load in
  closed:*) clients=${load#closed:}; tool=wrk ;;
  *) tool=oha ;;
esac
command -v "$tool" >/dev/null || { echo "needs $tool (see the header of $0)" >&2; exit 2; }
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
up_port=$(port); ctl_port=$(port)
"$upstream" --listen "127.0.0.1:$up_port" --control "127.0.0.1:$ctl_port" --delay-ms "$delay" >/dev/null 2>&1 &
up_pid=$!
trap 'kill $up_pid 2>/dev/null || true' EXIT
sleep 0.5
tck=$(getconf CLK_TCK)
out=$(mktemp)
# Drives `seconds` of load at the proxy on `listen`; leaves the tool's report in $out.
drive() {
  local listen=$1 seconds=$2
  if [ "$tool" = wrk ]; then
    wrk -t2 -c"$clients" -d"${seconds}s" "http://127.0.0.1:$listen/" >"$out" 2>&1
  else
    oha -z "${seconds}s" -q "$load" -c 50 --no-tui "http://127.0.0.1:$listen/" >"$out" 2>&1
  fi
}
for rep in $(seq 1 "$reps"); do
  for binary in "${binaries[@]}"; do
    listen=$(port); admin=$(port)
    "$binary" --listen "127.0.0.1:$listen" --admin "127.0.0.1:$admin" --upstream "http://127.0.0.1:$up_port" \
      --max-connections 8 --threads "$threads" >/dev/null 2>&1 &
    pid=$!
    sleep 0.7
    drive "$listen" 2
    before=$(awk '{print $14+$15}' "/proc/$pid/stat")
    drive "$listen" 8
    after=$(awk '{print $14+$15}' "/proc/$pid/stat")
    rss=$(awk '/^VmRSS/{printf "%.1f", $2/1024}' "/proc/$pid/status")
    if [ "$tool" = wrk ]; then
      responses=$(awk '/requests in/{print $1}' "$out")
      rate=" rps=$(awk '/Requests\/sec/{print $2}' "$out")"
    else
      responses=$(awk '/^ *\[200\]/{print $2}' "$out")
      rate=""
    fi
    per=$(python3 -c "print(round(($after-$before)*1e6/$tck/max(${responses:-0},1),1))")
    echo "rep $rep $binary responses=${responses:-0}$rate cpu_us_per_response=$per rss_mb=$rss"
    kill "$pid"
    wait "$pid" 2>/dev/null || true
  done
done
rm -f "$out"
