#!/usr/bin/env bash
# System calls, context switches and CPU time per response, counted by the kernel (perf stat on the proxy's PID),
# for floodgate binaries and HAProxy side by side in one run: where a proxy's time goes that instruction counts
# (benches/instructions.sh) do not see. Each subject serves the same load in turn; REPS rounds.
#
#   benches/syscalls.sh SUBJECT... [-- LOAD CAP DELAY_MS REPS]   (defaults 1000 8 2 2)
#
# A SUBJECT is a floodgate binary (run with --threads 1) or the word `haproxy` (nbthread 1, http-reuse always,
# server maxconn CAP), or `haproxy-headers`: that HAProxy also doing floodgate's default header work
# (benches/haproxy_headers.cfg); both from benches/haproxy_subject.sh. LOAD is a request rate (oha, 50
# connections) or closed:CLIENTS (wrk -t2, no pause).
# bench_upstream (cargo build --release --examples) answers after DELAY_MS. Each run: 2 s of warm-up, then 6 s
# counted. Needs perf (apt-get install linux-perf), oha (cargo install oha) or wrk, and haproxy for that subject.
set -euo pipefail
# shellcheck source=benches/haproxy_subject.sh
source "$(dirname "$0")/haproxy_subject.sh"
subjects=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do subjects+=("$1"); shift; done
[ $# -gt 0 ] && shift
load=${1:-1000}
cap=${2:-8}
delay=${3:-2}
reps=${4:-2}
[ ${#subjects[@]} -gt 0 ] || { sed -n '2,13p' "$0" >&2; exit 2; }
target=${CARGO_TARGET_DIR:-$(dirname "$0")/../target}
upstream="$target/release/examples/bench_upstream"
[ -x "$upstream" ] || { echo "build it first: cargo build --release --examples" >&2; exit 2; }
command -v perf >/dev/null || { echo "needs perf (see the header of $0)" >&2; exit 2; }
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
work=$(mktemp -d)
up_port=$(port); ctl_port=$(port)
"$upstream" --listen "127.0.0.1:$up_port" --control "127.0.0.1:$ctl_port" --delay-ms "$delay" >/dev/null 2>&1 &
up_pid=$!
trap 'kill $up_pid 2>/dev/null || true; rm -rf "$work"' EXIT
sleep 0.5

# Drives `seconds` of load at `listen`; the tool's report in $work/load.
drive() {
  local listen=$1 seconds=$2
  case $load in
    closed:*) wrk -t2 -c"${load#closed:}" -d"${seconds}s" "http://127.0.0.1:$listen/" >"$work/load" 2>&1 ;;
    *) oha -z "${seconds}s" -q "$load" -c 50 --no-tui "http://127.0.0.1:$listen/" >"$work/load" 2>&1 ;;
  esac
}

responses() {
  case $load in
    closed:*) awk '/requests in/{print $1}' "$work/load" ;;
    *) awk '/^ *\[200\]/{print $2}' "$work/load" ;;
  esac
}

start() { # SUBJECT LISTEN: starts it in the background
  local subject=$1 listen=$2
  if [ "$subject" = haproxy ] || [ "$subject" = haproxy-headers ]; then
    write_haproxy_cfg "$work/haproxy.cfg" "$subject" "$listen" "$up_port" "$cap"
    haproxy -db -f "$work/haproxy.cfg" >/dev/null 2>&1 &
  else
    "$subject" --listen "127.0.0.1:$listen" --upstream "http://127.0.0.1:$up_port" --max-connections "$cap" \
      --threads 1 >/dev/null 2>&1 &
  fi
}

events=task-clock,context-switches,raw_syscalls:sys_enter,syscalls:sys_enter_recvfrom,syscalls:sys_enter_sendto
events=$events,syscalls:sys_enter_epoll_wait,syscalls:sys_enter_epoll_ctl
for rep in $(seq 1 "$reps"); do
  for subject in "${subjects[@]}"; do
    listen=$(port)
    start "$subject" "$listen"
    pid=$!
    sleep 0.7
    drive "$listen" 2
    perf stat -e "$events" -p "$pid" -o "$work/perf" -- sleep 6 &
    counting=$!
    drive "$listen" 6
    wait "$counting" || true
    n=$(responses)
    awk -v n="${n:-0}" -v rep="$rep" -v subject="$subject" '
      BEGIN { if (n == 0) n = 1 }
      /task-clock/ { cpu = $1 * 1000 / n }
      /context-switches/ { cs = $1 / n }
      /raw_syscalls:sys_enter/ { all = $1 / n }
      /sys_enter_recvfrom/ { rd = $1 / n }
      /sys_enter_sendto/ { wr = $1 / n }
      /sys_enter_epoll_wait/ { ew = $1 / n }
      /sys_enter_epoll_ctl/ { ec = $1 / n }
      END { printf "rep %d %s responses=%d cpu_us=%.1f syscalls=%.2f recvfrom=%.2f sendto=%.2f epoll_wait=%.2f epoll_ctl=%.2f cs=%.2f\n",
              rep, subject, n, cpu, all, rd, wr, ew, ec, cs }' <(sed 's/,//g' "$work/perf")
    kill "$pid"
    wait "$pid" 2>/dev/null || true
  done
done
