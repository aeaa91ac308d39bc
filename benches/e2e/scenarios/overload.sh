# Scenario "overload": floodgate's queue disciplines side by side under open-loop overload, clients carrying a
# deadline. Sourced by run.sh; its report is docs/overload.md (section_overload.py), not docs/benchmarks.md.
#
# One upstream (examples/bench_upstream.rs) at $overload_delay ms, cap N = $overload_cap: capacity N / service
# time (8 / 20 ms = 400 req/s). oha sends a fixed schedule at each factor of $overload_factors times that capacity
# (-q, --latency-correction: each latency counts from when the request was due), every request with
# `X-Request-Timeout: $overload_deadline_ms` (the client's deadline; 0: no header). floodgate runs once per
# discipline of $overload_disciplines (queue_discipline, through FLOODGATE__UPSTREAMS__DEFAULT__QUEUE_DISCIPLINE;
# codel_target and codel_interval at their defaults, 5 ms and 100 ms), with the same queue bound
# ($overload_queue) and queue timeout ($overload_timeout s) in every run. The subjects of $overload_subjects that are
# not floodgate (haproxy-1: FIFO with `timeout queue`, no deadline header, no LIFO, no CoDel) run once per factor as
# a reference, at the same bound and timeout.
#
# Per run the JSON line has, beside lib.sh's: part "overload", rate, factor, capacity, discipline, deadline_ms,
# queue_timeout_s, and in load: "within" (responses per status whose corrected latency was <= the deadline, from
# oha's per-response record) and "outcomes" (floodgate's floodgate_requests_total by outcome over the measured
# load: /metrics read before and after it; {} for other subjects).
#
# oha is kept open-loop with 2 x rate x (queue timeout + service time) connections, at most $overload_conns_max
# (at 2 x 400 req/s and 1 s: 1,200; a FIFO queue that holds every request the whole timeout needs about 800).
# Every setting below may be given in the environment (overload_factors=2 benches/e2e/run.sh -x overload).
# shellcheck disable=SC2154,SC2034 # run.sh's globals; locals that lib.sh and the load functions read by dynamic scope
: "${overload_cap:=8}" "${overload_delay:=20}" "${overload_factors:=0.8 1 1.2 2}"
: "${overload_disciplines:=fifo adaptive-lifo codel}"
: "${overload_subjects:=floodgate-1 haproxy-1}"
: "${overload_deadline_ms:=500}" "${overload_queue:=1024}" "${overload_timeout:=1}"
: "${overload_conns_max:=1200}"
scenario_doc[overload]=overload

tools_overload() {
  want_oha
  [[ " $overload_subjects " == *" haproxy-"* ]] && want_tool haproxy haproxy
  return 0
}

# oha at $rate req/s over $conns connections with the deadline header; outcomes from floodgate's /metrics around
# the measured load. A load function for run_case (lib.sh).
load_overload() { # warmup|measure URL DIR SECONDS
  local mode=$1 url=$2 dir=$3 secs=$4 before after
  local args=(--no-tui -z "${secs}s" -q "$rate" --latency-correction -c "$conns" -t 5s)
  ((overload_deadline_ms > 0)) && args+=(-H "X-Request-Timeout: $overload_deadline_ms")
  if [[ $mode == warmup ]]; then
    run_bg "$dir/oha_warmup.txt" "${pin_load[@]}" oha "${args[@]}" --output-format quiet "$url"
    return
  fi
  rm -f "$dir/oha.db"
  before=$(floodgate_outcomes "$admin_addr")
  run_bg "$dir/oha.txt" "${pin_load[@]}" oha "${args[@]}" -w --output-format json -o "$dir/oha.json" \
    --db-url "$dir/oha.db" "$url" || { log "oha failed: $(tail -3 "$dir/oha.txt")"; return 1; }
  after=$(floodgate_outcomes "$admin_addr")
  python3 "$here/oha_to_load.py" "$dir/oha.json" "$dir/oha.db" "$rate" "$secs" "$overload_deadline_ms" |
    merge_outcomes "$before" "$after" >"$dir/load.json"
}

overload_rate() { # CAPACITY FACTOR
  awk -v c="$1" -v f="$2" 'BEGIN { printf "%d", c * f + 0.5 }'
}

scenario_overload() { # REP
  # cap, queue and queue_timeout are local so that run_case and start_subject see this scenario's values.
  local rep=$1 subject factor rate conns capacity discipline disciplines floodgate_env
  local cap=$overload_cap queue=$overload_queue queue_timeout=$overload_timeout
  capacity=$((cap * 1000 / overload_delay))
  for factor in $overload_factors; do
    rate=$(overload_rate "$capacity" "$factor")
    conns=$(awk -v r="$rate" -v w=$((queue_timeout * 1000 + overload_delay)) -v m="$overload_conns_max" \
      'BEGIN { c = int(2 * r * w / 1000 + 0.999); if (c < 16) c = 16; if (c > m) c = m; print c }')
    for subject in $overload_subjects; do
      disciplines=$overload_disciplines
      [[ $subject == floodgate-* ]] || disciplines=${subject%%-*}
      for discipline in $disciplines; do
        floodgate_env=()
        [[ $subject == floodgate-* ]] && floodgate_env=("FLOODGATE__UPSTREAMS__DEFAULT__QUEUE_DISCIPLINE=$discipline")
        run_case overload "$subject" "$overload_delay" "$conns" "$rep" load_overload \
          "{\"part\": \"overload\", \"rate\": $rate, \"factor\": $factor, \"capacity\": $capacity,
            \"discipline\": \"$discipline\", \"deadline_ms\": $overload_deadline_ms,
            \"queue_timeout_s\": $queue_timeout}"
      done
    done
  done
}

count_overload() {
  local n=0 subject
  for subject in $overload_subjects; do
    if [[ $subject == floodgate-* ]]; then n=$((n + $(wc -w <<<"$overload_disciplines"))); else n=$((n + 1)); fi
  done
  echo $((n * $(wc -w <<<"$overload_factors")))
}
