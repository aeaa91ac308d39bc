#!/bin/sh
# The soak (not in CI): floodgate at its cap for 10 minutes with client aborts and upstream resets mixed in,
# sampling its RSS and open file descriptors; prints the samples and the growth after warm-up.
#
#   scripts/soak.sh [SECONDS] [SEED]     (defaults: 600, a fixed seed)
#
# Needs only the Rust toolchain. Builds in release mode; the samples table goes to stdout.
set -eu
cd "$(dirname "$0")/.."
FLOODGATE_SOAK_SECS="${1:-600}"
FLOODGATE_SOAK_SEED="${2:-20646}"
export FLOODGATE_SOAK_SECS FLOODGATE_SOAK_SEED
exec cargo test --release --locked --test soak -- --ignored --nocapture --test-threads 1
