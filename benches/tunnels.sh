#!/usr/bin/env bash
# Memory per open tunnel: N idle WebSockets through each proxy to one echoing upstream (examples/websockets.rs), and
# the proxy's RSS before and with them, side by side in one run (docs/tunnels.md). floodgate runs on one thread,
# HAProxy with one thread and nginx with one worker, each allowing every tunnel. Builds what it needs in release; uses
# HAProxy and nginx when installed (benches/e2e/run.sh's set-up installs them), skips them otherwise.
#
# Usage: benches/tunnels.sh [-n TUNNELS] [-r ROUNDS] [-b BINARY] [SUBJECT...]
#   -n TUNNELS  idle WebSockets per round                                   [1000]
#   -r ROUNDS   rounds per subject, each in a fresh proxy                    [2]
#   -b BINARY   a floodgate binary to measure instead of this checkout's
#   SUBJECT     floodgate, haproxy, nginx                                    [all three]
set -euo pipefail
tunnels=1000 rounds=2 binary=""
while getopts "n:r:b:h" opt; do
  case $opt in
    n) tunnels=$OPTARG ;;
    r) rounds=$OPTARG ;;
    b) binary=$OPTARG ;;
    *) sed -n '2,11p' "$0"; exit 0 ;;
  esac
done
shift $((OPTIND - 1))
subjects=("${@:-floodgate haproxy nginx}")
read -r -a subjects <<<"${subjects[*]}"
repo=$(cd "$(dirname "$0")/.." && pwd)
target=${CARGO_TARGET_DIR:-$repo/target}
(cd "$repo" && cargo build --release --quiet --bin floodgate --example websockets)
binary=${binary:-$target/release/floodgate}
ulimit -n "$(ulimit -Hn)"
((3 * tunnels + 500 <= $(ulimit -n))) || { echo "tunnels: $tunnels tunnels need more file descriptors than $(ulimit -n)" >&2; exit 2; }

# Process bookkeeping (pids, cleanup on exit), free_port, wait_line, wait_port, children and status_kb.
source "$repo/benches/e2e/lib.sh"
work=$(mktemp -d)
trap 'rc=$?; rm -rf "$work"; (exit $rc); cleanup' EXIT
# RSS in KiB of a process and its children (nginx's master and worker).
rss_kib() { status_kb VmRSS "$1" $(children "$1"); }

"$target/release/examples/websockets" upstream >"$work/upstream.out" 2>&1 &
pids+=($!)
wait_line "$work/upstream.out" "upstream ready" $! >/dev/null || die "the upstream did not start: $(cat "$work/upstream.out")"
upstream=$(sed -n 's/.* listen=\([^ ]*\).*/\1/p' "$work/upstream.out")

start_proxy() { # SUBJECT PORT -> prints the proxy's PID
  local port=$2
  case $1 in
    floodgate)
      "$binary" --listen "127.0.0.1:$port" --admin 127.0.0.1:0 --upstream "http://$upstream" --max-connections 8 \
        --max-tunnels $((tunnels + 100)) --threads 1 >"$work/proxy.out" 2>"$work/proxy.err" &
      echo $!
      wait_line "$work/proxy.out" "floodgate ready" $! >/dev/null || die "floodgate did not start: $(cat "$work/proxy.err")" ;;
    haproxy)
      cat >"$work/haproxy.cfg" <<EOF
global
    nbthread 1
    maxconn $((2 * tunnels + 200))
defaults
    mode http
    maxconn $((2 * tunnels + 200))
    timeout connect 2s
    timeout client 60s
    timeout server 60s
    timeout tunnel 1h
frontend fe
    bind 127.0.0.1:$port
    default_backend be
backend be
    server app $upstream
EOF
      haproxy -db -f "$work/haproxy.cfg" >"$work/proxy.out" 2>&1 &
      echo $! ;;
    nginx)
      mkdir -p "$work/nginx/tmp"
      cat >"$work/nginx/nginx.conf" <<EOF
worker_processes 1;
worker_rlimit_nofile $((3 * tunnels + 200));
pid $work/nginx/nginx.pid;
error_log $work/nginx/error.log crit;
daemon off;
events { worker_connections $((2 * tunnels + 200)); }
http {
    access_log off;
    client_body_temp_path $work/nginx/tmp;
    proxy_temp_path $work/nginx/tmp;
    fastcgi_temp_path $work/nginx/tmp;
    uwsgi_temp_path $work/nginx/tmp;
    scgi_temp_path $work/nginx/tmp;
    server {
        listen 127.0.0.1:$port;
        location / {
            proxy_pass http://$upstream;
            proxy_http_version 1.1;
            proxy_set_header Upgrade \$http_upgrade;
            proxy_set_header Connection "upgrade";
            proxy_read_timeout 1h;
        }
    }
}
EOF
      nginx -c "$work/nginx/nginx.conf" -p "$work/nginx" >"$work/proxy.out" 2>&1 &
      echo $! ;;
  esac
}

echo "tunnels: $tunnels idle WebSockets per round; floodgate: $binary"
echo "| proxy | round | RSS before, MiB | RSS with the tunnels, MiB | KiB per tunnel | tunnels open |"
echo "|---|---|---|---|---|---|"
for subject in "${subjects[@]}"; do
  if [[ $subject != floodgate ]] && ! command -v "$subject" >/dev/null; then
    echo "| $subject | not installed | | | | |"
    continue
  fi
  for round in $(seq 1 "$rounds"); do
    port=$(free_port)
    proxy=$(start_proxy "$subject" "$port")
    pids+=("$proxy")
    wait_port "$port" "$proxy" || die "$subject did not start: $(cat "$work/proxy.out")"
    sleep 1
    before=$(rss_kib "$proxy")
    "$target/release/examples/websockets" clients --addr "127.0.0.1:$port" --connections "$tunnels" >"$work/clients.out" 2>&1 &
    clients=$!
    wait_line "$work/clients.out" '"ready":true' "$clients" >/dev/null || die "the clients did not connect: $(cat "$work/clients.out")"
    sleep 2
    with=$(rss_kib "$proxy")
    open=$(sed -n 's/.*"open":\([0-9]*\).*/\1/p' "$work/clients.out")
    kill "$clients"; wait "$clients" 2>/dev/null || true
    kill "$proxy"; wait "$proxy" 2>/dev/null || true
    awk -v s="$subject" -v r="$round" -v b="$before" -v w="$with" -v n="$open" 'BEGIN {
      printf "| %s | %d | %.1f | %.1f | %.2f | %d |\n", s, r, b / 1024, w / 1024, (n > 0 ? (w - b) / n : 0), n }'
  done
done
