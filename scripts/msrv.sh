#!/usr/bin/env bash
# Builds floodgate with the Rust version Cargo.toml's rust-version names, as a user on the oldest toolchain
# floodgate supports would. Needs rustup and a network that reaches Rust's toolchain downloads (this project's CI
# machines reach only package registries, so CI checks the weaker half instead: tests/shipping.rs,
# rust_version_is_at_least_what_every_dependency_it_builds_declares).
#
# Usage: scripts/msrv.sh
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml)
rustup toolchain install "$version" --profile minimal
cargo "+$version" check --locked --bin floodgate --lib
echo "msrv: floodgate builds with Rust $version"
