# Scenario "closed": wrk closed loop, every subject, clients x service times, at cap $cap. Sourced by run.sh.
#   $closed_clients (-c), $closed_delays (-s), $subjects (-S)

closed_pinned_delays=${closed_pinned_delays:-0 2}

scenario_closed() { # REP
  local rep=$1 delay clients subject delays=$closed_delays
  [[ $layout == pinned ]] && delays=$closed_pinned_delays
  for delay in $delays; do
    for clients in $closed_clients; do
      for subject in $subjects; do
        run_case closed "$subject" "$delay" "$clients" "$rep" load_wrk
      done
    done
  done
}

count_closed() { # in the current layout
  local delays=$closed_delays
  [[ $layout == pinned ]] && delays=$closed_pinned_delays
  echo $(($(wc -w <<<"$delays") * $(wc -w <<<"$closed_clients") * $(wc -w <<<"$subjects")))
}
