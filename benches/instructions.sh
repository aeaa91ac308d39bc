#!/usr/bin/env bash
# Instructions per response of floodgate binaries, counted by valgrind (cachegrind, no cache simulation): a
# figure the machine's noise does not move, for a change's cost on the hot path where timings between runs
# (benches/side_by_side.sh) cannot tell a 10 % difference. Each binary serves FEW and then MANY requests in two
# runs under valgrind; the difference of the two totals over MANY - FEW is its cost per response, start-up and
# shutdown cancelled out. It counts floodgate's own work (user space, every thread), not the kernel's, and one
# client at a time (CLIENTS, 4) is not the batching of a loaded proxy: it complements the timed benchmarks.
#
#   benches/instructions.sh BINARY... [-- FEW MANY CLIENTS]   (defaults 1000 5000 4)
#
# A BINARY may be the word `haproxy`: HAProxy (nbthread 1, http-reuse always, server maxconn 8), counted the same
# way for the same requests; or `haproxy-headers`: the same HAProxy also doing the header work floodgate does by
# default (benches/haproxy_headers.cfg: X-Forwarded-For, -Proto and -Host, a request ID on both messages); both
# from benches/haproxy_subject.sh. Needs valgrind (apt-get install valgrind) and oha (cargo install oha);
# bench_upstream (cargo build --release --examples) answers at once. Extra proxy flags go in FLOODGATE_FLAGS (e.g.
# "--log-format json"). CACHE_SIM=yes also simulates the caches (valgrind's model of this machine's) and adds the
# first-level misses per response: I1 (instructions), D1 reads and D1 writes; several times slower. The kernel's
# copies into a buffer are not simulated, so a user read of bytes just received counts as a miss however warm.
set -euo pipefail
# shellcheck source=benches/haproxy_subject.sh
source "$(dirname "$0")/haproxy_subject.sh"
binaries=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do binaries+=("$1"); shift; done
[ $# -gt 0 ] && shift
cache_sim=${CACHE_SIM:-no}
few=${1:-1000}
many=${2:-5000}
clients=${3:-4}
[ ${#binaries[@]} -gt 0 ] || { sed -n '2,16p' "$0" >&2; exit 2; }
target=${CARGO_TARGET_DIR:-$(dirname "$0")/../target}
upstream="$target/release/examples/bench_upstream"
[ -x "$upstream" ] || { echo "build it first: cargo build --release --examples" >&2; exit 2; }
for tool in valgrind oha; do
  command -v "$tool" >/dev/null || { echo "needs $tool (see the header of $0)" >&2; exit 2; }
done
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
up_port=$(port); ctl_port=$(port)
"$upstream" --listen "127.0.0.1:$up_port" --control "127.0.0.1:$ctl_port" --delay-ms 0 >/dev/null 2>&1 &
up_pid=$!
work=$(mktemp -d)
trap 'kill $up_pid 2>/dev/null || true; rm -rf "$work"' EXIT
sleep 0.5

# Starts floodgate $1 under valgrind in the background on $2, its admin on $3; returns once it is healthy.
start_floodgate() {
  # The allocator's tuning given here: floodgate would otherwise start itself again with it (src/allocator.rs),
  # through /proc/self/exe, which under valgrind is valgrind's own binary.
  # shellcheck disable=SC2086
  _RJEM_MALLOC_CONF=${_RJEM_MALLOC_CONF:-dirty_decay_ms:1000,muzzy_decay_ms:0} \
    valgrind --tool=cachegrind --cache-sim="$cache_sim" --cachegrind-out-file="$work/out" \
    "$1" --listen "127.0.0.1:$2" --admin "127.0.0.1:$3" --upstream "http://127.0.0.1:$up_port" \
    --max-connections 8 --threads 1 ${FLOODGATE_FLAGS:-} >"$work/log" 2>&1 &
  pid=$!
  for _ in $(seq 1 200); do
    curl -fs "http://127.0.0.1:$3/healthz" >/dev/null 2>&1 && break
    sleep 0.1
  done
}

# Starts HAProxy (subject $2) under valgrind in the background on $1; returns once it answers (a request both FEW
# and MANY count).
start_haproxy() {
  write_haproxy_cfg "$work/haproxy.cfg" "$2" "$1" "$up_port" 8
  valgrind --tool=cachegrind --cache-sim="$cache_sim" --cachegrind-out-file="$work/out" haproxy -db -f "$work/haproxy.cfg" \
    >"$work/log" 2>&1 &
  pid=$!
  for _ in $(seq 1 200); do
    curl -fs "http://127.0.0.1:$1/" >/dev/null 2>&1 && break
    sleep 0.1
  done
}

# Total instructions of one run of $1 serving $2 requests.
count() {
  local binary=$1 requests=$2 listen admin pid
  listen=$(port); admin=$(port)
  if [ "$binary" = haproxy ] || [ "$binary" = haproxy-headers ]; then
    start_haproxy "$listen" "$binary"
  else
    start_floodgate "$binary" "$listen" "$admin"
  fi
  oha -n "$requests" -c "$clients" --no-tui "http://127.0.0.1:$listen/" >"$work/oha" 2>&1
  grep -q "\[200\] $requests responses" "$work/oha" || { echo "not every request was served:" >&2; cat "$work/oha" >&2; exit 1; }
  kill -TERM "$pid"
  wait "$pid" 2>/dev/null || true
  # Ir alone, or Ir I1mr D1mr D1mw (of: Ir I1mr ILmr Dr D1mr DLmr Dw D1mw DLmw).
  if [ "$cache_sim" = yes ]; then
    awk '/^summary:/{print $2, $3, $6, $9}' "$work/out"
  else
    awk '/^summary:/{print $2}' "$work/out"
  fi
}

for binary in "${binaries[@]}"; do
  low=$(count "$binary" "$few")
  high=$(count "$binary" "$many")
  if [ "$cache_sim" = yes ]; then
    # shellcheck disable=SC2086
    set -- $low $high
    echo "$binary instructions_per_response=$(( ($5 - $1) / (many - few) ))" \
      "I1_misses=$(( ($6 - $2) / (many - few) )) D1_read_misses=$(( ($7 - $3) / (many - few) ))" \
      "D1_write_misses=$(( ($8 - $4) / (many - few) )) (runs: $few, $many)"
  else
    per=$(( (high - low) / (many - few) ))
    echo "$binary instructions_per_response=$per (runs: $few -> $low, $many -> $high)"
  fi
done
