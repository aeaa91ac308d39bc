# Scenario "closed": wrk closed loop, every subject, clients x service times, at cap $cap. Sourced by run.sh.
#   $closed_clients (-c), $closed_delays (-s), $subjects (-S)

scenario_closed() { # REP
  local rep=$1 delay clients subject
  for delay in $closed_delays; do
    for clients in $closed_clients; do
      for subject in $subjects; do
        run_case closed "$subject" "$delay" "$clients" "$rep" load_wrk
      done
    done
  done
}

count_closed() { echo $(($(wc -w <<<"$closed_delays") * $(wc -w <<<"$closed_clients") * $(wc -w <<<"$subjects"))); }
