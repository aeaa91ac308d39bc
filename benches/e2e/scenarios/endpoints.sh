# Scenario "endpoints": an upstream of two endpoints, one killed halfway through the measured load, with passive
# ejection on and off. Sourced by run.sh; its report is docs/overload.md (section_endpoints.py).
#
# Two bench_upstream processes (--delay-ms $endpoints_delay each): run_case's own, and a second one this scenario
# starts (by PID, in `pids`) from lib.sh's floodgate_config_fn hook, which also writes the run's floodgate.toml:
# `[upstreams.default] endpoints = [{url = A, max_connections = $endpoints_cap_each}, {url = B, ...}]` and
# `eject_after` (floodgate then gets --config instead of --upstream; --max-connections, the upstream-wide bound, is
# $endpoints_cap = the sum). Closed-loop load: oha, $endpoints_clients connections, `-z` the measured seconds, every
# response recorded (--db-url). Halfway through it the second endpoint is killed (SIGKILL, by PID: a crash, so its
# open connections break and new dials are refused). benches/e2e/sample_admin.py reads /status every
# $endpoints_sample_s s meanwhile. floodgate-1 with `eject_after = 3` (on, the default, eject_backoff 1 s) and
# `eject_after = 0` (off), in turn ($endpoints_configs). The warm-up (run.sh -w) is the same load, no kill.
#
# Per run the JSON line has, beside lib.sh's (whose upstream counts are the surviving endpoint's): part
# "endpoints", config, eject_after, cap_each; load has oha's figures over the whole window plus kill_s (seconds
# from oha's start to the kill), bins ([start_s, responses, not_2xx, p99_ms] per $endpoints_bin_s s, by response
# end time), windows (before, after (the kill to the end) and kill_2s (the kill's first 2 s), each starting 0.25 s
# before the kill: responses, not 2xx, p50/p99 ms of all and of the 2xx),
# samples ([t_s since oha's start, max_connections in force, in_use, queue_depth, endpoints ejected]) and
# second_served (the killed endpoint's requests served before the kill).
# Every setting below may be given in the environment (endpoints_clients=64 run.sh -x endpoints).
# shellcheck disable=SC2154,SC2034 # run.sh's globals; locals that lib.sh and the load functions read by dynamic scope
: "${endpoints_delay:=10}" "${endpoints_cap_each:=4}" "${endpoints_clients:=32}" "${endpoints_configs:=on off}"
: "${endpoints_queue:=1024}" "${endpoints_timeout:=2}" "${endpoints_sample_s:=0.05}" "${endpoints_bin_s:=0.25}"
scenario_doc[endpoints]=overload
tools_endpoints() { want_oha; }

# lib.sh's floodgate_config_fn: starts the second endpoint, writes the configuration file of both.
endpoints_config() { # UPSTREAM_ADDR RUN_DIR
  local up=$1 dir=$2 line
  "${pin_serve[@]}" "$upstream_bin" --delay-ms "$endpoints_delay" --threads "$upstream_threads" \
    >"$dir/upstream2.out" 2>"$dir/upstream2.err" &
  up2_pid=$!
  pids+=("$up2_pid")
  line=$(wait_line "$dir/upstream2.out" "upstream ready" "$up2_pid") || die "second upstream did not start: $(tail -3 "$dir/upstream2.err")"
  up2_addr=$(sed -n 's/.* listen=\([^ ]*\).*/\1/p' <<<"$line")
  up2_ctl=$(sed -n 's/.* control=\([^ ]*\).*/\1/p' <<<"$line")
  cat >"$dir/floodgate.toml" <<TOML
[upstreams.default]
endpoints = [
  { url = "http://$up", max_connections = $endpoints_cap_each },
  { url = "http://$up2_addr", max_connections = $endpoints_cap_each },
]
eject_after = $eject_after

[[routes]]
upstream = "default"
TOML
  floodgate_config_file=$dir/floodgate.toml
}

