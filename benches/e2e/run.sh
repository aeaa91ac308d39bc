#!/usr/bin/env bash
# End-to-end benchmark: the upstream directly, floodgate, HAProxy and nginx at the same connection cap, under the
# same loads, with the upstream's own exact counts; and floodgate's overload control (queue disciplines, fair
# sharing) measured against itself. See -h, and docs/benchmarks.md and docs/overload.md for results. The shared
# machinery is in lib.sh; each scenario (a kind of load) is one file in scenarios/ and one section_<name>.py.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: benches/e2e/run.sh [options]

Runs every subject the same way against a counting upstream (examples/bench_upstream.rs, or the JVM one in
benches/e2e/jvm/) and writes one JSON line per run, then regenerates docs/benchmarks.md (tables) and
docs/benchmarks.png (plot) from them, and docs/overload.md when overload-control scenarios ran. Installs missing
tools (apt-get: haproxy, nginx-light, wrk, curl, python3, nghttp2-client, a JDK, python3-matplotlib; cargo
install: oha), builds floodgate and its tools in release, uses free loopback ports, and stops every process it
started, by PID, on exit, failure or Ctrl-C.

Scenarios (-x), each in benches/e2e/scenarios/NAME.sh:
  closed    wrk closed loop, every subject, clients (-c) x service times (-s), cap N
  capacity  wrk closed loop, every subject, N = 64 (capacity_cap), 1000 clients, 0 ms: the proxy is the bottleneck
  open      oha open loop (latency corrected): 1,000 req/s at 2 ms, N = 8 and 64; 0.5x and 2x of N / 20 ms
  single    wrk -t1 -c1, 0 ms service time: the latency one client sees, direct and through each proxy
  h2        h2load, h2c clients (100 connections x 10 streams), 0 and 2 ms; the upstream stays HTTP/1.1
  idle      8,000 clients (idle_clients) make one request each, then stay connected: proxy RSS with them vs before
  jvm       wrk closed loop, 50 ms, thread-per-connection JVM upstream (jvm/), 200-8,000 clients: its threads, RSS
  cores     floodgate --threads 1/2/4 and HAProxy nbthread 1/2/4: capacity and the retry storm, CPU per response
            and the busiest thread's share (not in the default -x)

