//! Replays what the fuzzers found, on the stable toolchain: every file of `fuzz/seeds/<target>/` (written by
//! hand), `fuzz/corpus/<target>/` (minimised by `cargo fuzz cmin`) and `fuzz/regressions/<target>/` (inputs that
//! once failed) goes through the same library function as the fuzz target `<target>`.
//! A failure names the file; `scripts/fuzz.sh` runs the fuzzers themselves.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use floodgate::fuzzing;

fn inputs(corpora: &[&str]) -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut files = Vec::new();
    for kind in ["seeds", "corpus", "regressions"] {
        for corpus in corpora {
            let Ok(entries) = std::fs::read_dir(root.join(kind).join(corpus)) else {
                continue;
            };
            files.extend(entries.map(|entry| entry.unwrap().path()).filter(|path| path.is_file()));
        }
    }
    files.sort();
    files
}

fn replay(target: &str, run: fn(&[u8])) {
    replay_corpora(target, &[target], run);
}

/// Runs every input of `corpora`, then fails naming each one that panicked.
fn replay_corpora(target: &str, corpora: &[&str], run: fn(&[u8])) {
    let files = inputs(corpora);
    assert!(!files.is_empty(), "no corpus for {target} under fuzz/");
    let failed: Vec<String> = files
        .iter()
        .filter(|path| {
            let bytes = std::fs::read(path).unwrap();
            catch_unwind(AssertUnwindSafe(|| run(&bytes))).is_err()
        })
        .map(|path| path.display().to_string())
        .collect();
    assert!(
        failed.is_empty(),
        "{target}: {} input(s) failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

#[test]
fn config_corpus() {
    replay("config", fuzzing::config_file);
}

#[test]
fn request_head_corpus() {
    replay("request_head", fuzzing::request_head);
}

#[test]
fn header_rewrite_corpus() {
    replay("header_rewrite", fuzzing::header_rewrite);
}

#[test]
fn upstream_response_corpus() {
    replay("upstream_response", fuzzing::upstream_response);
}

#[test]
fn h1_request_head_corpus() {
    // Its own inputs, and every client head the request_head target has kept.
    replay_corpora(
        "h1_request_head",
        &["h1_request_head", "request_head"],
        fuzzing::h1_request_head,
    );
}

#[test]
fn h1_response_head_corpus() {
    // Its own inputs, and every upstream answer the upstream_response target has kept.
    replay_corpora(
        "h1_response_head",
        &["h1_response_head", "upstream_response"],
        fuzzing::h1_response_head,
    );
}
