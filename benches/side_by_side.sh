#!/usr/bin/env bash
# Two floodgate binaries side by side at a fixed request rate: CPU-µs per response of each, alternating, in one run.
# For a change's cost on the hot path where the machine's noise would hide it between separate runs.
#
#   benches/side_by_side.sh OLD_BINARY NEW_BINARY [REPS] [RATE] [DELAY_MS] [THREADS]
#
# bench_upstream (cargo build --release --examples) answers after DELAY_MS (2); oha (cargo install oha) sends RATE
# requests a second (1000) over 50 connections for 8 s after a 1 s warm-up; the proxy runs `--threads THREADS` (1)
# with a cap of 8. Prints one line per run: the responses and the proxy's user + system CPU per response.
set -euo pipefail
old=$1
new=$2
reps=${3:-3}
rate=${4:-1000}
delay=${5:-2}
threads=${6:-1}
target=${CARGO_TARGET_DIR:-$(dirname "$0")/../target}
upstream="$target/release/examples/bench_upstream"
[ -x "$upstream" ] || { echo "build it first: cargo build --release --examples" >&2; exit 2; }
command -v oha >/dev/null || { echo "needs oha: cargo install oha" >&2; exit 2; }
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
up_port=$(port); ctl_port=$(port)
"$upstream" --listen "127.0.0.1:$up_port" --control "127.0.0.1:$ctl_port" --delay-ms "$delay" >/dev/null 2>&1 &
up_pid=$!
trap 'kill $up_pid 2>/dev/null || true' EXIT
sleep 0.5
tck=$(getconf CLK_TCK)
out=$(mktemp)
for rep in $(seq 1 "$reps"); do
  for which in old new; do
    binary=$old
    [ "$which" = new ] && binary=$new
    listen=$(port); admin=$(port)
    "$binary" --listen "127.0.0.1:$listen" --admin "127.0.0.1:$admin" --upstream "http://127.0.0.1:$up_port" \
      --max-connections 8 --threads "$threads" >/dev/null 2>&1 &
    pid=$!
    sleep 0.7
    oha -z 1s -q "$rate" -c 50 --no-tui "http://127.0.0.1:$listen/" >/dev/null 2>&1
    before=$(awk '{print $14+$15}' "/proc/$pid/stat")
    oha -z 8s -q "$rate" -c 50 --no-tui "http://127.0.0.1:$listen/" >"$out" 2>&1
    after=$(awk '{print $14+$15}' "/proc/$pid/stat")
    responses=$(awk '/^ *\[200\]/{print $2}' "$out")
    per=$(python3 -c "print(round(($after-$before)*1e6/$tck/max(${responses:-0},1),1))")
    echo "rep $rep $which responses=${responses:-0} cpu_us_per_response=$per"
    kill "$pid"
    wait "$pid" 2>/dev/null || true
  done
done
rm -f "$out"
