//! The module map in docs/architecture.md against the code: every top-level module of the library has a row, and a
//! row that lists a folder's files lists exactly the files that are there. The map is what a reader trusts to find
//! their way; it must not drift from `src/` as files move.

use std::collections::BTreeSet;
use std::path::Path;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The map's rows: the module a row is about (`server`, `pool`) and the files it lists in brackets after it
/// (`(`mod`, `connection`; `tests/`)`), if any.
fn map_rows() -> Vec<(String, Option<BTreeSet<String>>)> {
    let text = std::fs::read_to_string(repo().join("docs/architecture.md")).expect("docs/architecture.md");
    let mut rows = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("| `") else { continue };
        let Some((name, rest)) = rest.split_once('`') else {
            continue;
        };
        let first_cell = rest.split('|').next().unwrap_or("");
        let listed = first_cell
            .trim()
            .strip_prefix('(')
            .and_then(|inner| inner.split_once(')'))
            .map(|(inner, _)| {
                inner
                    .split([',', ';'])
                    .map(|item| item.trim().trim_matches('`').to_string())
                    .filter(|item| !item.is_empty())
                    .collect::<BTreeSet<_>>()
            });
        rows.push((name.to_string(), listed));
    }
    rows
}

/// The library's top-level modules, as `lib.rs` declares them.
fn library_modules() -> Vec<String> {
    let lib = std::fs::read_to_string(repo().join("src/lib.rs")).expect("src/lib.rs");
    lib.lines()
        .filter_map(|line| {
            let line = line.trim();
            let rest = line
                .strip_prefix("pub mod ")
                .or_else(|| line.strip_prefix("pub(crate) mod "))?;
            Some(rest.trim_end_matches(';').to_string())
        })
        .collect()
}

/// A folder module's files as the map names them: each `.rs` file's stem but `tests.rs` (test-only), and `tests/`
/// for a folder of tests.
fn folder_files(module: &str) -> Option<BTreeSet<String>> {
    let dir = repo().join("src").join(module.replace("::", "/"));
    let entries = std::fs::read_dir(&dir).ok()?;
    let mut files = BTreeSet::new();
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("").to_string();
        if path.is_dir() {
            files.insert(format!("{name}/"));
        } else if let Some(stem) = name.strip_suffix(".rs") {
            if stem != "tests" {
                files.insert(stem.to_string());
            }
        }
    }
    // A folder of other files (the admin page) is no module's.
    (!files.is_empty()).then_some(files)
}

#[test]
fn every_module_of_the_library_has_a_row_in_the_architecture_map() {
    let rows: BTreeSet<String> = map_rows().into_iter().map(|(name, _)| name).collect();
    let missing: Vec<String> = library_modules().into_iter().filter(|m| !rows.contains(m)).collect();
    assert!(
        missing.is_empty(),
        "modules without a row in docs/architecture.md: {missing:?}"
    );
}

#[test]
fn a_row_that_lists_a_folders_files_lists_exactly_the_files_there() {
    let mut wrong = Vec::new();
    for (name, listed) in map_rows() {
        let on_disk = folder_files(&name);
        match (listed, on_disk) {
            (Some(listed), Some(on_disk)) if listed != on_disk => wrong.push(format!(
                "{name}: listed but absent {:?}, present but not listed {:?}",
                listed.difference(&on_disk).collect::<Vec<_>>(),
                on_disk.difference(&listed).collect::<Vec<_>>()
            )),
            (None, Some(on_disk)) => wrong.push(format!("{name} is a folder; its row lists none of {on_disk:?}")),
            (Some(listed), None) => wrong.push(format!("{name} is one file; its row lists {listed:?}")),
            _ => {}
        }
    }
    assert!(wrong.is_empty(), "docs/architecture.md's map:\n{}", wrong.join("\n"));
}