Overload-control scenarios (not in the default -x; their report is docs/overload.md, option -O):
  overload  oha open loop at 0.8x, 1x, 1.2x and 2x of N / service time (8 / 20 ms), clients sending
            X-Request-Timeout: 500; floodgate with queue_discipline fifo, adaptive-lifo and codel, and HAProxy
            (FIFO with timeout queue) as a reference: goodput, served p50/p99, share in the deadline, sheds by reason
  fairness  a greedy client (wrk, 100 connections, X-Api-Key: greedy) and a polite one (oha, 20 req/s open loop,
            X-Api-Key: polite) together at N = 4, 20 ms; fair_key off, header:x-api-key, and with fair_max_queue
  adaptive  wrk closed loop (64 clients) against an upstream with a knee at K = 4 (20 ms, slower in proportion past
            it), cap 16: floodgate's adaptive_limit off and gradient (limit sampled from /status), HAProxy at
            maxconn 4 and 16 as references: the limit against K, upstream peak in flight and service p99, goodput
  slow-readers  M (4, 16) clients reading a 4 MiB body at 64 bytes/s beside a wrk closed loop on a 1 KiB body,
            N = 8, 10 ms: response buffering off and on: the fast clients' goodput and p50/p99, slots held, memory
  retry-after  open-loop jobs at 2x of N / service time (4 / 40 ms) into a queue of 4, retried on a shed answer
            at once or after its Retry-After (retry_client.py): goodput, share served, attempts per served job, CPU
  endpoints two bench_upstream endpoints (4 slots each), oha closed loop, the second killed halfway: eject_after 3
            and 0: failed requests, p99 around the kill, time until the cap in force shrinks (/status)
  Their cap, queue, timeouts and subjects are their own settings, not -n/-q/-T/-S: environment variables named
  after them (overload_factors="2" ...; see each file's head). They run in the shared layout only.

Subjects: direct (no proxy), floodgate-1, floodgate-2 (--threads 1/2), haproxy-1, haproxy-2 (nbthread 1/2),
nginx-1, nginx-2 (worker_processes 1/2); a -4 of each (4 threads) for the cores scenario. Not in the defaults:
haproxyq-T (HAProxy queueing everything, the storm's) and haproxyh-T (HAProxy also setting X-Forwarded-* and a
request ID, floodgate's default header work: benches/haproxy_headers.cfg). Each run starts a fresh upstream and a fresh subject.

Options:
  -n N         connection cap for every proxy (floodgate --max-connections, HAProxy server maxconn,
               nginx max_conns and keepalive)                                   [8]
  -q Q         queue bound (floodgate --max-queue; HAProxy: 503 when the backend queue holds Q;
               nginx OSS has no queue)                                          [1024]
  -T D         queue timeout, seconds (floodgate --queue-timeout, HAProxy timeout queue)   [2]
  -x "S ..."   scenarios to run, in this order                                  [the first seven above]
  -L "L ..."   CPU layouts: shared (no pinning), pinned (load generator on the upper half of
               the CPUs, proxy and upstream on the lower half)                  ["shared pinned"]
  -P "S ..."   the scenarios (of -x) that also run in the pinned layout; the pinned closed loop
               runs only the service times of closed_pinned_delays ("0 2")     ["closed capacity single"]
  -c "C ..."   closed: client connections (wrk -c), one run per value           ["200 1000"]
  -s "MS ..."  closed: upstream service times in ms                             ["0 2 20 50"]
  -d SECS      measured seconds per run                                         [4]
  -w SECS      warm-up seconds per run before the measured window (0: none)    [1]
  -r REPS      repetitions of the whole matrix (subjects interleaved)           [3]
  -S "NAME .." subjects to run                                                  [all seven above]
  -t THREADS   wrk threads                                                      [2]
  -u THREADS   upstream runtime threads                                         [1]
  -o DIR       results directory                                                [target/e2e-results/<date>]
  -D FILE      Markdown report of the benchmark scenarios ("-": none)            [docs/benchmarks.md]
  -O FILE      Markdown report of the overload-control scenarios ("-": none)     [docs/overload.md]
  -I           do not install anything (fail if a tool is missing)
  -B           do not build (use the binaries already in the cargo target dir)
  -h           this help

Environment: CARGO_TARGET_DIR is honoured for the build and the binaries. floodgate is measured as it is shipped
(packaging/deb.sh, docker/Dockerfile): the dist profile with the otlp feature; FLOODGATE_PROFILE=release measures
what `cargo build --release` makes instead (3-4 % more instructions per response, docs/data-path.md).
Example (a short run): benches/e2e/run.sh -d 5 -r 1 -c 200
Overload control only: benches/e2e/run.sh -x "overload fairness adaptive slow-readers retry-after endpoints" -L shared -d 8 -r 3
Report only, from an earlier results directory: python3 benches/e2e/report.py DIR docs/benchmarks.md
  (python3 benches/e2e/report.py --kind overload DIR docs/overload.md for the overload-control scenarios;
  --also DIR2 adds the scenarios of another run that DIR lacks, each scenario from one run)
EOF
}

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cmdline="benches/e2e/run.sh$(printf ' %q' "$@")"
[[ $# -gt 0 ]] || cmdline="benches/e2e/run.sh"

cap=8 queue=1024 queue_timeout=2 closed_clients="200 1000" closed_delays="0 2 20 50" duration=4 warmup=1 reps=3
scenarios="closed capacity open single h2 idle jvm" layouts="shared pinned"
pinned_scenarios="closed capacity single"
subjects="direct floodgate-1 floodgate-2 haproxy-1 haproxy-2 nginx-1 nginx-2"
wrk_threads=2 upstream_threads=1 out="" doc="$repo/docs/benchmarks.md" doc_overload="$repo/docs/overload.md"
install=1 build=1

while getopts "n:q:T:x:L:P:c:s:d:w:r:S:t:u:o:D:O:IBh" opt; do
  case $opt in
    n) cap=$OPTARG ;;
    q) queue=$OPTARG ;;
    T) queue_timeout=$OPTARG ;;
    x) scenarios=$OPTARG ;;
    L) layouts=$OPTARG ;;
    P) pinned_scenarios=$OPTARG ;;
    c) closed_clients=$OPTARG ;;
    s) closed_delays=$OPTARG ;;
    d) duration=$OPTARG ;;
    w) warmup=$OPTARG ;;
    r) reps=$OPTARG ;;
    S) subjects=$OPTARG ;;
    t) wrk_threads=$OPTARG ;;
    u) upstream_threads=$OPTARG ;;
    o) out=$OPTARG ;;
    D) doc=$OPTARG ;;
    O) doc_overload=$OPTARG ;;
    I) install=0 ;;
    B) build=0 ;;
    h) usage; exit 0 ;;
    *) usage >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[[ $# -eq 0 ]] || { echo "run.sh: unexpected argument: $1" >&2; usage >&2; exit 2; }
for v in "$cap" "$queue" "$queue_timeout" "$duration" "$warmup" "$reps" "$wrk_threads" "$upstream_threads" \
  $closed_clients $closed_delays; do
  [[ $v =~ ^[0-9]+$ ]] || { echo "run.sh: not a whole number: $v" >&2; exit 2; }
done
for s in $subjects; do
  case $s in direct | floodgate-[124] | haproxy-[124] | haproxyq-[124] | haproxyh-[124] | nginx-[124]) ;;
    *) echo "run.sh: unknown subject: $s" >&2; exit 2 ;;
  esac
