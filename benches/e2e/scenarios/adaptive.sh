# Scenario "adaptive": floodgate's adaptive concurrency limit settling near the upstream's knee, against a static
# cap well above it. Sourced by run.sh; its report is docs/overload.md (section_adaptive.py).
#
# One upstream (examples/bench_upstream.rs --delay-ms $adaptive_delay --knee $adaptive_knee): it does K requests'
# work at a time, a request that starts with n in flight taking D x max(1, n / K), so its throughput stops at K / D
# and past K in flight only its latency grows. In front of it, a cap of $adaptive_cap (well above K) and a closed
# loop of $adaptive_clients wrk connections (far more than the cap, so a queue always stands). Configurations
# ($adaptive_configs), each a run, interleaved within a repetition:
#   static    floodgate-1, adaptive_limit off: the upstream sees the whole cap
#   adaptive  floodgate-1, adaptive_limit = "gradient" (min_connections 1, adaptive_window and the rest at their
#             defaults), through FLOODGATE__UPSTREAMS__DEFAULT__ADAPTIVE_LIMIT (lib.sh's floodgate_env)
#   haproxy-knee  haproxy-1 with maxconn K: a cap someone tuned to the knee by hand (reference)
#   haproxy-cap   haproxy-1 with maxconn $adaptive_cap: the same untuned cap as floodgate's (reference)
# The warm-up runs the same load for $adaptive_warmup s (not run.sh's -w, unless -w 0: no warm-up), long enough for
# the limit to climb from min_connections and settle, so the measured window sees the settled limit. During the
# warm-up and the measured load benches/e2e/sample_admin.py reads floodgate's /status every $adaptive_sample_s s
# (status_warmup.jsonl and status.jsonl in the run's directory: limit, in_use, queue_depth, the adaptive block).
#
# Per run the JSON line has, beside lib.sh's: part "adaptive", config, knee, static_cap, and in load:
# "samples" ([t, limit, in_use, queue_depth] per /status reading, t in seconds from the measured load's start;
# empty for HAProxy) and "warmup_samples" (the same over the warm-up, t from its start: the climb). Every setting
# below may be given in the environment (adaptive_knee=8 run.sh -x adaptive).
# shellcheck disable=SC2154,SC2034 # run.sh's globals; locals that lib.sh and the load functions read by dynamic scope
: "${adaptive_delay:=20}" "${adaptive_knee:=4}" "${adaptive_cap:=16}" "${adaptive_clients:=64}"
: "${adaptive_configs:=static adaptive haproxy-knee haproxy-cap}"
: "${adaptive_queue:=1024}" "${adaptive_timeout:=5}" "${adaptive_sample_s:=0.15}" "${adaptive_warmup:=4}"
scenario_doc[adaptive]=overload

tools_adaptive() {
  [[ " $adaptive_configs " == *" haproxy-"* ]] && want_tool haproxy haproxy
  return 0
}

# wrk closed loop on $clients connections; floodgate's /status sampled in the background meanwhile. A load
# function for run_case (lib.sh).
load_adaptive() { # warmup|measure URL DIR SECONDS
  local mode=$1 url=$2 dir=$3 secs=$4 spid="" tag="" rc=0
  local args=(-t "$wrk_threads" -c "$clients" --timeout 5s)
  if [[ $mode == warmup ]]; then
    tag=_warmup
    secs=$adaptive_warmup
  else
    args+=(-s "$here/report.lua")
  fi
  rm -f "$dir/status$tag.jsonl"
  if [[ -n $admin_addr ]]; then
    python3 "$here/sample_admin.py" "$admin_addr" "$dir/status$tag.jsonl" "$adaptive_sample_s" 2>"$dir/sampler$tag.err" &
    spid=$!
    pids+=("$spid")
  fi
  run_bg "$dir/wrk$tag.txt" "${pin_load[@]}" wrk "${args[@]}" -d "${secs}s" "$url" || rc=$?
  if [[ -n $spid ]]; then
    stop_pid "$spid"
    forget_pids "$spid"
  fi
  [[ $mode == warmup ]] && return 0
  ((rc == 0)) || { log "wrk failed: $(tail -3 "$dir/wrk.txt")"; return 1; }
  sed -n 's/^E2E_JSON //p' "$dir/wrk.txt" | PYTHONPATH=$here python3 -c '
import json, sys
from sample_admin import read_samples
load = json.load(sys.stdin)
def samples(path):
    return [[s["t"], s["upstream"].get("limit"), s["upstream"].get("in_use"), s["upstream"].get("queue_depth")]
            for s in read_samples(path)]
load["samples"] = samples(sys.argv[1])
load["warmup_samples"] = samples(sys.argv[2])
json.dump(load, sys.stdout)' "$dir/status.jsonl" "$dir/status_warmup.jsonl" >"$dir/load.json"
}

scenario_adaptive() { # REP
  local rep=$1 config subject floodgate_env
  local cap queue=$adaptive_queue queue_timeout=$adaptive_timeout
  local upstream_args=(--knee "$adaptive_knee")
  for config in $adaptive_configs; do
    cap=$adaptive_cap floodgate_env=()
    case $config in
      static) subject=floodgate-1 floodgate_env=("FLOODGATE__UPSTREAMS__DEFAULT__ADAPTIVE_LIMIT=off") ;;
      adaptive) subject=floodgate-1 floodgate_env=("FLOODGATE__UPSTREAMS__DEFAULT__ADAPTIVE_LIMIT=gradient") ;;
      haproxy-knee) subject=haproxy-1 cap=$adaptive_knee ;;
      haproxy-cap) subject=haproxy-1 ;;
      *) die "adaptive: unknown configuration: $config (static, adaptive, haproxy-knee, haproxy-cap)" ;;
    esac
    run_case adaptive "$subject" "$adaptive_delay" "$adaptive_clients" "$rep" load_adaptive \
      "{\"part\": \"adaptive\", \"config\": \"$config\", \"knee\": $adaptive_knee, \"static_cap\": $adaptive_cap,
        \"queue_timeout_s\": $queue_timeout, \"sample_s\": $adaptive_sample_s,
        \"warmup_s\": $( ((warmup > 0)) && echo "$adaptive_warmup" || echo 0)}"
  done
}

count_adaptive() { wc -w <<<"$adaptive_configs"; }
