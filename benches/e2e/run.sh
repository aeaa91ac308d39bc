#!/usr/bin/env bash
# End-to-end benchmark: the upstream directly, floodgate, HAProxy and nginx at the same connection cap, under the
# same closed-loop load (wrk), with the upstream's own exact counts. See -h, and docs/benchmarks.md for results.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: benches/e2e/run.sh [options]

Runs every subject the same way against a counting upstream (examples/bench_upstream.rs) and writes one JSON
line per run, then regenerates docs/benchmarks.md from them. Installs missing tools with apt-get (haproxy,
nginx-light, wrk, curl, python3), builds floodgate and the upstream in release, uses free loopback ports, and
stops every process it started, by PID, on exit, failure or Ctrl-C.

Subjects: direct (no proxy), floodgate-1, floodgate-2 (--threads 1/2), haproxy-1, haproxy-2 (nbthread 1/2),
nginx-1, nginx-2 (worker_processes 1/2). Each run starts a fresh upstream and a fresh subject.

Options:
  -n N         connection cap for every proxy (floodgate --max-connections, HAProxy server maxconn,
               nginx max_conns and keepalive)                                   [8]
  -q Q         queue bound (floodgate --max-queue; HAProxy: 503 when the backend queue holds Q;
               nginx OSS has no queue)                                          [1024]
  -T D         queue timeout, seconds (floodgate --queue-timeout, HAProxy timeout queue)   [2]
  -c "C ..."   client connections (wrk -c), one run per value                   ["200 1000"]
  -s "MS ..."  upstream service times in ms, one scenario per value (e.g. "0 2 20 50")   ["0 2"]
  -d SECS      measured seconds per run                                         [10]
  -w SECS      warm-up seconds per run before the measured window (0: none)    [2]
  -r REPS      repetitions of every run (subjects interleaved within each)      [3]
  -S "NAME .." subjects to run                                                  [all seven above]
  -t THREADS   wrk threads                                                      [2]
  -u THREADS   upstream runtime threads                                         [1]
  -o DIR       results directory                                                [target/e2e-results/<date>]
  -D FILE      Markdown report to regenerate ("-": none)                        [docs/benchmarks.md]
  -I           do not install anything (fail if a tool is missing)
  -B           do not build (use the binaries already in the cargo target dir)
  -h           this help

Environment: CARGO_TARGET_DIR is honoured for the build and the binaries.
Example (a short run): benches/e2e/run.sh -d 5 -r 1 -c 200
Report only, from an earlier results directory: python3 benches/e2e/report.py DIR docs/benchmarks.md
EOF
}

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cmdline="benches/e2e/run.sh$(printf ' %q' "$@")"
[[ $# -gt 0 ]] || cmdline="benches/e2e/run.sh"

cap=8 queue=1024 queue_timeout=2 clients="200 1000" delays="0 2" duration=10 warmup=2 reps=3
subjects="direct floodgate-1 floodgate-2 haproxy-1 haproxy-2 nginx-1 nginx-2"
wrk_threads=2 upstream_threads=1 out="" doc="$repo/docs/benchmarks.md" install=1 build=1

while getopts "n:q:T:c:s:d:w:r:S:t:u:o:D:IBh" opt; do
  case $opt in
    n) cap=$OPTARG ;;
    q) queue=$OPTARG ;;
    T) queue_timeout=$OPTARG ;;
    c) clients=$OPTARG ;;
    s) delays=$OPTARG ;;
    d) duration=$OPTARG ;;
    w) warmup=$OPTARG ;;
    r) reps=$OPTARG ;;
    S) subjects=$OPTARG ;;
    t) wrk_threads=$OPTARG ;;
    u) upstream_threads=$OPTARG ;;
    o) out=$OPTARG ;;
    D) doc=$OPTARG ;;
    I) install=0 ;;
    B) build=0 ;;
    h) usage; exit 0 ;;
    *) usage >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[[ $# -eq 0 ]] || { echo "run.sh: unexpected argument: $1" >&2; usage >&2; exit 2; }
for v in "$cap" "$queue" "$queue_timeout" "$duration" "$warmup" "$reps" "$wrk_threads" "$upstream_threads" \
  $clients $delays; do
  [[ $v =~ ^[0-9]+$ ]] || { echo "run.sh: not a whole number: $v" >&2; exit 2; }
done
for s in $subjects; do
  case $s in direct | floodgate-[12] | haproxy-[12] | nginx-[12]) ;;
    *) echo "run.sh: unknown subject: $s" >&2; exit 2 ;;
  esac
