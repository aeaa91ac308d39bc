# Scenario "idle": idle_clients clients each make one request through the proxy and then stay connected, idle
# (examples/idle_clients.rs); measured: the proxy's resident memory with them connected against the same proxy's
# before they connected. What a proxy keeps per idle client connection is what it costs to hold many of them.
# Upstream: examples/bench_upstream.rs at 0 ms. The measured window is the set-up of the connections plus
# idle_settle seconds; -d does not apply. Sourced by run.sh.
#
# Settings (environment variables, e.g. `idle_clients=1000 benches/e2e/run.sh -x idle`):
#   idle_clients    connections held idle                                     [8000]
#   idle_subjects   subjects (direct has no proxy to measure)                 [those of -S, without direct]
#   idle_parallel   connections being set up at once; above the cap nginx, which cannot queue, answers 502  [$cap]
#   idle_settle     seconds between the last answer and the RSS sample        [1]
#
# The sample must come well before any side closes idle connections: floodgate's client_idle_timeout is 60 s,
# HAProxy's `timeout http-keep-alive` 60 s (lib.sh), nginx's keepalive_timeout 75 s (its default). The set-up took
# 1-2 s at 8,000 on 2 CPUs; idle_clients' last line says how many connections the proxy closed before the sample
# was over, and the report shows it.

: "${idle_clients:=8000}"
: "${idle_subjects:=$(tr ' ' '\n' <<<"$subjects" | grep -vx direct | paste -sd ' ')}"
: "${idle_parallel:=$cap}"
: "${idle_settle:=1}"
cargo_examples+=(idle_clients)

build_idle() {
  [[ -x $target_dir/release/examples/idle_clients ]] || die "idle_clients not found under $target_dir/release/examples"
}

# A load function for run_case (see lib.sh). warmup: a short wrk, so that "before" is a proxy that has already
# served requests (its upstream connections made, its buffers allocated). measure: the idle clients.
load_idle() { # warmup|measure URL DIR SECONDS
  local mode=$1 url=$2 dir=$3 secs=$4 port pid i ready="" final="" rss_before hwm_before rss_idle hwm_idle
  if [[ $mode == warmup ]]; then
    run_bg "$dir/wrk_warmup.txt" "${pin_load[@]}" wrk -t 1 -c "$cap" --timeout 5s -d "${secs}s" "$url"
    return
  fi
  port=${url#http://127.0.0.1:}
  port=${port%/}
  rss_before=$(status_kb VmRSS "${subject_pids[@]}")
  hwm_before=$(status_kb VmHWM "${subject_pids[@]}")
  # Not run_bg: the clients must stay connected while the proxy is measured; stopped below, by PID.
  "${pin_load[@]}" "$target_dir/release/examples/idle_clients" --addr "127.0.0.1:$port" \
    --connections "$clients" --parallel "$idle_parallel" --timeout-ms 5000 \
    >"$dir/idle_clients.out" 2>"$dir/idle_clients.err" &
  pid=$!
  pids+=("$pid")
  for ((i = 0; i < 600; i++)); do # up to 60 s
    ready=$(grep -m1 '"ready":true' "$dir/idle_clients.out" 2>/dev/null || true)
    [[ -n $ready ]] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if [[ -z $ready ]]; then
    log "idle_clients not ready: $(tail -3 "$dir/idle_clients.err")"
    stop_pid "$pid"
    forget_pids "$pid"
    return 1
  fi
  sleep "$idle_settle"
  rss_idle=$(status_kb VmRSS "${subject_pids[@]}")
  hwm_idle=$(status_kb VmHWM "${subject_pids[@]}")
  stop_pid "$pid"
  forget_pids "$pid"
  final=$(grep -m1 '"final":true' "$dir/idle_clients.out" 2>/dev/null || true)
  [[ -n $final ]] || final="{}"
  python3 - "$dir/load.json" <<EOF
import json, sys
ready = json.loads('''$ready''')
final = json.loads('''$final''')
# The normalised shape of lib.sh's run_case; "requests" are the connections that got their one answer.
load = {k: ready[k] for k in ("duration_us", "codes", "err_connect", "err_read", "err_write", "err_timeout",
                              "p50_us", "p99_us", "p999_us", "max_us", "connections", "connected", "failed")}
load["requests"] = ready["completed"]
load.update({
    "rss_before_kb": $rss_before, "hwm_before_kb": $hwm_before, "rss_idle_kb": $rss_idle, "hwm_idle_kb": $hwm_idle,
    "settle_s": float("$idle_settle"),
    # Closed by the proxy between the set-up and the end of the sample (None: idle_clients left no last line).
    "closed_by_peer": final.get("closed_by_peer"),
    "idle_ms": final.get("idle_ms"),
})
json.dump(load, open(sys.argv[1], "w"))
EOF
}

scenario_idle() { # REP
  local rep=$1 subject
  for subject in $idle_subjects; do
    run_case idle "$subject" 0 "$idle_clients" "$rep" load_idle
  done
}

count_idle() { wc -w <<<"$idle_subjects"; }
