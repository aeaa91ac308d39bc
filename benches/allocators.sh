#!/usr/bin/env bash
# The allocator, measured: floodgate built with jemalloc (the default), mimalloc and the system's (glibc) allocator,
# side by side on the same machine in one run (docs/memory.md):
#   - instructions per response (benches/instructions.sh: valgrind, steady to 1 %),
#   - CPU-µs per response and RSS under load at 1,000 req/s and in a closed loop (benches/side_by_side.sh),
#   - RSS with 8,000 idle clients, and 1 s and 5 s after they leave, several floods in a row (benches/memory_return.sh).
#
# Usage: benches/allocators.sh [-r REPS] [-n IDLE_CLIENTS] [-f FLOODS]     (3, 8000, 3)
# Needs what those scripts need (valgrind, oha, wrk); builds the three binaries in release into target/allocators/.
set -euo pipefail
reps=3 clients=8000 floods=3
while getopts "r:n:f:h" opt; do
  case $opt in
    r) reps=$OPTARG ;;
    n) clients=$OPTARG ;;
    f) floods=$OPTARG ;;
    *) sed -n '2,9p' "$0"; exit 0 ;;
  esac
done
repo=$(cd "$(dirname "$0")/.." && pwd)
target=${CARGO_TARGET_DIR:-$repo/target}
out=$target/allocators
mkdir -p "$out"
cd "$repo"
cargo build --release --quiet --examples
for variant in jemalloc mimalloc system; do
  case $variant in
    jemalloc) features=() ;;
    mimalloc) features=(--no-default-features --features mimalloc) ;;
    system) features=(--no-default-features) ;;
  esac
  cargo build --release --quiet --bin floodgate "${features[@]}"
  cp "$target/release/floodgate" "$out/floodgate-$variant"
done
# The default build is what target/release holds afterwards.
cargo build --release --quiet --bin floodgate
bins=("$out/floodgate-jemalloc" "$out/floodgate-mimalloc" "$out/floodgate-system")

echo "== instructions per response (500 then 2,500 requests, 4 clients, 0 ms)"
benches/instructions.sh "${bins[@]}"
echo "== 1,000 req/s, 2 ms, N = 8: CPU-µs per response, RSS at the end"
benches/side_by_side.sh "${bins[@]}" "$reps" 1000 2
echo "== closed loop, 200 clients, 0 ms: 2xx/s, CPU-µs per response, RSS at the end"
benches/side_by_side.sh "${bins[@]}" "$reps" closed:200 0
echo "== $clients idle clients, then gone: RSS during, 1 s and 5 s after, $floods floods"
for bin in "${bins[@]}"; do
  echo "-- $bin"
  benches/memory_return.sh -n "$clients" -r "$floods" -b "$bin"
done
