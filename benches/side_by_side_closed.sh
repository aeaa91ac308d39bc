#!/usr/bin/env bash
# Two floodgate binaries side by side in a closed loop, where the proxy is the bottleneck: 2xx/s and CPU-µs per
# response of each, alternating, in one run. The proxy-bound counterpart of benches/side_by_side.sh (fixed rate).
#
#   benches/side_by_side_closed.sh OLD_BINARY NEW_BINARY [REPS] [DELAY_MS] [CLIENTS] [THREADS]
#
# bench_upstream (cargo build --release --examples) answers after DELAY_MS (0); wrk (apt-get install wrk) runs CLIENTS
# (200) connections on 2 threads for 8 s after a 2 s warm-up; the proxy runs `--threads THREADS` (1) with a cap of 8.
set -euo pipefail
old=$1
new=$2
reps=${3:-3}
delay=${4:-0}
clients=${5:-200}
threads=${6:-1}
target=${CARGO_TARGET_DIR:-$(dirname "$0")/../target}
upstream="$target/release/examples/bench_upstream"
[ -x "$upstream" ] || { echo "build it first: cargo build --release --examples" >&2; exit 2; }
command -v wrk >/dev/null || { echo "needs wrk: apt-get install wrk" >&2; exit 2; }
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
up_port=$(port); ctl_port=$(port)
"$upstream" --listen "127.0.0.1:$up_port" --control "127.0.0.1:$ctl_port" --delay-ms "$delay" >/dev/null 2>&1 &
up_pid=$!
trap 'kill $up_pid 2>/dev/null || true' EXIT
sleep 0.5
tck=$(getconf CLK_TCK)
for rep in $(seq 1 "$reps"); do
  for which in old new; do
    binary=$old
    [ "$which" = new ] && binary=$new
    listen=$(port); admin=$(port)
    "$binary" --listen "127.0.0.1:$listen" --admin "127.0.0.1:$admin" --upstream "http://127.0.0.1:$up_port" \
      --max-connections 8 --threads "$threads" >/dev/null 2>&1 &
    pid=$!
    sleep 0.7
    wrk -t2 -c"$clients" -d2s "http://127.0.0.1:$listen/" >/dev/null 2>&1
    before=$(awk '{print $14+$15}' "/proc/$pid/stat")
    measured=$(wrk -t2 -c"$clients" -d8s "http://127.0.0.1:$listen/" 2>&1)
    after=$(awk '{print $14+$15}' "/proc/$pid/stat")
    responses=$(echo "$measured" | awk '/requests in/{print $1}')
    rate=$(echo "$measured" | awk '/Requests\/sec/{print $2}')
    per=$(python3 -c "print(round(($after-$before)*1e6/$tck/max(${responses:-0},1),1))")
    echo "rep $rep $which rps=${rate:-0} cpu_us_per_response=$per"
    kill "$pid"
    wait "$pid" 2>/dev/null || true
  done
done
