# Scenario "cores": how floodgate and HAProxy use the threads they are given, at --threads / nbthread 1, 2 and 4:
# capacity (N = 64, 0 ms, wrk closed loop) and the retry storm (N = 8, 50 ms, no think time, 2 s client timeout,
# storm.sh's load). Each run records 2xx/s, CPU per response and the busiest thread's share of the proxy's CPU
# (lib.sh's thread_spread); docs/data-path.md has the scaling model drawn from them. Sourced by run.sh.
#
# Settings (environment variables, e.g. `cores_subjects="floodgate-2 haproxy-2" benches/e2e/run.sh -x cores`):
#   cores_subjects          subjects          [floodgate-1 floodgate-2 floodgate-4 haproxy-1 haproxy-2 haproxy-4]
#   cores_capacity_clients  wrk connections for capacity                                            [1000]
#   cores_storm_clients     wrk connections for the storm                                           [4000]
: "${cores_subjects:=floodgate-1 floodgate-2 floodgate-4 haproxy-1 haproxy-2 haproxy-4}"
: "${cores_capacity_clients:=1000}"
: "${cores_storm_clients:=4000}"

if ! declare -F load_storm >/dev/null; then
  # The storm's load and settings live in scenarios/storm.sh; take them without running its scenario.
  # shellcheck source=storm.sh
  source "$here/scenarios/storm.sh"
fi

tools_cores() {
  [[ " $cores_subjects " == *" haproxy"* ]] && want_tool haproxy haproxy
  return 0
}

scenario_cores() { # REP
  local rep=$1 subject
  for subject in $cores_subjects; do
    local cap=64
    run_case cores "$subject" 0 "$cores_capacity_clients" "$rep" load_wrk '{"kind": "capacity"}'
  done
  for subject in $cores_subjects; do
    local cap=8 duration=$storm_duration warmup=$storm_warmup wrk_timeout=$storm_timeout
    local peer_maxconn=$((cores_storm_clients + 1000))
    run_case cores "$subject" "$storm_delay" "$cores_storm_clients" "$rep" load_storm '{"kind": "storm"}'
  done
}

count_cores() { echo $((2 * $(wc -w <<<"$cores_subjects"))); }
