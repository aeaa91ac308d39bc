# Scenario "slow-readers": slow readers beside fast clients, floodgate's response buffering off and on. Sourced by
# run.sh; its report is docs/overload.md (section_slow_readers.py).
#
# One upstream (examples/bench_upstream.rs --delay-ms $slow_readers_delay --body-bytes $slow_readers_body) behind a
# cap of N = $slow_readers_cap. Per run, first M slow readers (benches/e2e/slow_readers.py, M from
# $slow_readers_counts: each connection with SO_RCVBUF = $slow_readers_rcvbuf, a GET of the whole body, then at
# most $slow_readers_rate bytes a second) connect and ask for the body; one second later a fast closed loop (wrk,
# $slow_readers_fast_conns connections, `GET /?bytes=$slow_readers_fast_bytes`: a small body from the same upstream)
# runs the measured seconds beside them; then the slow readers are stopped. floodgate-1 runs with response
# buffering off (buffer_response_bytes = 0) and on (buffer_response_bytes = $slow_readers_buffer, which the slow
# body is within, and max_buffered_bytes = $slow_readers_max_buffered), through FLOODGATE__*
# (lib.sh's floodgate_env), in turn ($slow_readers_configs), the same queue bound ($slow_readers_queue) and timeout
# ($slow_readers_timeout s) in each. benches/e2e/sample_admin.py reads /status and /metrics every
# $slow_readers_sample_s s meanwhile (status.jsonl); /status is also read once just before wrk starts (the slots
# the slow readers alone hold).
#
# Why 4 MiB and not the default 64 KiB limit: on loopback Linux grows the proxy's send buffer towards the client
# up to net.ipv4.tcp_wmem's maximum (4 MiB here), so a body well below that leaves the proxy at once even to a
# client that reads nothing, buffering or not (checked by hand: 64 KiB, 256 KiB and 1 MiB bodies to 4 such
# readers held no slot with buffering off); a slow reader holds a slot only when the body is larger than what
# the kernel takes. $slow_readers_body must therefore be above tcp_wmem's maximum on the machine that runs this.
#
# Per run the JSON line has, beside lib.sh's: part "slow-readers", config, buffer_response_bytes,
# max_buffered_bytes, slow_readers, body_bytes, fast_bytes; load is wrk's (the fast clients), with load.slow
# (slow_readers.py's counts), load.held_before (/status in_use with only the slow readers there) and load.samples
# ([t, in_use, queue_depth, floodgate_buffered_bytes, floodgate_buffer_fallbacks_total]).
# Every setting below may be given in the environment (slow_readers_counts="8" run.sh -x slow-readers).
# shellcheck disable=SC2154,SC2034 # run.sh's globals; locals that lib.sh and the load functions read by dynamic scope
: "${slow_readers_cap:=8}" "${slow_readers_delay:=10}" "${slow_readers_body:=4194304}"
: "${slow_readers_counts:=4 16}" "${slow_readers_fast_conns:=32}" "${slow_readers_fast_bytes:=1024}"
: "${slow_readers_rcvbuf:=2048}" "${slow_readers_rate:=64}"
: "${slow_readers_configs:=off on}" "${slow_readers_buffer:=8388608}" "${slow_readers_max_buffered:=134217728}"
: "${slow_readers_queue:=1024}" "${slow_readers_timeout:=2}" "${slow_readers_sample_s:=0.2}"
scenario_doc[slow-readers]=overload

