# Shared by benches/e2e/run.sh and its scenarios (benches/e2e/scenarios/*.sh): process bookkeeping, tools,
# upstreams, subjects, measurement and the one JSON line every run writes. Sourced, never run.
#
# Globals the caller sets before sourcing: here, repo, out, results, floodgate_bin, upstream_bin, cap, queue,
# queue_timeout, duration, warmup, upstream_threads, install. A scenario may override cap, delay and the like
# with `local` before calling run_case: bash's dynamic scope hands them down.

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
# Runs a command in the background (so a signal to the script is handled at once), waits, forgets it.
run_bg() { # OUTPUT_FILE COMMAND...
  local file=$1 pid rc=0; shift
  "$@" >"$file" 2>&1 &
  pid=$!; pids+=("$pid")
  wait "$pid" || rc=$?
  forget_pids "$pid"
  return "$rc"
}

# --- tools -----------------------------------------------------------------------------------------------------------
apt_need=() # apt packages to install
want_tool() { # COMMAND PACKAGE
  command -v "$1" >/dev/null 2>&1 || [[ -x /usr/sbin/$1 ]] || apt_need+=("$2")
}
want_oha() { # oha is not in Debian's apt: cargo install (into ~/.cargo/bin) when it is missing
  command -v oha >/dev/null 2>&1 && return 0
  [[ -x $HOME/.cargo/bin/oha ]] && { PATH="$PATH:$HOME/.cargo/bin"; return 0; }
  ((install)) || die "missing: oha (cargo install oha --locked), and -I given"
  log "installing oha with 'cargo install oha --locked' (not in apt; about 10 minutes on 2 CPUs)"
  cargo install oha --locked --quiet || die "cargo install oha failed"
  PATH="$PATH:$HOME/.cargo/bin"
}
install_tools() {
  ((${#apt_need[@]})) || return 0
  ((install)) || die "missing: ${apt_need[*]} (and -I given)"
  command -v apt-get >/dev/null 2>&1 || die "missing: ${apt_need[*]}; no apt-get here, install them by hand"
  local sudo="" pkg
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  log "installing ${apt_need[*]} with apt-get"
  $sudo apt-get update -qq
  for pkg in "${apt_need[@]}"; do
    if [[ $pkg == nginx-light ]]; then
      DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq nginx-light >/dev/null ||
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq nginx >/dev/null
    else
      DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$pkg" >/dev/null
    fi
  done
  apt_need=()
}

# --- small helpers ---------------------------------------------------------------------------------------------------
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}
wait_line() { # FILE PATTERN PID: wait up to 20 s for a line matching PATTERN in FILE, print it
  local i line
  for ((i = 0; i < 200; i++)); do
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

thread_ticks() { # PID...: "TID TICKS" (utime+stime) for every thread of each process, one per line
  local p t fields
  for p in "$@"; do
    for t in /proc/"$p"/task/*; do
      fields=$(sed 's/^.*) //' "$t/stat" 2>/dev/null) || continue
      read -r -a f <<<"$fields"
      echo "${t##*/} $((f[11] + f[12]))"
    done
  done
}

# How a window's CPU spread over the threads: {"busiest": share of the busiest thread, "over_5pct": threads above
# 5 %}, from two thread_ticks listings ({} when nothing ran).
thread_spread() { # BEFORE AFTER
  python3 -c '
import json, sys
def read(text):
    return {tid: int(t) for tid, t in (line.split() for line in text.splitlines() if line.strip())}
before, after = read(sys.argv[1]), read(sys.argv[2])
used = [t - before.get(tid, 0) for tid, t in after.items()]
total = sum(used)
print(json.dumps({"busiest": max(used) / total, "over_5pct": sum(1 for t in used if t > 0.05 * total)} if total else {}))' "$1" "$2"
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

# --- CPU layouts -----------------------------------------------------------------------------------------------------
# shared: every process may run on every CPU. pinned: the load generator gets the upper half of the CPUs, proxy and
# upstream the lower half (on 2 CPUs: load on CPU 1, proxy and upstream together on CPU 0).
pin_load=() pin_serve=()
set_layout() { # shared | pinned
  local n half
  layout=$1
  pin_load=() pin_serve=()
  [[ $layout == pinned ]] || return 0
  n=$(nproc)
  ((n >= 2)) || die "the pinned layout needs at least 2 CPUs"
  half=$((n / 2))
  pin_serve=(taskset -c "0-$((half - 1))")
  pin_load=(taskset -c "$half-$((n - 1))")
}

# --- proxy configurations --------------------------------------------------------------------------------------------
# Client connections a peer holds at most; a scenario with more clients sets it `local` (storm: 16,000 clients).
peer_maxconn=9000
# HAProxy variants: fast-shed (haproxy-T: 503 once the backend queue holds $queue, queued ones wait at most
# $queue_timeout), queue-everything (haproxyq-T: no bound on the queue, and a queue timeout of a minute: every
# client waits its turn, the way HAProxy keeps its goodput in a retry storm) and with-headers (haproxyh-T: fast-shed
# also doing the header work floodgate does by default, benches/haproxy_headers.cfg).
write_haproxy_cfg() { # FILE THREADS LISTEN_PORT UPSTREAM_ADDR [queue-everything | with-headers]
  local queue_timeout_s=$queue_timeout deny="    http-request deny deny_status 503 if { queue(be_app) ge $queue }"
  local headers=""
  if [[ ${5:-} == queue-everything ]]; then
    queue_timeout_s=60
    deny="    # queue-everything: no bound on the backend queue"
  elif [[ ${5:-} == with-headers ]]; then
    headers=$(cat "$here/../haproxy_headers.cfg")
  fi
  cat >"$1" <<EOF
global
    nbthread $2
    maxconn $peer_maxconn

defaults
    mode http
    maxconn $peer_maxconn
    timeout connect 2s
    timeout client 60s
    timeout server 60s
    timeout http-keep-alive 60s
    timeout queue ${queue_timeout_s}s
    # A queued request whose client left is dropped, not sent upstream.
    option abortonclose
    # Any idle upstream connection may serve any client: the closest to one shared pool.
    http-reuse always

frontend fe
    bind 127.0.0.1:$3
    default_backend be_app
$headers

backend be_app
    # server maxqueue does not bound the backend queue when there is one server; this does.
$deny
    server app $4 maxconn $cap
EOF
}

# $nginx_listen_extra, when set, goes on the listen line (scenarios/h2.sh: http2, which makes the port h2c only).
write_nginx_cfg() { # DIR WORKERS LISTEN_PORT UPSTREAM_ADDR
  mkdir -p "$1/tmp"
  cat >"$1/nginx.conf" <<EOF
worker_processes $2;
worker_rlimit_nofile $((peer_maxconn * 2 + 200));
pid $1/nginx.pid;
# crit: at warn and error nginx logs a line for every 502 it answers for want of a free upstream (gigabytes per run).
error_log $1/error.log crit;
daemon off;

events {
    worker_connections $((peer_maxconn + 500));
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
        listen 127.0.0.1:$3${nginx_listen_extra:+ $nginx_listen_extra};
        location / {
            proxy_pass http://app;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }
    }
}
EOF
}

# --- upstreams -------------------------------------------------------------------------------------------------------
# Starts the upstream of kind $upstream_kind (bench: examples/bench_upstream.rs; jvm: benches/e2e/jvm/) with service
# time DELAY_MS; sets up_addr, up_ctl (its control listener: GET /stats, POST /reset) and up_pid. upstream_args (an
# array, empty by default; a scenario sets it `local`) goes on bench_upstream's command line: --knee K,
# --body-bytes B.
upstream_args=()
start_upstream() { # DELAY_MS RUN_DIR
  local delay=$1 dir=$2 line
  case ${upstream_kind:-bench} in
    bench)
      "${pin_serve[@]}" "$upstream_bin" --delay-ms "$delay" --threads "$upstream_threads" "${upstream_args[@]}" \
        >"$dir/upstream.out" 2>"$dir/upstream.err" &
      ;;
    jvm)
      start_jvm_upstream "$delay" "$dir" # benches/e2e/scenarios/jvm.sh
      ;;
    *) die "unknown upstream kind: $upstream_kind" ;;
  esac
  up_pid=$!; pids+=("$up_pid")
  line=$(wait_line "$dir/upstream.out" "upstream ready" "$up_pid") || die "upstream did not start: $(tail -3 "$dir/upstream.err")"
  up_addr=$(sed -n 's/.* listen=\([^ ]*\).*/\1/p' <<<"$line")
  up_ctl=$(sed -n 's/.* control=\([^ ]*\).*/\1/p' <<<"$line")
}

