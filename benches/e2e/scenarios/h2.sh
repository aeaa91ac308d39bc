# Scenario "h2": HTTP/2 clients over cleartext with prior knowledge (h2c, what h2load does with an http:// URL),
# closed loop, $h2_clients connections x $h2_streams concurrent streams each, at each service time in $h2_delays;
# the upstream stays HTTP/1.1 behind every proxy. Sourced by run.sh.
#
# Which subjects take h2c on their listener: floodgate sniffs the HTTP/2 preface on its one port
# (src/server/connection.rs); HAProxy 2.6 in mode http detects the preface on a plain `bind` (checked with h2load);
# nginx 1.22 needs `listen ... http2`, which makes the port h2c only, set here through lib.sh's nginx_listen_extra
# (nginx 1.25 and later want `http2 on;` instead and warn about this form, but still take it).
# direct is left out: the bench upstream speaks HTTP/1.1 only.
# Every setting below may be given in the environment (h2_streams=100 benches/e2e/run.sh -x h2).
# shellcheck disable=SC2154,SC2034 # run.sh's globals; locals that lib.sh and the load functions read by dynamic scope
: "${h2_clients:=100}" "${h2_streams:=10}" "${h2_delays:=0 2}" "${h2_threads:=$wrk_threads}"

tools_h2() { want_tool h2load nghttp2-client; }

# h2load: $clients connections (run_case's), $h2_streams streams on each. Its summary has no percentiles; its
# --log-file has every finished request's status and latency, which h2load_to_load.py turns into percentiles.
load_h2load() { # warmup|measure URL DIR SECONDS
  local mode=$1 url=$2 dir=$3 secs=$4
  local args=(-c "$clients" -m "$h2_streams" -t "$h2_threads" -D "$secs")
  if [[ $mode == warmup ]]; then
    run_bg "$dir/h2load_warmup.txt" "${pin_load[@]}" h2load "${args[@]}" "$url"
    return
  fi
  run_bg "$dir/h2load.txt" "${pin_load[@]}" h2load "${args[@]}" --log-file "$dir/h2load.log" "$url" ||
    { log "h2load failed: $(tail -3 "$dir/h2load.txt")"; return 1; }
  python3 "$here/h2load_to_load.py" "$dir/h2load.txt" "$dir/h2load.log" "$secs" >"$dir/load.json"
}

h2_subjects() {
  local s
  for s in $subjects; do [[ $s == direct ]] || echo "$s"; done
}

scenario_h2() { # REP
  local rep=$1 delay subject nginx_listen_extra=http2
  for delay in $h2_delays; do
    for subject in $(h2_subjects); do
      run_case h2 "$subject" "$delay" "$h2_clients" "$rep" load_h2load "{\"streams\": $h2_streams}"
    done
  done
}

count_h2() { echo $(($(wc -w <<<"$h2_delays") * $(h2_subjects | wc -l))); }