# The slow readers, then wrk beside them; a load function for run_case (lib.sh).
load_slow_readers() { # warmup|measure URL DIR SECONDS
  local mode=$1 url=$2 dir=$3 secs=$4 rpid spid="" tag="" hostport rc=0
  [[ $mode == warmup ]] && tag=_warmup
  hostport=${url#http://}
  hostport=${hostport%/}
  rm -f "$dir/slow$tag.json"
  python3 "$here/slow_readers.py" "$hostport" "$slow_count" "$slow_readers_rcvbuf" "$slow_readers_rate" \
    "$dir/slow$tag.json" / >"$dir/slow$tag.out" 2>&1 &
  rpid=$!
  pids+=("$rpid")
  wait_line "$dir/slow$tag.out" "slow readers ready" "$rpid" >/dev/null || { log "slow readers did not start: $(tail -3 "$dir/slow$tag.out")"; return 1; }
  sleep 1 # their requests reach the upstream and its answers start to flow
  if [[ $mode == warmup ]]; then
    run_bg "$dir/wrk_warmup.txt" "${pin_load[@]}" wrk -t "$wrk_threads" -c "$slow_readers_fast_conns" --timeout 5s \
      -d "${secs}s" "$url?bytes=$slow_readers_fast_bytes" || true
    stop_pid "$rpid"
    forget_pids "$rpid"
    return 0
  fi
  curl -fsS "http://$admin_addr/status" >"$dir/status_before.json" 2>/dev/null || echo '{}' >"$dir/status_before.json"
  rm -f "$dir/status.jsonl"
  python3 "$here/sample_admin.py" "$admin_addr" "$dir/status.jsonl" "$slow_readers_sample_s" 2>"$dir/sampler.err" &
  spid=$!
  pids+=("$spid")
  run_bg "$dir/wrk.txt" "${pin_load[@]}" wrk -t "$wrk_threads" -c "$slow_readers_fast_conns" --timeout 5s \
    -d "${secs}s" -s "$here/report.lua" "$url?bytes=$slow_readers_fast_bytes" || rc=$?
  stop_pid "$spid" "$rpid"
  forget_pids "$spid" "$rpid"
  ((rc == 0)) || { log "wrk failed: $(tail -3 "$dir/wrk.txt")"; return 1; }
  sed -n 's/^E2E_JSON //p' "$dir/wrk.txt" | PYTHONPATH=$here python3 -c '
import json, os, sys
from sample_admin import read_samples, upstream_of
load = json.load(sys.stdin)
d = sys.argv[1]
load["held_before"] = upstream_of(json.load(open(os.path.join(d, "status_before.json")))).get("in_use")
load["samples"] = [[s["t"], s["upstream"].get("in_use"), s["upstream"].get("queue_depth"),
                    s["metrics"].get("floodgate_buffered_bytes"), s["metrics"].get("floodgate_buffer_fallbacks_total")]
                   for s in read_samples(os.path.join(d, "status.jsonl"))]
slow = os.path.join(d, "slow.json")
load["slow"] = json.load(open(slow)) if os.path.exists(slow) else None
json.dump(load, sys.stdout)' "$dir" >"$dir/load.json"
}

scenario_slow-readers() { # REP
  local rep=$1 config slow_count bytes maxbuf floodgate_env
  local cap=$slow_readers_cap queue=$slow_readers_queue queue_timeout=$slow_readers_timeout
  local upstream_args=(--body-bytes "$slow_readers_body")
  for slow_count in $slow_readers_counts; do
    for config in $slow_readers_configs; do
      case $config in
        off) bytes=0 maxbuf=33554432 ;;
        on) bytes=$slow_readers_buffer maxbuf=$slow_readers_max_buffered ;;
        *) die "slow-readers: unknown configuration: $config (off, on)" ;;
      esac
      floodgate_env=("FLOODGATE__UPSTREAMS__DEFAULT__BUFFER_RESPONSE_BYTES=$bytes" "FLOODGATE__MAX_BUFFERED_BYTES=$maxbuf")
      run_case slow-readers floodgate-1 "$slow_readers_delay" "$slow_readers_fast_conns" "$rep" load_slow_readers \
        "{\"part\": \"slow-readers\", \"config\": \"$config\", \"buffer_response_bytes\": $bytes, \"max_buffered_bytes\": $maxbuf,
          \"slow_readers\": $slow_count, \"body_bytes\": $slow_readers_body, \"fast_bytes\": $slow_readers_fast_bytes, \"rcvbuf\": $slow_readers_rcvbuf,
          \"read_rate\": $slow_readers_rate, \"queue_timeout_s\": $queue_timeout}"
    done
  done
}

count_slow-readers() { echo $(($(wc -w <<<"$slow_readers_counts") * $(wc -w <<<"$slow_readers_configs"))); }
