//! The commit floodgate is built from, for `floodgate_build_info` and `--version`: `git rev-parse` when the source
//! is a git checkout, else `unknown` (a crate downloaded by `cargo install`).

use std::process::Command;

fn main() {
    let commit = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|output| output.status.success())
        .and_then(|output| String::from_utf8(output.stdout).ok())
        .map(|commit| commit.trim().to_string())
        .filter(|commit| !commit.is_empty())
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=FLOODGATE_COMMIT={commit}");
    // A new commit moves HEAD, or the branch it names.
    println!("cargo:rerun-if-changed=.git/HEAD");
    if let Ok(head) = std::fs::read_to_string(".git/HEAD") {
        if let Some(branch) = head.trim().strip_prefix("ref: ") {
            println!("cargo:rerun-if-changed=.git/{branch}");
        }
    }
    println!("cargo:rerun-if-changed=.git/packed-refs");
}