# --- subjects --------------------------------------------------------------------------------------------------------
# Starts SUBJECT in front of UPSTREAM_ADDR; sets subject_port, subject_pids (the proxy's process tree) and, for
# floodgate, admin_addr. floodgate_env (an array of NAME=VALUE, empty by default; a scenario sets it `local`) is
# floodgate's environment on top of ours: settings that have no flag, for the one upstream --upstream makes
# (named "default"), e.g. FLOODGATE__UPSTREAMS__DEFAULT__QUEUE_DISCIPLINE=codel.
# floodgate_config_fn (a function name, empty by default; a scenario sets it `local`), when set, is called as
# `FN UPSTREAM_ADDR RUN_DIR` before floodgate starts and sets floodgate_config_file to a TOML file it wrote: floodgate gets
# `--config FILE` instead of `--upstream` (for what the environment cannot say, e.g. an upstream's `endpoints`, an
# array of tables). The file must define the upstream "default" and a route to it; the flags still set the cap,
# queue bound and timeout. What the function starts goes into `pids` and is the scenario's to stop.
floodgate_env=() floodgate_config_fn=""
start_subject() { # SUBJECT UPSTREAM_ADDR RUN_DIR
  local subject=$1 up=$2 dir=$3 pid line threads=${1##*-} upstream_flags
  subject_pids=() admin_addr=""
  case $subject in
    direct)
      subject_port=${up##*:}
      return 0
      ;;
    floodgate-*)
      upstream_flags=(--upstream "http://$up")
      if [[ -n ${floodgate_config_fn:-} ]]; then
        "$floodgate_config_fn" "$up" "$dir" # in this shell: what it starts stays ours (pids)
        upstream_flags=(--config "$floodgate_config_file")
      fi
      "${pin_serve[@]}" env "${floodgate_env[@]}" "$floodgate_bin" --listen 127.0.0.1:0 --admin 127.0.0.1:0 "${upstream_flags[@]}" \
        --max-connections "$cap" --max-queue "$queue" --queue-timeout "${queue_timeout}s" --threads "$threads" \
        >"$dir/proxy.out" 2>"$dir/proxy.err" &
      pid=$!; pids+=("$pid")
      line=$(wait_line "$dir/proxy.out" "floodgate ready" "$pid") || die "floodgate did not start: $(tail -3 "$dir/proxy.err")"
      subject_port=$(sed -n 's/.* listen=[^ ]*:\([0-9]*\) .*/\1/p' <<<"$line")
      admin_addr=$(sed -n 's/.* admin=\([^ ]*\).*/\1/p' <<<"$line")
      ;;
    haproxy-* | haproxyq-* | haproxyh-*)
      subject_port=$(free_port)
      local variant=""
      [[ $subject == haproxyq-* ]] && variant=queue-everything
      [[ $subject == haproxyh-* ]] && variant=with-headers
      write_haproxy_cfg "$dir/haproxy.cfg" "$threads" "$subject_port" "$up" "$variant"
      "${pin_serve[@]}" haproxy -db -f "$dir/haproxy.cfg" >"$dir/proxy.out" 2>"$dir/proxy.err" &
      pid=$!; pids+=("$pid")
      ;;
    nginx-*)
      subject_port=$(free_port)
      write_nginx_cfg "$dir" "$threads" "$subject_port" "$up"
      "${pin_serve[@]}" nginx -p "$dir" -c "$dir/nginx.conf" -e "$dir/error.log" >"$dir/proxy.out" 2>"$dir/proxy.err" &
      pid=$!; pids+=("$pid")
      ;;
    *) die "unknown subject: $subject" ;;
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