done

log() { printf '[e2e %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "error: $*"; exit 1; }

# --- processes: every one we start is recorded here and stopped by PID ------------------------------------------
pids=()
stop_pid() { # PID...: TERM, wait up to 3 s, then KILL
  local p i
  for p in "$@"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "$@"; do
    for ((i = 0; i < 30; i++)); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
    wait "$p" 2>/dev/null || true
  done
}
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if ((${#pids[@]})); then
    log "stopping ${#pids[@]} process(es) we started: ${pids[*]}"
    stop_pid "${pids[@]}"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
forget_pids() { # remove stopped PIDs from the list
  local keep=() p q gone
  for p in "${pids[@]}"; do
    gone=0
    for q in "$@"; do [[ $p == "$q" ]] && gone=1; done
    ((gone)) || keep+=("$p")
  done
  pids=("${keep[@]}")
}

# --- tools ---------------------------------------------------------------------------------------------------------
need=() # apt packages to install
want_tool() { # COMMAND PACKAGE...
  local cmd=$1; shift
  command -v "$cmd" >/dev/null 2>&1 || need+=("$*")
}
want_tool wrk wrk
want_tool curl curl
want_tool python3 python3
[[ " $subjects " == *" haproxy-"* ]] && want_tool haproxy haproxy
[[ " $subjects " == *" nginx-"* ]] && { command -v nginx >/dev/null 2>&1 || [[ -x /usr/sbin/nginx ]] || need+=(nginx-light); }
if ((${#need[@]})); then
  ((install)) || die "missing: ${need[*]} (and -I given)"
  command -v apt-get >/dev/null 2>&1 || die "missing: ${need[*]}; no apt-get here, install them by hand"
  sudo=""; [[ $(id -u) -eq 0 ]] || sudo="sudo"
  log "installing ${need[*]} with apt-get"
  $sudo apt-get update -qq
  for pkg in "${need[@]}"; do
    if [[ $pkg == nginx-light ]]; then
      DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq nginx-light >/dev/null ||
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq nginx >/dev/null
    else
      DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$pkg" >/dev/null
    fi
  done
fi
PATH="$PATH:/usr/sbin:/sbin"

# --- build -----------------------------------------------------------------------------------------------------------
target_dir=${CARGO_TARGET_DIR:-$repo/target}
floodgate_bin=$target_dir/release/floodgate
upstream_bin=$target_dir/release/examples/bench_upstream
if ((build)); then
  log "building floodgate and the upstream (release) into $target_dir"
  (cd "$repo" && cargo build --release --quiet --bin floodgate --example bench_upstream)
fi
[[ -x $floodgate_bin && -x $upstream_bin ]] || die "binaries not found under $target_dir/release"

# --- run directory ---------------------------------------------------------------------------------------------------
[[ -n $out ]] || out=$repo/target/e2e-results/$(date +%Y%m%d-%H%M%S)
mkdir -p "$out/runs"
out=$(cd "$out" && pwd)
results=$out/runs.jsonl
: >"$results"
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
clk_tck=$(getconf CLK_TCK)
log "results in $out"

# --- helpers ---------------------------------------------------------------------------------------------------------
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}
wait_line() { # FILE PATTERN PID: wait up to 10 s for a line matching PATTERN in FILE, print it
  local i line
  for ((i = 0; i < 100; i++)); do
    line=$(grep -m1 -- "$2" "$1" 2>/dev/null || true)
    [[ -n $line ]] && { echo "$line"; return 0; }
    kill -0 "$3" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}
wait_port() { # PORT PID: wait up to 10 s until something accepts on 127.0.0.1:PORT
  local i
  for ((i = 0; i < 100; i++)); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}
children() { # PID: its direct children (nginx workers)
  local f
  for f in /proc/"$1"/task/*/children; do cat "$f" 2>/dev/null || true; done | tr ' ' '\n' | grep -E '^[0-9]+$' || true
}
cpu_ticks() { # PID...: utime+stime summed
  local p sum=0 fields
  for p in "$@"; do
    fields=$(sed 's/^.*) //' "/proc/$p/stat" 2>/dev/null) || continue
    read -r -a f <<<"$fields"
    sum=$((sum + f[11] + f[12]))
  done
  echo "$sum"
}
status_kb() { # KEY PID...: a /proc/PID/status value (kB or count) summed over PIDs
  local key=$1 p sum=0 v; shift
  for p in "$@"; do
    v=$(awk -v k="$key:" '$1 == k { print $2 }' "/proc/$p/status" 2>/dev/null || true)
    sum=$((sum + ${v:-0}))
  done
  echo "$sum"
}

write_haproxy_cfg() { # FILE THREADS LISTEN_PORT UPSTREAM_ADDR
  cat >"$1" <<EOF
global
    nbthread $2
    maxconn 8000

defaults
    mode http
    maxconn 8000
    timeout connect 2s
    timeout client 60s
    timeout server 60s
    timeout http-keep-alive 60s
    timeout queue ${queue_timeout}s
    # A queued request whose client left is dropped, not sent upstream.
    option abortonclose
    # Any idle upstream connection may serve any client: the closest to one shared pool.
    http-reuse always

frontend fe
    bind 127.0.0.1:$3
    default_backend be_app

backend be_app
    # server maxqueue does not bound the backend queue when there is one server; this does.
    http-request deny deny_status 503 if { queue(be_app) ge $queue }
    server app $4 maxconn $cap
EOF
}

write_nginx_cfg() { # DIR WORKERS LISTEN_PORT UPSTREAM_ADDR
  mkdir -p "$1/tmp"
  cat >"$1/nginx.conf" <<EOF
worker_processes $2;
worker_rlimit_nofile 16384;
pid $1/nginx.pid;
error_log $1/error.log warn;
daemon off;

events {
    worker_connections 8000;
}

http {
    access_log off;
    client_body_temp_path $1/tmp/body;
    proxy_temp_path $1/tmp/proxy;
    fastcgi_temp_path $1/tmp/fastcgi;
    uwsgi_temp_path $1/tmp/uwsgi;
    scgi_temp_path $1/tmp/scgi;
    keepalive_requests 1000000;

    upstream app {
        zone app 64k;
        # max_conns bounds active connections per worker group; nginx OSS has no queue (502 when all are busy).
        server $4 max_conns=$cap;
        keepalive $cap;
        keepalive_requests 1000000;
    }

    server {
        listen 127.0.0.1:$3;
        location / {
            proxy_pass http://app;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }
    }
}
EOF
}

# Starts SUBJECT in front of UPSTREAM_ADDR; sets subject_port and subject_pids (the proxy's process tree).
start_subject() { # SUBJECT UPSTREAM_ADDR RUN_DIR
  local subject=$1 up=$2 dir=$3 pid line threads=${1##*-}
  subject_pids=()
  case $subject in
    direct)
      subject_port=${up##*:}
      return 0
      ;;
    floodgate-*)
      "$floodgate_bin" --listen 127.0.0.1:0 --admin 127.0.0.1:0 --upstream "http://$up" --max-connections "$cap" \
        --max-queue "$queue" --queue-timeout "${queue_timeout}s" --threads "$threads" \
        >"$dir/proxy.out" 2>"$dir/proxy.err" &
      pid=$!; pids+=("$pid")
      line=$(wait_line "$dir/proxy.out" "floodgate ready" "$pid") || die "floodgate did not start: $(tail -3 "$dir/proxy.err")"
      subject_port=$(sed -n 's/.* listen=[^ ]*:\([0-9]*\) .*/\1/p' <<<"$line")
      admin_addr=$(sed -n 's/.* admin=\([^ ]*\).*/\1/p' <<<"$line")
      ;;
    haproxy-*)
      subject_port=$(free_port)
      write_haproxy_cfg "$dir/haproxy.cfg" "$threads" "$subject_port" "$up"
      haproxy -db -f "$dir/haproxy.cfg" >"$dir/proxy.out" 2>"$dir/proxy.err" &
      pid=$!; pids+=("$pid")
      ;;
    nginx-*)
      subject_port=$(free_port)
      write_nginx_cfg "$dir" "$threads" "$subject_port" "$up"
      nginx -p "$dir" -c "$dir/nginx.conf" -e "$dir/error.log" >"$dir/proxy.out" 2>"$dir/proxy.err" &
      pid=$!; pids+=("$pid")
      ;;
  esac
  wait_port "$subject_port" "$pid" || die "$subject did not start: $(tail -3 "$dir/proxy.err" "$dir/error.log" 2>/dev/null)"
  subject_pids=("$pid")
  if [[ $subject == nginx-* ]]; then
    local w i
    for ((i = 0; i < 50; i++)); do # the workers come up just after the listener
      mapfile -t w < <(children "$pid")
      ((${#w[@]} >= threads)) && break
      sleep 0.1
    done
    subject_pids+=("${w[@]}")
    pids+=("${w[@]}")
  fi
}

# wrk in the background, so that a signal to this script is handled at once (a foreground child is waited for).
run_wrk() { # OUTPUT_FILE WRK_ARGS...
  local file=$1 pid rc=0; shift
  wrk -t "$wrk_threads" -c "$conns" --timeout 5s "$@" >"$file" 2>&1 &
  pid=$!; pids+=("$pid")
  wait "$pid" || rc=$?
  forget_pids "$pid"
  return "$rc"
}

# One measured run: fresh upstream, fresh subject, warm-up, counters reset, wrk, counts, stop.
run_one() { # SUBJECT DELAY_MS CLIENTS REP
  local subject=$1 delay=$2 conns=$3 rep=$4
  local name="${subject}_d${delay}_c${conns}_r${rep}" dir line up ctl up_pid warm stats wrk_json t0 t1 u0 u1
  dir=$out/runs/$name
  mkdir -p "$dir"
  "$upstream_bin" --delay-ms "$delay" --threads "$upstream_threads" >"$dir/upstream.out" 2>"$dir/upstream.err" &
  up_pid=$!; pids+=("$up_pid")
  line=$(wait_line "$dir/upstream.out" "bench_upstream ready" "$up_pid") || die "upstream did not start: $(tail -3 "$dir/upstream.err")"
  up=$(sed -n 's/.* listen=\([^ ]*\) .*/\1/p' <<<"$line")
  ctl=$(sed -n 's/.* control=\([^ ]*\) .*/\1/p' <<<"$line")
  admin_addr=""
  start_subject "$subject" "$up" "$dir"
  local url="http://127.0.0.1:$subject_port/"
  if ((warmup > 0)); then
    run_wrk "$dir/wrk_warmup.txt" -d "${warmup}s" "$url" || true
    sleep 0.5 # let queues left by the warm-up clients drain
  fi
  warm=$(curl -fsS -X POST "http://$ctl/reset") || die "upstream control endpoint failed: $(tail -2 "$dir/upstream.out" "$dir/upstream.err")"
  local load1
  load1=$(cut -d' ' -f1 /proc/loadavg) # other work on the machine shows here: the load before this run
  t0=$(cpu_ticks "${subject_pids[@]}"); u0=$(cpu_ticks "$up_pid")
  run_wrk "$dir/wrk.txt" -d "${duration}s" -s "$here/report.lua" "$url" || die "wrk failed: $(tail -3 "$dir/wrk.txt")"
  t1=$(cpu_ticks "${subject_pids[@]}"); u1=$(cpu_ticks "$up_pid")
  stats=$(curl -fsS "http://$ctl/stats") || die "upstream control endpoint failed: $(tail -2 "$dir/upstream.out" "$dir/upstream.err")"
  wrk_json=$(sed -n 's/^E2E_JSON //p' "$dir/wrk.txt")
  [[ -n $wrk_json ]] || die "no result line from wrk in $dir/wrk.txt"
  [[ -n $admin_addr ]] && { curl -fsS "http://$admin_addr/status" >"$dir/floodgate_status.json" 2>/dev/null || true; }
  local proxy_hwm=0 proxy_cpu=null
  if ((${#subject_pids[@]})); then
    proxy_hwm=$(status_kb VmHWM "${subject_pids[@]}")
    proxy_cpu=$((t1 - t0))
  fi
  printf '{"subject":"%s","delay_ms":%d,"clients":%d,"rep":%d,"cap":%d,"queue":%d,"duration_s":%d,"wrk":%s,"upstream":%s,"upstream_warmup":%s,"upstream_hwm_kb":%d,"upstream_threads":%d,"upstream_cpu_ticks":%d,"proxy_hwm_kb":%d,"proxy_cpu_ticks":%s,"clk_tck":%d,"loadavg_1m":%s}\n' \
    "$subject" "$delay" "$conns" "$rep" "$cap" "$queue" "$duration" "$wrk_json" "$stats" "$warm" \
    "$(status_kb VmHWM "$up_pid")" "$(status_kb Threads "$up_pid")" "$((u1 - u0))" "$proxy_hwm" "$proxy_cpu" "$clk_tck" "$load1" \
    >>"$results"
  local stopping=("${subject_pids[@]}" "$up_pid")
  stop_pid "${stopping[@]}"
  forget_pids "${stopping[@]}"
  log "$name: $(python3 -c 'import json,sys; r=json.loads(sys.argv[1]); u=json.loads(sys.argv[2]); print("%d responses, codes %s, p99 %.1f ms, upstream peak conns %d, peak in flight %d" % (r["requests"], r["codes"], r["p99_us"]/1000, u["peak_conns"], u["peak_inflight"]))' "$wrk_json" "$stats")"
}

# --- metadata --------------------------------------------------------------------------------------------------------
ver() { "$@" 2>&1 | head -1 || true; }
export E2E_META_FILE=$out/meta.json E2E_CMD=$cmdline
E2E_GIT=$(cd "$repo" && git describe --always --dirty 2>/dev/null || echo unknown)
E2E_CPU=$(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)
E2E_OS=$(sed -n 's/^PRETTY_NAME="\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' /etc/os-release 2>/dev/null || true)
E2E_MEM=$(awk '/^MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo)
E2E_V_FLOODGATE=$(ver "$floodgate_bin" --version) E2E_V_RUSTC=$(ver rustc --version)
E2E_V_HAPROXY=$(ver haproxy -v) E2E_V_NGINX=$(ver nginx -v) E2E_V_WRK=$(ver wrk -v)
export E2E_GIT E2E_CPU E2E_OS E2E_MEM E2E_V_FLOODGATE E2E_V_RUSTC E2E_V_HAPROXY E2E_V_NGINX E2E_V_WRK
# All validated numbers or lists of them: safe to write as JSON by hand.
E2E_SETTINGS=$(printf '{"cap":%d,"queue":%d,"queue_timeout_s":%d,"clients":"%s","delays_ms":"%s","duration_s":%d,%s}' \
  "$cap" "$queue" "$queue_timeout" "$clients" "$delays" "$duration" \
  "$(printf '"warmup_s":%d,"reps":%d,"wrk_threads":%d,"upstream_threads":%d' "$warmup" "$reps" "$wrk_threads" "$upstream_threads")")
export E2E_SETTINGS
export E2E_SUBJECTS=$subjects
python3 - <<'PY'
import json, os, time
e = os.environ
settings = json.loads(e["E2E_SETTINGS"])
json.dump({
    "command": e["E2E_CMD"],
    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    "git": e["E2E_GIT"],
    "nproc": os.cpu_count(),
    "cpu": e["E2E_CPU"],
    "kernel": os.uname().release,
    "os": e["E2E_OS"],
    "mem": e["E2E_MEM"],
    "versions": {k: e["E2E_V_" + k.upper()] for k in ("floodgate", "rustc", "haproxy", "nginx", "wrk")},
    "settings": settings,
    "subjects": e["E2E_SUBJECTS"].split(),
}, open(e["E2E_META_FILE"], "w"), indent=1)
PY

# --- the matrix ------------------------------------------------------------------------------------------------------
total=0
for _ in $delays; do for _ in $clients; do for ((r = 1; r <= reps; r++)); do for _ in $subjects; do
  total=$((total + 1)); done; done; done; done
log "$total runs of ${duration}s (+${warmup}s warm-up) each"
for delay in $delays; do
  for conns in $clients; do
    for ((rep = 1; rep <= reps; rep++)); do
      for subject in $subjects; do
        run_one "$subject" "$delay" "$conns" "$rep"
      done
    done
  done
done

if [[ $doc != "-" ]]; then
  python3 "$here/report.py" "$out" "$doc"
  log "wrote $doc"
fi
log "done: $results"
