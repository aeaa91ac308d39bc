#!/usr/bin/env bash
# Builds the .deb: floodgate (the dist profile: stripped; with the OTLP exporter), its manual page and shell completions generated from the
# command line, the reference configuration as a conffile, and the systemd unit (packaging/floodgate.service).
# Installs cargo-deb from crates.io when missing. The package lands in target/debian/.
#
# Usage: packaging/deb.sh
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
target=${CARGO_TARGET_DIR:-$repo/target}
command -v cargo-deb >/dev/null || cargo install --locked cargo-deb
cargo build --locked --profile dist --features otlp --bin floodgate
# cargo-deb's assets name target/release; the dist build goes there under the name it expects.
mkdir -p "$target/release" "$target/packaging"
cp "$target/dist/floodgate" "$target/release/floodgate"
"$target/dist/floodgate" man | gzip -9n >"$target/packaging/floodgate.1.gz"
for shell in bash zsh fish; do
  "$target/dist/floodgate" completions "$shell" >"$target/packaging/floodgate.$shell"
done
cargo deb --no-build --no-strip
ls "$target"/debian/*.deb