done
for s in $scenarios; do
  [[ -f $here/scenarios/$s.sh ]] || { echo "run.sh: unknown scenario: $s" >&2; exit 2; }
done
for s in $layouts; do
  [[ $s == shared || $s == pinned ]] || { echo "run.sh: unknown layout: $s" >&2; exit 2; }
done

# shellcheck source=lib.sh
source "$here/lib.sh"
cargo_examples=(bench_upstream) # scenarios add the examples they need when sourced
# The report a scenario's results go to: "benchmarks" (docs/benchmarks.md, -D) unless its file sets
# scenario_doc[NAME]=overload (docs/overload.md, -O). report.py picks sections by their DOC the same way.
declare -A scenario_doc=()

want_tool wrk wrk
want_tool curl curl
want_tool python3 python3
[[ " $subjects " == *" haproxy-"* ]] && want_tool haproxy haproxy
[[ " $subjects " == *" nginx-"* ]] && want_tool nginx nginx-light
for s in $scenarios; do
  # shellcheck source=/dev/null
  source "$here/scenarios/$s.sh"
  if declare -F "tools_$s" >/dev/null; then "tools_$s"; fi
done
kinds=" "
for s in $scenarios; do kinds+="${scenario_doc[$s]:-benchmarks} "; done
# The plot needs matplotlib: use a python3 that has it, else Debian's (python3-matplotlib installs for /usr/bin/python3).
# Only docs/benchmarks.md has a plot.
report_python=python3
if [[ $kinds == *" benchmarks "* ]] && ! python3 -c 'import matplotlib' 2>/dev/null; then
  if /usr/bin/python3 -c 'import matplotlib' 2>/dev/null; then
    report_python=/usr/bin/python3
  elif [[ $doc != "-" ]] && ((install)) && command -v apt-get >/dev/null 2>&1; then
    apt_need+=(python3-matplotlib)
    report_python=/usr/bin/python3
  fi
fi
install_tools
PATH="$PATH:/usr/sbin:/sbin"

# --- build -----------------------------------------------------------------------------------------------------------
target_dir=${CARGO_TARGET_DIR:-$repo/target}
floodgate_profile=${FLOODGATE_PROFILE:-dist}
floodgate_bin=$target_dir/$floodgate_profile/floodgate
upstream_bin=$target_dir/release/examples/bench_upstream
if ((build)); then
  log "building floodgate ($floodgate_profile) and the upstream and tools (release) into $target_dir"
  features=()
  [[ $floodgate_profile == dist ]] && features=(--features otlp)
  (cd "$repo" && cargo build --profile "$floodgate_profile" "${features[@]}" --quiet --bin floodgate)
  (cd "$repo" && cargo build --release --quiet $(printf -- ' --example %s' "${cargo_examples[@]}"))