# --- one measured run ------------------------------------------------------------------------------------------------
# Fresh upstream, fresh subject, warm-up, counters reset, the measured load, counts, stop; appends one JSON line to
# $results. LOAD_FN is a function of the scenario, called as `LOAD_FN warmup|measure URL DIR SECONDS`; in measure
# mode it must write the load generator's result, normalised, to DIR/load.json:
#   {"duration_us", "requests", "codes": {"200": n, ...}, "err_connect", "err_read", "err_write", "err_timeout",
#    "p50_us", "p99_us", "p999_us", "max_us", and optionally "by_status": {"503": {"p50_us", "p99_us"}, ...}}
# EXTRA is a JSON object of scenario-specific fields merged into the line (e.g. '{"rate": 1000}').
# Hooks a scenario may define: after_subject_start DIR (e.g. to connect idle clients), measure_extra DIR (prints a
# JSON object merged into the line).
run_case() { # SCENARIO SUBJECT DELAY_MS CLIENTS REP LOAD_FN [EXTRA_JSON]
  local scenario=$1 subject=$2 delay=$3 clients=$4 rep=$5 load_fn=$6 extra=${7:-"{}"}
  local name="${layout}_${scenario}_${subject}_n${cap}_d${delay}_c${clients}_r${rep}" dir warm stats t0 t1 u0 u1 th0 th1
  [[ $extra != "{}" ]] && name+="_$(tr -cd 'a-z0-9' <<<"$extra")"
  dir=$out/runs/$name
  # Fresh: a line left in a log by an earlier run would be read as this run's ready line before it is truncated.
  rm -rf "$dir"
  mkdir -p "$dir"
  start_upstream "$delay" "$dir"
  start_subject "$subject" "$up_addr" "$dir"
  local url="http://127.0.0.1:$subject_port/"
  if ((warmup > 0)); then
    "$load_fn" warmup "$url" "$dir" "$warmup" || true
    sleep 0.5 # let queues left by the warm-up clients drain
  fi
  warm=$(curl -fsS -X POST "http://$up_ctl/reset") || die "upstream control endpoint failed: $(tail -2 "$dir/upstream.out" "$dir/upstream.err")"
  local load1
  load1=$(cut -d' ' -f1 /proc/loadavg) # other work on the machine shows here: the load before this run
  t0=$(cpu_ticks "${subject_pids[@]}"); u0=$(cpu_ticks "$up_pid"); th0=$(thread_ticks "${subject_pids[@]}")
  rm -f "$dir/load.json"
  "$load_fn" measure "$url" "$dir" "$duration" || die "load generator failed in $dir"
  t1=$(cpu_ticks "${subject_pids[@]}"); u1=$(cpu_ticks "$up_pid"); th1=$(thread_ticks "${subject_pids[@]}")
  [[ -s $dir/load.json ]] || die "no load result in $dir/load.json"
  stats=$(curl -fsS "http://$up_ctl/stats") || die "upstream control endpoint failed: $(tail -2 "$dir/upstream.out" "$dir/upstream.err")"
  [[ -n $admin_addr ]] && { curl -fsS "http://$admin_addr/status" >"$dir/floodgate_status.json" 2>/dev/null || true; }
  local proxy_hwm=0 proxy_rss=0 proxy_cpu=None more="{}"
  if ((${#subject_pids[@]})); then
    proxy_hwm=$(status_kb VmHWM "${subject_pids[@]}")
    proxy_rss=$(status_kb VmRSS "${subject_pids[@]}")
    proxy_cpu=$((t1 - t0))
  fi
  if declare -F measure_extra >/dev/null; then more=$(measure_extra "$dir"); fi
  python3 - "$results" <<EOF
import json, sys
line = {"scenario": "$scenario", "layout": "$layout", "subject": "$subject", "delay_ms": $delay,
        "clients": $clients, "rep": $rep, "cap": $cap, "queue": $queue, "duration_s": $duration,
        "upstream_kind": "${upstream_kind:-bench}", "load": json.load(open("$dir/load.json")),
        "upstream": json.loads('''$stats'''), "upstream_warmup": json.loads('''$warm'''),
        "upstream_hwm_kb": $(status_kb VmHWM "$up_pid"), "upstream_threads": $(status_kb Threads "$up_pid"),
        "upstream_cpu_ticks": $((u1 - u0)), "proxy_hwm_kb": $proxy_hwm, "proxy_rss_kb": $proxy_rss,
        "proxy_cpu_ticks": $proxy_cpu, "clk_tck": $(getconf CLK_TCK), "loadavg_1m": $load1,
        "proxy_threads": json.loads('''$(thread_spread "$th0" "$th1")''')}
line.update(json.loads('''$extra'''))
line.update(json.loads('''$more'''))
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(line) + "\n")
l, u = line["load"], line["upstream"]
print("%s: %d responses, codes %s, p99 %.1f ms, upstream peak conns %d, peak in flight %d" % (
    "$name", l["requests"], l["codes"], (l["p99_us"] or 0) / 1000, u["peak_conns"], u["peak_inflight"]), file=sys.stderr)
EOF
  local stopping=("${subject_pids[@]}" "$up_pid")
  stop_pid "${stopping[@]}"
  forget_pids "${stopping[@]}"
}

# floodgate's requests by outcome from its /metrics (floodgate_requests_total summed over code and upstream), as
# one JSON object ({"ok": n, "shed_deadline": n, ...}); {} when there is no admin address (not floodgate) or it
# does not answer. Read before and after a measured load, the difference is the window's.
floodgate_outcomes() { # ADMIN_ADDR (may be empty)
  local text
  [[ -n $1 ]] && text=$(curl -fsS "http://$1/metrics" 2>/dev/null) || { echo "{}"; return 0; }
  python3 -c '
import json, re, sys
out = {}
for line in sys.stdin:
    m = re.match(r"floodgate_requests_total\{([^}]*)\} (\S+)", line)
    if m:
        o = re.search(r"outcome=\"([^\"]*)\"", m.group(1))
        if o:
            out[o.group(1)] = out.get(o.group(1), 0) + int(float(m.group(2)))
print(json.dumps(out))' <<<"$text"
}

# Reads a load.json on stdin, writes it with "outcomes": AFTER - BEFORE (two floodgate_outcomes objects).
merge_outcomes() { # BEFORE_JSON AFTER_JSON
  python3 -c '
import json, sys
load = json.load(sys.stdin)
before, after = json.loads(sys.argv[1]), json.loads(sys.argv[2])
load["outcomes"] = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
json.dump(load, sys.stdout)' "$1" "$2"
}

# --- load generators -------------------------------------------------------------------------------------------------
# wrk, closed loop: $clients connections, $wrk_threads threads, a response later than $wrk_timeout seconds counted as
# a timeout. A load function for run_case.
wrk_timeout=5
load_wrk() { # warmup|measure URL DIR SECONDS
  local mode=$1 url=$2 dir=$3 secs=$4
  if [[ $mode == warmup ]]; then
    run_bg "$dir/wrk_warmup.txt" "${pin_load[@]}" wrk -t "$wrk_threads" -c "$clients" --timeout "${wrk_timeout}s" -d "${secs}s" "$url"
    return
  fi
  run_bg "$dir/wrk.txt" "${pin_load[@]}" wrk -t "$wrk_threads" -c "$clients" --timeout "${wrk_timeout}s" -d "${secs}s" \
    -s "$here/report.lua" "$url" || { log "wrk failed: $(tail -3 "$dir/wrk.txt")"; return 1; }
  sed -n 's/^E2E_JSON //p' "$dir/wrk.txt" >"$dir/load.json"
}
