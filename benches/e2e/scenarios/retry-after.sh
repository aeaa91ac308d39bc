# Scenario "retry-after": clients that retry shed requests, at once or after the Retry-After floodgate sends. Sourced
# by run.sh; its report is docs/overload.md (section_retry_after.py).
#
# One upstream (examples/bench_upstream.rs --delay-ms $retry_after_delay) behind a cap of $retry_after_cap with a
# small queue ($retry_after_queue, timeout $retry_after_timeout s), so that at $retry_after_factor x its capacity
# (cap / delay) floodgate sheds with `503`, `X-Floodgate-Shed-Reason: queue_full` and `Retry-After`. The load is
# benches/e2e/retry_client.py: new jobs (logical requests) at a fixed rate, factor x capacity, for the measured
# seconds, each on a new connection, retried on anything but a 2xx up to $retry_after_attempts attempts within
# $retry_after_deadline s of its start, one population per run ($retry_after_modes): "immediate" retries at once,
# "honour" sleeps Retry-After x U[1, 1 + $retry_after_jitter] first. The load runs deadline + measured seconds +
# deadline; the jobs counted are those started in the middle (measured) seconds: before them the population of
# retrying jobs builds up to its steady size (a job lives at most the deadline), after them new jobs keep arriving
# until every counted job has ended, so all of them ran under the same sustained load. The first deadline seconds
# are the warm-up (run.sh -w is not used: each population's own retries are what has to settle). floodgate's CPU
# (run_case, over the load function) covers the whole load and is divided by every 2xx answered in it.
#
# Per run the JSON line has, beside lib.sh's: part "retry-after", config (the mode), factor, rate, attempts,
# deadline_s, jitter; load is retry_client.py's (load.jobs: the counted jobs started/served, attempts, Retry-After
# values seen, shed reasons; load.all: every job's attempts and 2xx over the whole load) with load.outcomes (floodgate_requests_total by outcome over the window).
# Every setting below may be given in the environment (retry_after_factor=3 run.sh -x retry-after).
# shellcheck disable=SC2154,SC2034 # run.sh's globals; locals that lib.sh and the load functions read by dynamic scope
: "${retry_after_cap:=4}" "${retry_after_delay:=40}" "${retry_after_queue:=4}" "${retry_after_timeout:=2}"
: "${retry_after_factor:=2}" "${retry_after_modes:=immediate honour}" "${retry_after_attempts:=8}"
: "${retry_after_deadline:=5}" "${retry_after_jitter:=0.5}"
scenario_doc[retry-after]=overload

load_retry_after() { # warmup|measure URL DIR SECONDS
  local mode=$1 url=$2 dir=$3 secs=$4 hostport before after rc=0
  hostport=${url#http://}
  hostport=${hostport%/}
  [[ $mode == warmup ]] && return 0 # retry_client.py's first $retry_after_deadline s are the warm-up
  before=$(floodgate_outcomes "$admin_addr")
  run_bg "$dir/client.txt" "${pin_load[@]}" python3 "$here/retry_client.py" "$hostport" "$rate" "$secs" \
    "$config" "$retry_after_attempts" "$retry_after_deadline" "$retry_after_jitter" "$dir/client.json" || rc=$?
  ((rc == 0)) || { log "retry_client failed: $(tail -3 "$dir/client.txt")"; return 1; }
  after=$(floodgate_outcomes "$admin_addr")
  merge_outcomes "$before" "$after" <"$dir/client.json" >"$dir/load.json"
}

scenario_retry-after() { # REP
  local rep=$1 config rate
  local cap=$retry_after_cap queue=$retry_after_queue queue_timeout=$retry_after_timeout
  rate=$(python3 -c "print(round($retry_after_factor * $retry_after_cap * 1000 / $retry_after_delay, 3))")
  for config in $retry_after_modes; do
    case $config in immediate | honour) ;; *) die "retry-after: unknown mode: $config (immediate, honour)" ;; esac
    run_case retry-after floodgate-1 "$retry_after_delay" 0 "$rep" load_retry_after \
      "{\"part\": \"retry-after\", \"config\": \"$config\", \"factor\": $retry_after_factor, \"rate\": $rate,
        \"attempts\": $retry_after_attempts, \"deadline_s\": $retry_after_deadline, \"jitter\": $retry_after_jitter,
        \"queue_timeout_s\": $queue_timeout}"
  done
}

count_retry-after() { wc -w <<<"$retry_after_modes"; }
