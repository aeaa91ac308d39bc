#!/usr/bin/env bash
# A gRPC upstream behind floodgate and HAProxy, side by side in one run (docs/benchmarks.md, *gRPC upstream*): a
# closed loop of gRPC callers (examples/grpc_load.rs, tonic, 2 s deadline per call) over HTTP/2 to each proxy, which
# speaks HTTP/2 to one counting tonic upstream (examples/grpc_upstream.rs, 20 ms per call). Per round: OK/s, sheds
# (UNAVAILABLE with grpc-retry-pushback-ms), other errors, p50/p99 of OK calls, the upstream's own peak connections and
# peak concurrent RPCs, the proxy's CPU-µs per OK call (utime+stime, /proc/PID/stat, over the load), its RSS before any
# load, at the end of the load, and 1 s later with its upstream connections idle (their count from the upstream).
# Rounds are interleaved (round 1 of every subject, then round 2...), each in a fresh proxy and a fresh upstream.
#
# Usage: benches/grpc.sh [-c CLIENTS] [-d SECONDS] [-r ROUNDS] [-q QUEUE] [-I] [SUBJECT...]
#   -c CLIENTS  concurrent callers, over CLIENTS / 10 HTTP/2 connections               [200]
#   -d SECONDS  length of each round's load                                            [5]
#   -r ROUNDS   rounds per subject                                                     [3]
#   -q QUEUE    both proxies' queue bound (floodgate --max-queue; HAProxy's deny rule)  [floodgate's default, 1024]
#   -I          install nothing (fail if HAProxy is missing)
#   SUBJECT     floodgate, haproxy, direct                                             [all three]
#
# The cap, both proxies: at most 8 RPCs at work upstream, 4 per HTTP/2 connection.
#   floodgate  --threads 1 --max-connections 2 --max-streams-per-connection 4 --upstream-protocol http2, default
#              queue (max_queue 1024 unless -q, queue_timeout 5s): at most 2 TCP connections x 4 streams. A shed
#              gRPC call is answered 200 with grpc-status 14 and grpc-retry-pushback-ms.
#   haproxy    HAProxy (2.6 here) nbthread 1, h2c frontend (bind ... proto h2), `server s1 UP proto h2 maxconn 8`:
#              in HTTP mode a server's maxconn counts requests (streams), not connections, so at most 8 RPCs at
#              work; `http-reuse always` lets any call use any backend connection with a free stream; the streams on
#              each backend connection are capped by the upstream's SETTINGS_MAX_CONCURRENT_STREAMS (4, below), as
#              HAProxy 2.6 has no backend-only stream setting (tune.h2.max-concurrent-streams would cap the clients'
#              connections too); nothing caps the number of backend connections (1 to 8; at least 2 for 8 calls).
#              Queue as floodgate's: `timeout queue 5s`, 503 once the backend queue holds 1024 (or -q). Its 503
#              carries HAProxy's HTML error page, which tonic reads as a gRPC message and fails as INTERNAL
#              ("invalid compression flag"), counted under other errors; no pushback.
#   direct     the load straight at the upstream, without SETTINGS_MAX_CONCURRENT_STREAMS: the ceiling.
# Behind both proxies the upstream advertises SETTINGS_MAX_CONCURRENT_STREAMS 4 (--max-streams 4).
set -euo pipefail
clients=200 seconds=5 rounds=3 install=1 max_queue=1024 queue_flag=()
while getopts "c:d:r:q:Ih" opt; do
  case $opt in
    c) clients=$OPTARG ;;
    d) seconds=$OPTARG ;;
    r) rounds=$OPTARG ;;
    q) max_queue=$OPTARG queue_flag=(--max-queue "$OPTARG") ;;
    I) install=0 ;;
    *) sed -n '2,32p' "$0"; exit 0 ;;
  esac
done
shift $((OPTIND - 1))
subjects=("${@:-floodgate haproxy direct}")
read -r -a subjects <<<"${subjects[*]}"
for s in "${subjects[@]}"; do
  case $s in floodgate | haproxy | direct) ;; *) echo "grpc: unknown subject: $s" >&2; exit 2 ;; esac
done
repo=$(cd "$(dirname "$0")/.." && pwd)
target=${CARGO_TARGET_DIR:-$repo/target}
connections=$((clients / 10 > 0 ? clients / 10 : 1))
queue_timeout=5 delay_ms=20 upstream_streams=4