load_endpoints() { # warmup|measure URL DIR SECONDS
  local mode=$1 url=$2 dir=$3 secs=$4 opid spid rc=0 t_start t_kill
  local args=(--no-tui -z "${secs}s" -c "$endpoints_clients" -t 5s)
  if [[ $mode == warmup ]]; then
    run_bg "$dir/oha_warmup.txt" "${pin_load[@]}" oha "${args[@]}" --output-format quiet "$url"
    return
  fi
  curl -fsS -X POST "http://$up2_ctl/reset" >/dev/null
  rm -f "$dir/oha.db" "$dir/status.jsonl"
  python3 "$here/sample_admin.py" "$admin_addr" "$dir/status.jsonl" "$endpoints_sample_s" 2>"$dir/sampler.err" &
  spid=$!
  pids+=("$spid")
  t_start=$(date +%s.%N)
  "${pin_load[@]}" oha "${args[@]}" --output-format json -o "$dir/oha.json" --db-url "$dir/oha.db" "$url" \
    >"$dir/oha.txt" 2>&1 &
  opid=$!
  pids+=("$opid")
  sleep "$(python3 -c "print($secs / 2)")"
  curl -fsS "http://$up2_ctl/stats" >"$dir/upstream2_stats.json" 2>/dev/null || echo '{}' >"$dir/upstream2_stats.json"
  t_kill=$(date +%s.%N)
  kill -KILL "$up2_pid" 2>/dev/null || true
  wait "$up2_pid" 2>/dev/null || true
  forget_pids "$up2_pid"
  wait "$opid" || rc=$?
  forget_pids "$opid"
  stop_pid "$spid"
  forget_pids "$spid"
  ((rc == 0)) || { log "oha failed: $(tail -3 "$dir/oha.txt")"; return 1; }
  PYTHONPATH=$here python3 - "$dir" "$t_start" "$t_kill" "$endpoints_bin_s" >"$dir/load.json" <<'PY'
import json, math, os, sqlite3, sys
from sample_admin import read_samples
d, t_start, t_kill, bin_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
kill = t_kill - t_start
MARGIN = 0.25
summary = json.load(open(os.path.join(d, "oha.json")))
rows = sqlite3.connect(os.path.join(d, "oha.db")).execute("SELECT end, duration, status FROM oha").fetchall()
def pct(v, q):
    v = sorted(v)
    return v[max(0, math.ceil(q / 100 * len(v)) - 1)] if v else None
def window(rs):
    lat = [r[1] * 1e3 for r in rs]
    ok = [r[1] * 1e3 for r in rs if 200 <= r[2] < 300]
    return {"responses": len(rs), "not_2xx": sum(1 for r in rs if not 200 <= r[2] < 300), "ok": len(ok),
            "ok_p50_ms": pct(ok, 50), "ok_p99_ms": pct(ok, 99),
            "codes": {str(c): sum(1 for r in rs if r[2] == c) for c in sorted({r[2] for r in rs})},
            "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "max_ms": max(lat) if lat else None}
end = max((r[0] for r in rows), default=0)
bins = []
for i in range(int(end / bin_s) + 1):
    rs = [r for r in rows if i * bin_s <= r[0] < (i + 1) * bin_s]
    w = window(rs)
    bins.append([round(i * bin_s, 3), w["responses"], w["not_2xx"], w["p99_ms"]])
errors = summary.get("errorDistribution") or {}
lat = [r[1] * 1e6 for r in rows]
codes = {}
for r in rows:
    codes[str(r[2])] = codes.get(str(r[2]), 0) + 1
samples = []
for s in read_samples(os.path.join(d, "status.jsonl")):
    u = s["upstream"]
    samples.append([round(s["wall"] - t_start, 3), u.get("max_connections"), u.get("in_use"), u.get("queue_depth"),
                    sum(1 for e in u.get("endpoints") or [] if e.get("ejected"))])
load = {
    "duration_us": int(end * 1e6), "requests": len(rows), "codes": codes,
    # oha's errors have no row: "aborted due to deadline" is its -z end cutting requests off, not a failure.
    "err_connect": 0, "err_read": sum(v for k, v in errors.items() if "deadline" not in k), "err_write": 0,
    "err_timeout": 0, "errors": errors,
    "p50_us": pct(lat, 50), "p99_us": pct(lat, 99), "p999_us": pct(lat, 99.9), "max_us": max(lat) if lat else None,
    "kill_s": round(kill, 3), "bins": bins,
    # oha's clock starts after its own start-up (tens of ms after t_start), so in its times the kill is a little
    # earlier than kill_s: the windows around the kill start MARGIN early.
    "margin_s": MARGIN,
    "windows": {"before": window([r for r in rows if r[0] < kill - MARGIN]),
                "after": window([r for r in rows if r[0] >= kill - MARGIN]),
                "kill_2s": window([r for r in rows if kill - MARGIN <= r[0] < kill + 2])},
    "samples": samples,
    "second_served": json.load(open(os.path.join(d, "upstream2_stats.json"))).get("served"),
}
json.dump(load, sys.stdout)
PY
}

scenario_endpoints() { # REP
  local rep=$1 config eject_after up2_pid up2_addr up2_ctl floodgate_config_file
  local cap=$((2 * endpoints_cap_each)) queue=$endpoints_queue queue_timeout=$endpoints_timeout
  local floodgate_config_fn=endpoints_config
  for config in $endpoints_configs; do
    case $config in
      on) eject_after=3 ;;
      off) eject_after=0 ;;
      *) die "endpoints: unknown configuration: $config (on, off)" ;;
    esac
    run_case endpoints floodgate-1 "$endpoints_delay" "$endpoints_clients" "$rep" load_endpoints \
      "{\"part\": \"endpoints\", \"config\": \"$config\", \"eject_after\": $eject_after, \"cap_each\": $endpoints_cap_each,
        \"queue_timeout_s\": $queue_timeout}"
  done
}

count_endpoints() { wc -w <<<"$endpoints_configs"; }
