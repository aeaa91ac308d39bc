#!/usr/bin/env bash
# The stats page (admin listener, GET /) in a real headless browser.
#
# Installs Debian's chromium, python3 (which drives it) and prometheus (for promtool) with apt when missing, builds
# floodgate and the counting upstream (examples/bench_upstream.rs, dev profile: the build `cargo test` already made),
# starts the upstream and floodgate with two upstreams on ephemeral ports, then runs scripts/stats_page_check.py: the
# page shows both upstreams, fits a phone screen, and its numbers and charts follow the traffic the check sends; then
# /metrics, with that traffic's series in it, goes through `promtool check metrics`. Every process started here is
# ended by its PID on exit. Honours CARGO_TARGET_DIR.
#
#   scripts/stats_page_test.sh            # about 30 s once chromium is installed and the build is there
#   KEEP_LOGS=1 scripts/stats_page_test.sh  # keep the temporary directory with every process's output
#   STATS_SCREENSHOT=docs/stats-page.png scripts/stats_page_test.sh  # also save the page under load (the docs' picture)
set -euo pipefail
cd "$(dirname "$0")/.."

started=$SECONDS
say() { printf 'stats_page_test: %s\n' "$*"; }
fail() { say "FAILED: $*" >&2; exit 1; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null; then
        sudo "$@"
    else
        fail "need root (or sudo) to run: $*"
    fi
}

find_chromium() {
    command -v chromium || command -v chromium-browser || true
}

missing=()
[ -n "$(find_chromium)" ] || missing+=(chromium)
command -v python3 >/dev/null || missing+=(python3)
# promtool, for the exposition check at the end; Debian ships it in prometheus (its web assets are not needed).
command -v promtool >/dev/null || missing+=(prometheus)
if [ ${#missing[@]} -gt 0 ]; then
    say "installing ${missing[*]} with apt"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
chromium=$(find_chromium)
[ -n "$chromium" ] || fail "chromium is not on PATH after installing it"
say "browser: $("$chromium" --version 2>/dev/null | head -n 1) ($((SECONDS - started)) s)"

build_started=$SECONDS
cargo build --locked --quiet --bin floodgate --example bench_upstream
# cargo's own answer, so CARGO_TARGET_DIR and .cargo/config are both honoured.
target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
floodgate_bin="$target_dir/debug/floodgate"
upstream_bin="$target_dir/debug/examples/bench_upstream"
say "built ($((SECONDS - build_started)) s)"

work=$(mktemp -d "${TMPDIR:-/tmp}/floodgate-stats-page.XXXXXX")
pids=()
cleanup() {
    local status=$?
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        # Both exit within a second of SIGTERM; a stuck one is killed rather than left behind.
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    if [ "$status" -ne 0 ]; then
        for log in "$work"/*.log; do
            [ -s "$log" ] || continue
            echo "--- $(basename "$log") (last 30 lines)" >&2
            tail -n 30 "$log" >&2
        done
    fi
    if [ -n "${KEEP_LOGS:-}" ]; then
        say "logs kept in $work"
    else
        rm -rf "$work"
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Waits for a process's ready line (both print one to stdout once listening) and prints it.
ready_line() {
    local pid=$1 out=$2 what=$3
    for _ in $(seq 300); do
        if grep -m 1 ' ready ' "$out" 2>/dev/null; then
            return 0
        fi
        kill -0 "$pid" 2>/dev/null || fail "$what exited before it was ready"
        sleep 0.1
    done
    fail "$what was not ready within 30 s"
}

# A field of a ready line: `listen=127.0.0.1:41234` → 127.0.0.1:41234.
field() {
    sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$2"
}

"$upstream_bin" --delay-ms 5 >"$work/upstream.out" 2>"$work/upstream.log" &
pid=$!
pids+=("$pid")
line=$(ready_line "$pid" "$work/upstream.out" bench_upstream)
upstream=$(field listen "$line")

# alpha: roomy, slow started, takes everything not under /beta. beta: one connection and no queue, so bursts are shed.
cat >"$work/floodgate.toml" <<EOF
listen = "127.0.0.1:0"
admin = "127.0.0.1:0"
shutdown_timeout = "2s"

[upstreams.alpha]
url = "http://$upstream"
max_connections = 4
slow_start = { initial = 1, window = "200ms", min_samples = 3 }

[upstreams.beta]
url = "http://$upstream"
max_connections = 1
max_queue = 0

[[routes]]
path_prefix = "/beta"
upstream = "beta"

[[routes]]
upstream = "alpha"
EOF
"$floodgate_bin" --config "$work/floodgate.toml" >"$work/floodgate.out" 2>"$work/floodgate.log" &
pid=$!
pids+=("$pid")
line=$(ready_line "$pid" "$work/floodgate.out" floodgate)
listen=$(field listen "$line")
admin=$(field admin "$line")
say "floodgate: listen=$listen admin=$admin, upstream $upstream"

check_started=$SECONDS
python3 scripts/stats_page_check.py \
    --admin "$admin" --listen "$listen" \
    --upstream alpha=/ --upstream beta=/beta --shed beta --slow-start alpha \
    --chromium "$chromium" --browser-log "$work/chromium.log" \
    ${STATS_SCREENSHOT:+--screenshot "$STATS_SCREENSHOT"}
say "browser check passed ($((SECONDS - check_started)) s)"

# The metrics the check's traffic left behind (answers, sheds, queue waits, slow start), as Prometheus scrapes them
# (its text format: promtool does not read OpenMetrics' `info` type): promtool's parse and lint, with nothing to say.
python3 -c 'import sys, urllib.request; sys.stdout.buffer.write(urllib.request.urlopen(sys.argv[1], timeout=10).read())' \
    "http://$admin/metrics" >"$work/metrics.txt"
if ! promtool check metrics <"$work/metrics.txt" >"$work/promtool.log" 2>&1 || [ -s "$work/promtool.log" ]; then
    cat "$work/promtool.log" >&2
    fail "promtool check metrics found problems in /metrics"
fi
say "promtool check metrics: clean ($(grep -c '^# TYPE' "$work/metrics.txt") families)"
say "passed ($((SECONDS - started)) s in all)"
