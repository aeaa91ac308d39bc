# Scenario "open": open-loop load with oha at fixed request rates. Sourced by run.sh.
#
# A closed loop (wrk) slows its clients down when the proxy slows down, so it hides queueing delay; here requests are
# sent on a fixed schedule whatever the answers do, and oha's --latency-correction counts each request's latency from
# the moment the schedule said it was due (no coordinated omission). Two parts, one JSON line per run with "part":
#   cost      $open_cost_rate req/s at $open_cost_delay ms service time, at each N in $open_cost_caps, far below
#             capacity: the proxy's CPU per response and memory at a fixed rate, and its p99 when nothing queues.
#             Every subject, direct included (the baseline latency).
#   overload  N = $open_overload_cap at $open_overload_delay ms (capacity N / service time), offered at each factor
#             in $open_overload_factors of that capacity. The queue bound is capacity x $open_overload_wait_ms (so a
#             request that is admitted waits at most about that long) and the queue timeout $open_overload_timeout s,
#             both the same for floodgate and HAProxy: past the bound the answer is an immediate 503 (shed at
#             admission), not a 503 after a long wait. Proxies only (direct has no cap, so nothing to overload).
# Every setting below may be given in the environment (open_cost_rate=2000 benches/e2e/run.sh -x open).
# shellcheck disable=SC2154,SC2034 # run.sh's globals; locals that lib.sh and the load functions read by dynamic scope
: "${open_cost_rate:=1000}" "${open_cost_delay:=2}" "${open_cost_caps:=8 64}"
: "${open_overload_cap:=8}" "${open_overload_delay:=20}" "${open_overload_factors:=0.5 2}"
: "${open_overload_timeout:=1}" "${open_overload_wait_ms:=500}"
# oha's connections (-c): each one carries one request at a time, so when all are busy a due request waits for one
# and oha has turned into a closed loop. We give it 2 x rate x the worst latency we expect, at most $open_conns_max:
# in the cost part the worst expected is $open_cost_worst_ms (HAProxy's p99 there was about 11 ms); in overload it is
# the queue timeout plus the service time (at 2 x 400 req/s: 2 x 800 x 1.02 s, capped to 1000, which still covers
# every request waiting the whole timeout). The JSON line's "unsent" counts requests the schedule made that oha
# never sent: not 0 means the generator fell behind.
: "${open_cost_worst_ms:=50}" "${open_conns_max:=1000}"

tools_open() { want_oha; }

open_conns() { # RATE WORST_MS: connections for oha, see above
  awk -v r="$1" -v w="$2" -v m="$open_conns_max" \
    'BEGIN { c = int(2 * r * w / 1000 + 0.999); if (c < 16) c = 16; if (c > m) c = m; print c }'
}

# oha at $rate req/s over $conns connections (both from scenario_open's scope). The measured run waits for the
# requests still in flight at the deadline (-w), so every request the schedule made in the window is counted, the
# slow ones too; the warm-up does not.
load_oha() { # warmup|measure URL DIR SECONDS
  local mode=$1 url=$2 dir=$3 secs=$4
  local args=(--no-tui -z "${secs}s" -q "$rate" --latency-correction -c "$conns" -t 5s)
  if [[ $mode == warmup ]]; then
    run_bg "$dir/oha_warmup.txt" "${pin_load[@]}" oha "${args[@]}" --output-format quiet "$url"
    return
  fi
  rm -f "$dir/oha.db"
  # The JSON summary has status counts and errors; the SQLite file has every response's status and corrected
  # latency, from which oha_to_load.py takes percentiles per status code (oha's own only split 2xx / not 2xx).
  run_bg "$dir/oha.txt" "${pin_load[@]}" oha "${args[@]}" -w --output-format json -o "$dir/oha.json" \
    --db-url "$dir/oha.db" "$url" || { log "oha failed: $(tail -3 "$dir/oha.txt")"; return 1; }
  python3 "$here/oha_to_load.py" "$dir/oha.json" "$dir/oha.db" "$rate" "$secs" >"$dir/load.json"
}

open_subjects() { # [proxies]: $subjects, without direct when asked
  local s
  for s in $subjects; do
    [[ ${1:-} == proxies && $s == direct ]] || echo "$s"
  done
}

scenario_open() { # REP
  # cap, queue and queue_timeout are local so that run_case and start_subject see this part's values.
  local rep=$1 n subject factor rate conns capacity cap=$cap queue=$queue queue_timeout=$queue_timeout
  for n in $open_cost_caps; do
    cap=$n rate=$open_cost_rate conns=$(open_conns "$open_cost_rate" "$open_cost_worst_ms")
    for subject in $(open_subjects); do
      run_case open "$subject" "$open_cost_delay" "$conns" "$rep" load_oha \
        "{\"part\": \"cost\", \"rate\": $rate, \"queue_timeout_s\": $queue_timeout}"
    done
  done
  cap=$open_overload_cap queue_timeout=$open_overload_timeout
  capacity=$((cap * 1000 / open_overload_delay))
  queue=$((capacity * open_overload_wait_ms / 1000))
  for factor in $open_overload_factors; do
    rate=$(awk -v c="$capacity" -v f="$factor" 'BEGIN { printf "%d", c * f + 0.5 }')
    conns=$(open_conns "$rate" $((queue_timeout * 1000 + open_overload_delay)))
    for subject in $(open_subjects proxies); do
      run_case open "$subject" "$open_overload_delay" "$conns" "$rep" load_oha \
        "{\"part\": \"overload\", \"rate\": $rate, \"factor\": $factor, \"capacity\": $capacity,
          \"queue_timeout_s\": $queue_timeout}"
    done
  done
}

count_open() {
  echo $(($(wc -w <<<"$open_cost_caps") * $(open_subjects | wc -l) +
    $(wc -w <<<"$open_overload_factors") * $(open_subjects proxies | wc -l)))
}
