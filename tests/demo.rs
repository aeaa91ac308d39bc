//! `floodgate demo` end to end: it runs, exits 0 and its table reports what happened.

mod support;

use std::time::Duration;

use support::*;

/// The `direct` and `via floodgate` columns of the table row starting with `label`.
fn row(stdout: &str, label: &str) -> (String, String) {
    let line = stdout
        .lines()
        .find(|l| l.starts_with(label))
        .unwrap_or_else(|| panic!("no `{label}` row in:\n{stdout}"));
    let cells: Vec<&str> = line[label.len()..].split_whitespace().collect();
    assert_eq!(cells.len(), 2, "row {line:?}");
    (cells[0].to_owned(), cells[1].to_owned())
}

#[test]
fn demo_reports_measured_peaks_and_every_request_answered() {
    let (status, stdout, stderr) = run_to_exit(
        &[
            "demo",
            "--clients",
            "20",
            "--requests",
            "2",
            "--max-connections",
            "2",
            "--service-time",
            "5ms",
        ],
        Duration::from_secs(60),
    );
    assert!(status.success(), "exit {status}\nstdout:\n{stdout}\nstderr:\n{stderr}");
    let pair = |a: &str, b: &str| (a.to_owned(), b.to_owned());
    assert_eq!(row(&stdout, "peak upstream connections"), pair("20", "2"), "{stdout}");
    assert_eq!(row(&stdout, "peak upstream threads"), pair("20", "2"), "{stdout}");
    assert_eq!(row(&stdout, "requests ok"), pair("40", "40"), "{stdout}");
    assert_eq!(row(&stdout, "shed (503)"), pair("0", "0"), "{stdout}");
    assert_eq!(row(&stdout, "errors"), pair("0", "0"), "{stdout}");
    assert!(stdout.contains("via floodgate (cap 2)"), "{stdout}");
}