# Process bookkeeping (pids, cleanup on exit), tools (want_tool, install_tools), free_port, wait_line, wait_port,
# cpu_ticks and status_kb.
source "$repo/benches/e2e/lib.sh"
want_tool curl curl
want_tool python3 python3
[[ " ${subjects[*]} " == *" haproxy "* ]] && want_tool haproxy haproxy
install_tools
PATH="$PATH:/usr/sbin:/sbin"
(cd "$repo" && cargo build --release --quiet --bin floodgate --example grpc_upstream --example grpc_load)
work=$(mktemp -d)
trap 'rc=$?; rm -rf "$work"; (exit $rc); cleanup' EXIT
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
clk_tck=$(getconf CLK_TCK)

start_upstream() { # STREAMS (0: no limit); sets up_pid, up_addr, up_ctl
  local line limit=()
  (($1 > 0)) && limit=(--max-streams "$1")
  "$target/release/examples/grpc_upstream" --delay-ms "$delay_ms" "${limit[@]}" >"$work/upstream.out" 2>&1 &
  up_pid=$!; pids+=("$up_pid")
  line=$(wait_line "$work/upstream.out" "grpc_upstream ready" "$up_pid") || die "the upstream did not start: $(cat "$work/upstream.out")"
  up_addr=$(sed -n 's/.* listen=\([^ ]*\).*/\1/p' <<<"$line")
  up_ctl=$(sed -n 's/.* control=\([^ ]*\).*/\1/p' <<<"$line")
}

start_proxy() { # SUBJECT; sets proxy_pid and proxy_port
  local line
  case $1 in
    floodgate)
      "$target/release/floodgate" --listen 127.0.0.1:0 --admin 127.0.0.1:0 --upstream "http://$up_addr" \
        --max-connections 2 --upstream-protocol http2 --max-streams-per-connection 4 --threads 1 "${queue_flag[@]}" \
        >"$work/proxy.out" 2>"$work/proxy.err" &
      proxy_pid=$!; pids+=("$proxy_pid")
      line=$(wait_line "$work/proxy.out" "floodgate ready" "$proxy_pid") || die "floodgate did not start: $(cat "$work/proxy.err")"
      proxy_port=$(sed -n 's/.* listen=[^ ]*:\([0-9]*\) .*/\1/p' <<<"$line")
      ;;
    haproxy)
      proxy_port=$(free_port)
      cat >"$work/haproxy.cfg" <<EOF
global
    nbthread 1
    maxconn 4000

defaults
    mode http
    maxconn 4000
    timeout connect 2s
    timeout client 60s
    timeout server 60s
    timeout http-keep-alive 60s
    # floodgate's default queue_timeout.
    timeout queue ${queue_timeout}s
    # A queued call whose client left is dropped, not sent upstream.
    option abortonclose

frontend fe
    # h2c: HTTP/2 over cleartext, with prior knowledge.
    bind 127.0.0.1:$proxy_port proto h2
    default_backend be

backend be
    # Any backend connection with a free stream may carry any call.
    http-reuse always
    # floodgate's max_queue: 503 once the backend queue holds it.
    http-request deny deny_status 503 if { queue(be) ge $max_queue }
    # maxconn counts requests (streams) in HTTP mode: at most 8 calls at work upstream.
    server s1 $up_addr proto h2 maxconn 8
EOF
      haproxy -db -f "$work/haproxy.cfg" >"$work/proxy.out" 2>&1 &
      proxy_pid=$!; pids+=("$proxy_pid")
      wait_port "$proxy_port" "$proxy_pid" || die "haproxy did not start: $(cat "$work/proxy.out")"
      ;;
    direct)
      proxy_pid="" proxy_port=${up_addr##*:}
      ;;
  esac
}

echo "grpc: $clients callers over $connections HTTP/2 connections, ${seconds} s per round, $rounds round(s), upstream ${delay_ms} ms per call, queue bound $max_queue"
echo "| subject | round | OK/s | sheds (pushback) | UNAVAILABLE w/o pushback | DEADLINE_EXCEEDED | other | p50 ms | p99 ms | upstream peak conns | upstream peak RPCs | proxy CPU-µs / OK | proxy RSS before MiB | at the end MiB | idle 1 s later MiB | idle increment KiB | upstream conns idle |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
: >"$work/rows.jsonl"
for round in $(seq 1 "$rounds"); do
  for subject in "${subjects[@]}"; do
    if [[ $subject == direct ]]; then start_upstream 0; else start_upstream "$upstream_streams"; fi
    start_proxy "$subject"
    sleep 0.5
    rss_before=0 rss_end=0 rss_idle=0 t0=0 t1=0
    [[ -n $proxy_pid ]] && { rss_before=$(status_kb VmRSS "$proxy_pid"); t0=$(cpu_ticks "$proxy_pid"); }
    run_bg "$work/load.json" "$target/release/examples/grpc_load" --target "127.0.0.1:$proxy_port" \
      --clients "$clients" --connections "$connections" --seconds "$seconds" ||
      die "the load generator failed against $subject: $(tail -3 "$work/load.json")"
    [[ -n $proxy_pid ]] && { t1=$(cpu_ticks "$proxy_pid"); rss_end=$(status_kb VmRSS "$proxy_pid"); }
    sleep 1
    [[ -n $proxy_pid ]] && rss_idle=$(status_kb VmRSS "$proxy_pid")
    counts=$(curl -fsS "http://$up_ctl/") || die "the upstream's counts did not come: $(cat "$work/upstream.out")"
    stopping=("$up_pid")
    [[ -n $proxy_pid ]] && stopping=("$proxy_pid" "$up_pid")
    stop_pid "${stopping[@]}"
    forget_pids "${stopping[@]}"
    python3 - "$subject" "$round" "$(tail -1 "$work/load.json")" "$counts" "$((t1 - t0))" "$clk_tck" \
      "$rss_before" "$rss_end" "$rss_idle" "${proxy_pid:+1}" "$work/rows.jsonl" <<'EOF'