fi
[[ -x $floodgate_bin && -x $upstream_bin ]] || die "binaries not found under $target_dir/$floodgate_profile and $target_dir/release"
for s in $scenarios; do
  if declare -F "build_$s" >/dev/null; then "build_$s"; fi
done

# --- run directory ---------------------------------------------------------------------------------------------------
[[ -n $out ]] || out=$repo/target/e2e-results/$(date +%Y%m%d-%H%M%S)
mkdir -p "$out/runs"
out=$(cd "$out" && pwd)
results=$out/runs.jsonl
: >"$results"
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
clk_tck=$(getconf CLK_TCK)
log "results in $out"

# --- metadata --------------------------------------------------------------------------------------------------------
ver() { command -v "$1" >/dev/null 2>&1 || [[ -x $1 ]] || return 0; "$@" 2>&1 | head -1 || true; }
export E2E_META_FILE=$out/meta.json E2E_CMD=$cmdline
E2E_GIT=$(cd "$repo" && git describe --always --dirty 2>/dev/null || echo unknown)
E2E_CPU=$(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)
E2E_OS=$(sed -n 's/^PRETTY_NAME="\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' /etc/os-release 2>/dev/null || true)
E2E_MEM=$(awk '/^MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo)
E2E_V_floodgate=$(ver "$floodgate_bin" --version) E2E_V_rustc=$(ver rustc --version)
E2E_V_haproxy=$(ver haproxy -v) E2E_V_nginx=$(ver nginx -v) E2E_V_wrk=$(ver wrk -v)
E2E_V_oha=$(ver oha --version) E2E_V_h2load=$(ver h2load --version) E2E_V_java=$(ver java -version)
export E2E_GIT E2E_CPU E2E_OS E2E_MEM ${!E2E_V_*}
# Every setting, by name, for the report (a scenario's own settings are globals named after it: closed_clients...).
scenario_vars=()
for s in $scenarios; do
  mapfile -t -O "${#scenario_vars[@]}" scenario_vars < <(compgen -v "${s//-/_}_" || true)
done
for v in floodgate_profile cap queue queue_timeout duration warmup reps wrk_threads upstream_threads scenarios layouts pinned_scenarios subjects \
  ${!closed_*} "${scenario_vars[@]}"; do
  export "E2E_S_$v=${!v}"
done
python3 - <<'PY'
import json, os, time
e = os.environ
json.dump({
    "command": e["E2E_CMD"],
    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    "git": e["E2E_GIT"],
    "nproc": os.cpu_count(),
    "cpu": e["E2E_CPU"],
    "kernel": os.uname().release,
    "os": e["E2E_OS"],
    "mem": e["E2E_MEM"],
    "versions": {k[6:]: v for k, v in e.items() if k.startswith("E2E_V_") and v},
    "settings": {k[6:]: v for k, v in e.items() if k.startswith("E2E_S_")},
}, open(e["E2E_META_FILE"], "w"), indent=1)
PY

# --- the matrix ------------------------------------------------------------------------------------------------------
total=0
layout_scenarios() { # LAYOUT: the scenarios it runs, in -x order
  local s
  for s in $scenarios; do
    [[ $1 == shared || " $pinned_scenarios " == *" $s "* ]] && echo "$s"
  done
  return 0
}
for layout_name in $layouts; do
  set_layout "$layout_name"
  for s in $(layout_scenarios "$layout_name"); do total=$((total + $("count_$s"))); done
done
total=$((total * reps))
log "$total runs of ${duration}s (+${warmup}s warm-up) each: scenarios $scenarios; layouts $layouts; $reps repetition(s)"
for ((rep = 1; rep <= reps; rep++)); do
  for layout_name in $layouts; do
    set_layout "$layout_name"
    for s in $(layout_scenarios "$layout_name"); do
      "scenario_$s" "$rep"
    done
  done
done

if [[ $doc != "-" && $kinds == *" benchmarks "* ]]; then
  "$report_python" "$here/report.py" "$out" "$doc"
  log "wrote $doc"
fi
if [[ $doc_overload != "-" && $kinds == *" overload "* ]]; then
  python3 "$here/report.py" --kind overload "$out" "$doc_overload"
  log "wrote $doc_overload"
fi
log "done: $results"
