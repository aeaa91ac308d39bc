# Scenario "fairness": a greedy client and a polite one share one upstream, with floodgate's fair sharing off and
# on. Sourced by run.sh; its report is docs/overload.md (section_fairness.py), not docs/benchmarks.md.
#
# One upstream (examples/bench_upstream.rs) at $fairness_delay ms behind a cap of N = $fairness_cap (capacity
# N / service time: 4 / 20 ms = 200 req/s). Two load generators start together and run the same seconds:
#   greedy  wrk, closed loop, $fairness_greedy_conns connections (1 thread), `X-Api-Key: greedy`: it keeps that many
#           requests in floodgate at all times, far more than N, so the queue always holds its requests.
#   polite  oha, open loop at $fairness_polite_rate req/s (--latency-correction), `X-Api-Key: polite`: a small
#           share of capacity. Its success is a 2xx answer; "in time" is a 2xx within $fairness_polite_slo_ms ms
#           (measured by the client; no deadline header is sent, so floodgate serves every request however late).
# floodgate runs once per configuration of $fairness_configs, the queue bound ($fairness_queue) and timeout
# ($fairness_timeout s) the same in each:
#   off     fair_key = "" (one lane: the polite request waits behind every greedy one queued before it)
#   fair    fair_key = "header:x-api-key" (a lane per key, served by deficit round robin)
#   quota   fair as above and fair_max_queue = $fairness_quota (the greedy key's requests past it: 429 at once)
# Settings travel as FLOODGATE__UPSTREAMS__DEFAULT__* (lib.sh's floodgate_env).
#
# Per run the JSON line has, beside lib.sh's: config, fair_key, fair_max_queue, polite_rate, greedy_conns,
# polite_slo_ms; load is the polite client's (oha, normalised as for the open scenario, with "within" the 2xx and
# others in time), with load.greedy the greedy client's (wrk's JSON from report.lua) and load.outcomes
# floodgate's floodgate_requests_total by outcome over the measured window (both clients together).
# Every setting below may be given in the environment (fairness_greedy_conns=200 benches/e2e/run.sh -x fairness).
# shellcheck disable=SC2154,SC2034 # run.sh's globals; locals that lib.sh and the load functions read by dynamic scope
: "${fairness_cap:=4}" "${fairness_delay:=20}"
: "${fairness_greedy_conns:=100}" "${fairness_polite_rate:=20}" "${fairness_polite_slo_ms:=250}"
: "${fairness_configs:=off fair quota}" "${fairness_quota:=16}"
: "${fairness_queue:=1024}" "${fairness_timeout:=2}"
: "${fairness_subject:=floodgate-1}"
scenario_doc[fairness]=overload

tools_fairness() { want_oha; }

# Both clients at once, each to its end; a load function for run_case (lib.sh).
load_fairness() { # warmup|measure URL DIR SECONDS
  local mode=$1 url=$2 dir=$3 secs=$4 before after gpid ppid rc=0 tag=""
  local polite=(--no-tui -z "${secs}s" -q "$fairness_polite_rate" --latency-correction -c 32 -t 5s
    -H "X-Api-Key: polite")
  local greedy=(-t 1 -c "$fairness_greedy_conns" --timeout 5s -d "${secs}s" -H "X-Api-Key: greedy")
  [[ $mode == warmup ]] && tag=_warmup
  rm -f "$dir/oha.db"
  before=$(floodgate_outcomes "$admin_addr")
  if [[ $mode == warmup ]]; then
    "${pin_load[@]}" wrk "${greedy[@]}" "$url" >"$dir/wrk$tag.txt" 2>&1 &
    gpid=$!
    pids+=("$gpid")
    "${pin_load[@]}" oha "${polite[@]}" --output-format quiet "$url" >"$dir/oha$tag.txt" 2>&1 &
  else
    "${pin_load[@]}" wrk "${greedy[@]}" -s "$here/report.lua" "$url" >"$dir/wrk.txt" 2>&1 &
    gpid=$!
    pids+=("$gpid")
    "${pin_load[@]}" oha "${polite[@]}" -w --output-format json -o "$dir/oha.json" --db-url "$dir/oha.db" \
      "$url" >"$dir/oha.txt" 2>&1 &
  fi
  ppid=$!
  pids+=("$ppid")
  wait "$gpid" || rc=$?
  wait "$ppid" || rc=$?
  forget_pids "$gpid" "$ppid"
  [[ $mode == warmup ]] && return 0
  ((rc == 0)) || { log "a load generator failed: $(tail -2 "$dir/wrk.txt" "$dir/oha.txt")"; return 1; }
  after=$(floodgate_outcomes "$admin_addr")
  sed -n 's/^E2E_JSON //p' "$dir/wrk.txt" >"$dir/greedy.json"
  [[ -s $dir/greedy.json ]] || { log "no wrk result: $(tail -3 "$dir/wrk.txt")"; return 1; }
  python3 "$here/oha_to_load.py" "$dir/oha.json" "$dir/oha.db" "$fairness_polite_rate" "$secs" \
    "$fairness_polite_slo_ms" | merge_outcomes "$before" "$after" | python3 -c '
import json, sys
load = json.load(sys.stdin)
load["greedy"] = json.load(open(sys.argv[1]))
json.dump(load, sys.stdout)' "$dir/greedy.json" >"$dir/load.json"
}

scenario_fairness() { # REP
  local rep=$1 config key maxq floodgate_env
  local cap=$fairness_cap queue=$fairness_queue queue_timeout=$fairness_timeout
  for config in $fairness_configs; do
    case $config in
      off) key="" maxq=0 ;;
      fair) key="header:x-api-key" maxq=0 ;;
      quota) key="header:x-api-key" maxq=$fairness_quota ;;
      *) die "fairness: unknown configuration: $config (off, fair, quota)" ;;
    esac
    floodgate_env=("FLOODGATE__UPSTREAMS__DEFAULT__FAIR_KEY=$key" "FLOODGATE__UPSTREAMS__DEFAULT__FAIR_MAX_QUEUE=$maxq")
    run_case fairness "$fairness_subject" "$fairness_delay" "$fairness_greedy_conns" "$rep" load_fairness \
      "{\"part\": \"fairness\", \"config\": \"$config\", \"fair_key\": \"$key\", \"fair_max_queue\": $maxq,
        \"polite_rate\": $fairness_polite_rate, \"greedy_conns\": $fairness_greedy_conns,
        \"polite_slo_ms\": $fairness_polite_slo_ms, \"queue_timeout_s\": $queue_timeout}"
  done
}

count_fairness() { wc -w <<<"$fairness_configs"; }
