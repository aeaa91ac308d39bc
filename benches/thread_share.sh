#!/usr/bin/env bash
# How floodgate's CPU spreads over its threads under capacity load: each thread's share of the process's CPU
# (user + system ticks from /proc/PID/task/*/stat over the load), the busiest first, and how many carry more than
# 5 %. A serial part shows as one thread whose share does not fall as --threads rises.
#
#   benches/thread_share.sh BINARY [THREADS [SECONDS [CLIENTS [CAP]]]]   (defaults 2 6 200 64)
#
# Needs wrk (installed with apt-get when missing) and bench_upstream (cargo build --release --examples), which
# answers at once.
set -euo pipefail
binary=${1:?usage: $0 BINARY [THREADS [SECONDS [CLIENTS [CAP]]]]}
threads=${2:-2}
seconds=${3:-6}
clients=${4:-200}
cap=${5:-64}
target=${CARGO_TARGET_DIR:-$(dirname "$0")/../target}
upstream="$target/release/examples/bench_upstream"
[ -x "$upstream" ] || { echo "build it first: cargo build --release --examples" >&2; exit 2; }
if ! command -v wrk >/dev/null; then
  command -v apt-get >/dev/null || { echo "needs wrk" >&2; exit 2; }
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null
fi
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
up_port=$(port); ctl_port=$(port); listen=$(port); admin=$(port)
work=$(mktemp -d)
"$upstream" --listen "127.0.0.1:$up_port" --control "127.0.0.1:$ctl_port" --delay-ms 0 >/dev/null 2>&1 &
up_pid=$!
FLOODGATE__LOG_LEVEL=warn "$binary" --listen "127.0.0.1:$listen" --admin "127.0.0.1:$admin" --upstream "http://127.0.0.1:$up_port" \
  --max-connections "$cap" --max-queue 10000 --threads "$threads" >"$work/log" 2>&1 &
pid=$!
trap 'kill $pid $up_pid 2>/dev/null || true; rm -rf "$work"' EXIT
for _ in $(seq 1 100); do
  curl -fs "http://127.0.0.1:$admin/healthz" >/dev/null 2>&1 && break
  sleep 0.1
done
# utime + stime of every thread: fields 14 and 15 after the command name (which may hold spaces).
ticks() {
  for stat in /proc/"$pid"/task/*/stat; do
    python3 - "$stat" <<'EOF'
import sys
text = open(sys.argv[1]).read()
name = text[text.index("(") + 1:text.rindex(")")]
fields = text[text.rindex(")") + 2:].split()
print(sys.argv[1].split("/")[4], name.replace(" ", "_"), int(fields[11]) + int(fields[12]))
EOF
  done
}
wrk -t 2 -c "$clients" -d "$((seconds + 2))s" "http://127.0.0.1:$listen/" >"$work/load" 2>&1 &
load=$!
sleep 1
ticks >"$work/before"
sleep "$seconds"
ticks >"$work/after"
wait "$load" || true
python3 - "$work/before" "$work/after" "$work/load" "$threads" <<'EOF'
import re, sys
def read(path):
    return {tid: (name, int(t)) for tid, name, t in (line.split() for line in open(path))}
before, after = read(sys.argv[1]), read(sys.argv[2])
used = {tid: (name, t - before.get(tid, (name, 0))[1]) for tid, (name, t) in after.items()}
total = sum(t for _, t in used.values()) or 1
rows = sorted(used.values(), key=lambda row: -row[1])
rate = re.search(r"Requests/sec:\s*([\d.]+)", open(sys.argv[3]).read())
print(f"--threads {sys.argv[4]}: {rate.group(1) if rate else '?'} req/s, {total} ticks")
for name, t in rows[:6]:
    print(f"  {name:24} {100 * t / total:5.1f} %")
print(f"  threads over 5 %: {sum(1 for _, t in rows if t > 0.05 * total)}")
EOF
