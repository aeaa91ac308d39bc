# Scenario "single": one client, one connection, closed loop (wrk -t1 -c1), against an upstream that answers at once
# ($single_delay ms): with nothing to queue behind, the latency measured is the upstream's plus what the proxy adds.
# Every subject; direct is the baseline. Sourced by run.sh. single_delay may be given in the environment.
# shellcheck disable=SC2154,SC2034 # run.sh's globals; locals that lib.sh and the load functions read by dynamic scope
: "${single_delay:=0}"

scenario_single() { # REP
  # load_wrk reads wrk_threads and run_case's clients: one thread, one connection.
  local rep=$1 subject wrk_threads=1
  for subject in $subjects; do
    run_case single "$subject" "$single_delay" 1 "$rep" load_wrk
  done
}

count_single() { wc -w <<<"$subjects"; }
