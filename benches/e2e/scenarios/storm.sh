# Scenario "storm": a retry storm. wrk closed loop with no think time, so every shed answer is followed at once by
# the next request, and a client timeout of 2 s, against cap 8 and a 50 ms service time (capacity 160 req/s), from
# 1,000 to 16,000 clients; floodgate, HAProxy fast-shed (503 once its queue holds Q) and queue-everything, nginx;
# the bench upstream and the thread-per-connection JVM one. Sourced by run.sh.
#
# Settings (environment variables, e.g. `storm_clients="1000 8000" benches/e2e/run.sh -x storm`):
#   storm_clients    wrk connections, one run per value; those the file-descriptor limit cannot hold (each
#                    subject holds one per client, wrk one per connection) are left out and said so
#                                                                          [1000 4000 8000 16000]
#   storm_subjects   subjects                [floodgate-1 floodgate-2 haproxy-1 haproxy-2 haproxyq-1 haproxyq-2 nginx-1 nginx-2]
#   storm_upstreams  upstream kinds: bench (examples/bench_upstream.rs), jvm (benches/e2e/jvm/)      [bench jvm]
#   storm_delay      service time, ms                                         [50]
#   storm_timeout    wrk's client timeout, s                                  [2]
#   storm_duration   measured seconds per run (its own, for a steady window at 16,000 clients)       [10]
#   storm_warmup     warm-up seconds per run                                  [3]
# Cap, queue and queue timeout are run.sh's -n, -q and -T (8, 1024, 2 s).

: "${storm_clients:=1000 4000 8000 16000}"
: "${storm_subjects:=floodgate-1 floodgate-2 haproxy-1 haproxy-2 haproxyq-1 haproxyq-2 nginx-1 nginx-2}"
: "${storm_upstreams:=bench jvm}"
: "${storm_delay:=50}"
: "${storm_timeout:=2}"
: "${storm_duration:=10}"
: "${storm_warmup:=3}"
storm_fd_limit=$(ulimit -Hn) # run.sh raises the soft limit to it before the runs

tools_storm() {
  [[ " $storm_upstreams " == *" jvm "* ]] && want_tool javac openjdk-17-jdk-headless
  [[ " $storm_subjects " == *" haproxy"* ]] && want_tool haproxy haproxy
  [[ " $storm_subjects " == *" nginx-"* ]] && want_tool nginx nginx-light
  return 0
}

build_storm() {
  if [[ " $storm_upstreams " == *" jvm "* ]] && ! declare -F start_jvm_upstream >/dev/null; then
    # The JVM upstream's start and build live in scenarios/jvm.sh; take them without running its scenario.
    # shellcheck source=jvm.sh
    source "$here/scenarios/jvm.sh"
    build_jvm
  fi
}

# The client counts this machine's limits allow: wrk and floodgate each hold a socket per client (HAProxy and nginx
# two: their maxconn is held to what the limit allows, see scenario_storm).
storm_client_counts() {
  local fds c
  fds=$(ulimit -n)
  for c in $storm_clients; do
    if [[ $fds == unlimited ]] || ((c + 1000 <= fds)); then
      echo "$c"
    else
      log "storm: $c clients need more than the file-descriptor limit ($fds) allows; left out"
    fi
  done
}

scenario_storm() { # REP
  local rep=$1 clients subject upstream_kind duration=$storm_duration warmup=$storm_warmup wrk_timeout=$storm_timeout
  local peer_maxconn fds
  fds=$(ulimit -n)
  for upstream_kind in $storm_upstreams; do
    for clients in $(storm_client_counts); do
      # A peer holds two descriptors per proxied client (client and upstream side) and refuses to start with a
      # maxconn its limit cannot hold: beyond that, clients wait in its accept backlog (the report says so).
      peer_maxconn=$((clients + 1000))
      [[ $fds == unlimited ]] || ((peer_maxconn <= (fds - 200) / 2)) || peer_maxconn=$(((fds - 200) / 2))
      for subject in $storm_subjects; do
        run_case storm "$subject" "$storm_delay" "$clients" "$rep" load_storm
      done
    done
  done
}

# wrk as load_wrk runs it, plus floodgate's outcomes over the window (its shed reasons).
load_storm() { # warmup|measure URL DIR SECONDS
  local before after
  [[ $1 == measure ]] && before=$(floodgate_outcomes "$admin_addr")
  load_wrk "$@" || return 1
  [[ $1 == measure ]] || return 0
  after=$(floodgate_outcomes "$admin_addr")
  merge_outcomes "$before" "$after" <"$3/load.json" >"$3/load.json.new" && mv "$3/load.json.new" "$3/load.json"
}

count_storm() {
  echo $(($(storm_client_counts 2>/dev/null | wc -l) * $(wc -w <<<"$storm_subjects") * $(wc -w <<<"$storm_upstreams")))
}
