# Scenario "capacity": N = 64 in front of the fast (0 ms) upstream, so the proxy itself is the bottleneck; wrk closed
# loop. Sourced by run.sh.
capacity_cap=${capacity_cap:-64}
capacity_clients=${capacity_clients:-1000}

scenario_capacity() { # REP
  local rep=$1 subject cap=$capacity_cap
  for subject in $subjects; do
    local clients=$capacity_clients
    run_case capacity "$subject" 0 "$clients" "$rep" load_wrk
  done
}

count_capacity() { wc -w <<<"$subjects"; }