import json, sys
subject, rnd, load, counts, ticks, tck, before, end, idle, proxied, rows = sys.argv[1:]
load, counts = json.loads(load), json.loads(counts)
ok = load["ok"]
row = {"subject": subject, "round": int(rnd), "ok_per_s": load["ok_per_s"], "shed": load["shed"],
       "unavailable": load["unavailable"], "deadline": load["deadline"], "other": load["other"],
       "other_codes": load["other_codes"], "p50_ms": (load["p50_us"] or 0) / 1000, "p99_ms": (load["p99_us"] or 0) / 1000,
       "peak_conns": counts["connections"]["peak"], "peak_rpcs": counts["rpcs"]["peak"],
       "idle_conns": counts["connections"]["now"], "samples": load.get("samples", {})}
if proxied:
    row.update(cpu_us_per_ok=int(ticks) / int(tck) * 1e6 / max(ok, 1), rss_before_kib=int(before),
               rss_end_kib=int(end), rss_idle_kib=int(idle), idle_increment_kib=int(idle) - int(before))
open(rows, "a").write(json.dumps(row) + "\n")
def cell(key, scale=1, fmt="{:.1f}"):
    return fmt.format(row[key] / scale) if proxied else "-"
other = f"{row['other']}" + (f" {json.dumps(row['other_codes'])}" if row["other"] else "")
print(f"| {subject} | {rnd} | {row['ok_per_s']:,.0f} | {row['shed']} | {row['unavailable']} | {row['deadline']} | "
      f"{other} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} | {row['peak_conns']} | {row['peak_rpcs']} | "
      f"{cell('cpu_us_per_ok')} | {cell('rss_before_kib', 1024)} | {cell('rss_end_kib', 1024)} | "
      f"{cell('rss_idle_kib', 1024)} | {cell('idle_increment_kib', 1, '{:.0f}')} | {row['idle_conns']} |")
EOF
  done
done

echo
echo "Medians over rounds (floodgate / HAProxy ratios from these, side by side in this run):"
python3 - "$work/rows.jsonl" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
keys = ["ok_per_s", "shed", "unavailable", "deadline", "other", "p50_ms", "p99_ms", "peak_conns", "peak_rpcs",
        "cpu_us_per_ok", "rss_before_kib", "rss_end_kib", "rss_idle_kib", "idle_increment_kib", "idle_conns"]
med = {}
for s in dict.fromkeys(r["subject"] for r in rows):
    mine = [r for r in rows if r["subject"] == s]
    med[s] = {k: statistics.median(r[k] for r in mine) for k in keys if k in mine[0]}
    med[s]["worst_peak_conns"] = max(r["peak_conns"] for r in mine)
    med[s]["worst_peak_rpcs"] = max(r["peak_rpcs"] for r in mine)
    print(s, json.dumps({k: round(v, 2) for k, v in med[s].items()}))
    failures = sorted({f"{kind}: {message}" for r in mine for kind, message in r["samples"].items()})
    if failures:
        print(f"  {s}'s failures, the first of each kind per round: " + "; ".join(failures))
if "floodgate" in med and "haproxy" in med:
    f, h = med["floodgate"], med["haproxy"]
    for k in ["ok_per_s", "p50_ms", "p99_ms", "cpu_us_per_ok", "rss_before_kib", "rss_end_kib", "rss_idle_kib"]:
        print(f"floodgate / haproxy {k}: {f[k] / h[k]:.2f}" if h[k] else f"floodgate / haproxy {k}: -")
EOF
