#!/usr/bin/env bash
# Runs floodgate's fuzz targets (fuzz/, cargo-fuzz + libFuzzer) for a while each, then minimises what they found
# into fuzz/corpus/<target>/, the corpus that `cargo test --test fuzz_corpus` replays on stable. Too slow for CI:
# run it by hand, and commit the corpus it leaves.
set -euo pipefail

TARGETS=(config request_head header_rewrite upstream_response h1_request_head h1_response_head)

usage() {
    cat <<EOF
Usage: scripts/fuzz.sh [-t SECONDS] [-j JOBS] [-s SANITIZER] [TARGET...]

Fuzzes each TARGET (default: all of ${TARGETS[*]}) for SECONDS, then merges the inputs
that reach new code into fuzz/corpus/TARGET/ (libFuzzer's merge, as \`cargo fuzz cmin\` does, with
fuzz/seeds/TARGET/ counted first). A crash stops that target's run; it is kept in fuzz/artifacts/TARGET/
and the script says how to replay it. Exits 1 if any target crashed.

  -t SECONDS    time per target (default: 600)
  -j JOBS       libFuzzer processes per target (default: 1; each takes a core)
  -s SANITIZER  address (default), none (faster; safe Rust needs little else), leak, memory, thread
  -h            this help

What each target checks: see src/fuzzing/ (the fuzz targets only call it).
Toolchain: nightly when rustup has it, else stable with RUSTC_BOOTSTRAP=1 (libFuzzer needs -Z flags).
Installs cargo-fuzz (cargo install --locked cargo-fuzz) if it is missing.

Examples:
  scripts/fuzz.sh                      # all targets, 10 minutes each
  scripts/fuzz.sh -t 60 request_head   # one target, one minute
EOF
}

seconds=600
jobs=1
sanitizer=address
while getopts "t:j:s:h" opt; do
    case "$opt" in
        t) seconds="$OPTARG" ;;
        j) jobs="$OPTARG" ;;
        s) sanitizer="$OPTARG" ;;
        h) usage; exit 0 ;;
        *) usage >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
[[ "$seconds" =~ ^[0-9]+$ && "$jobs" =~ ^[1-9][0-9]*$ ]] || { usage >&2; exit 2; }
selected=("$@")
[[ ${#selected[@]} -gt 0 ]] || selected=("${TARGETS[@]}")
for target in "${selected[@]}"; do
    [[ " ${TARGETS[*]} " == *" $target "* ]] || { echo "unknown target: $target (have: ${TARGETS[*]})" >&2; exit 2; }
done

cd "$(dirname "$0")/.."
root=$(pwd)

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "== installing cargo-fuzz"
    cargo install --locked cargo-fuzz
fi

if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    toolchain=(+nightly)
    echo "== toolchain: nightly"
else
    # cargo-fuzz passes unstable flags (-Zsanitizer, -Cpasses=sancov...); stable accepts them with this.
    toolchain=()
    export RUSTC_BOOTSTRAP=1
    echo "== toolchain: stable with RUSTC_BOOTSTRAP=1"
fi
fuzz() { (cd "$root/fuzz" && cargo "${toolchain[@]}" fuzz "$@"); }
flags=(--sanitizer "$sanitizer")

echo "== building the fuzz targets"
fuzz build "${flags[@]}"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
crashed=()
summary=()
for target in "${selected[@]}"; do
    corpus="$root/fuzz/corpus/$target"
    seeds="$root/fuzz/seeds/$target"
    mkdir -p "$corpus" "$root/fuzz/artifacts/$target"
    # The run grows a scratch copy; only its minimised merge goes back into the committed corpus.
    scratch="$work/$target"
    mkdir -p "$scratch"
    cp -r "$corpus/." "$scratch/"
    log="$work/$target.log"
    echo "== fuzzing $target for ${seconds}s (log: $log while it runs)"
    status=0
    fuzz run "${flags[@]}" --jobs "$jobs" "$target" "$scratch" "$seeds" -- \
        -max_total_time="$seconds" -max_len=16384 -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 >"$log" 2>&1 || status=$?
    # The last status line libFuzzer printed: executions, coverage, corpus.
    stats=$(grep -E '^#[0-9]+' "$log" | tail -n 1 || true)
    execs=$(grep -E '^stat::number_of_executed_units' "$log" | awk '{s += $2} END {print s + 0}')
    if [[ $status -ne 0 ]]; then
        # The panic message, not libFuzzer's dump of the input bytes.
        grep -A 3 -E "panicked at|ERROR: libFuzzer|Failing input" "$log" | grep -v "Output of" | cut -c1-400 || true
        crashed+=("$target")
    fi

    echo "== minimising the $target corpus"
    # What `cargo fuzz cmin` does, with the seeds counted first: libFuzzer's merge keeps the smallest inputs that
    # reach code the seeds do not. Edges only (-use_counters=0), not every hit count of them, which keeps the
    # corpus to a few hundred files. The seeds themselves stay in fuzz/seeds/ only.
    merged="$work/$target.merged"
    mkdir -p "$merged"
    cp "$seeds"/* "$merged/"
    fuzz run "${flags[@]}" "$target" "$merged" "$scratch" -- -merge=1 -use_counters=0 -timeout=20 -rss_limit_mb=4096 \
        >"$work/$target.merge.log" 2>&1 || { grep -A 3 "panicked at" "$work/$target.merge.log"; crashed+=("$target"); }
    for seed in "$seeds"/*; do
        rm -f "$merged/$(basename "$seed")"
    done
    rm -rf "$corpus"
    mkdir -p "$corpus"
    cp -r "$merged/." "$corpus/"
    summary+=("$target: ${execs} executions; last status: ${stats:-none}; corpus: $(find "$corpus" -type f | wc -l) files")
done

echo
echo "== summary"
printf '%s\n' "${summary[@]}"
if [[ ${#crashed[@]} -gt 0 ]]; then
    echo
    for target in "${crashed[@]}"; do
        for crash in "$root/fuzz/artifacts/$target"/*; do
            [[ -f "$crash" ]] || continue
            echo "$target crashed on $crash"
        done
        echo "  replay:   (cd fuzz && cargo ${toolchain[*]} fuzz run $target artifacts/$target/<file>)"
        echo "  minimise: (cd fuzz && cargo ${toolchain[*]} fuzz tmin $target artifacts/$target/<file>)"
        echo "  once fixed, keep it: cp fuzz/artifacts/$target/<file> fuzz/regressions/$target/<what-it-was>"
        echo "            and check on stable: cargo test --test fuzz_corpus"
    done
    exit 1
fi
echo "no crash; commit fuzz/corpus/ if it changed (git status fuzz/corpus)"
