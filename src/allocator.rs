//! The allocator's settings: what floodgate asks of jemalloc (freed pages back to the system about a second after
//! they stop being used, docs/memory.md), and what the running process really has, for `/status`.
//!
//! jemalloc reads its settings once, before `main`, from a variable: the binary sets it and starts itself again
//! (src/main.rs), so the tuning travels with the binary however it was built or installed.

/// Freed dirty pages are purged after about a second, with no "muzzy" stage between (jemalloc's default is 10 s).
pub const TUNING: &str = "dirty_decay_ms:1000,muzzy_decay_ms:0";

/// The variable jemalloc reads its settings from, as tikv-jemalloc-sys builds it (its symbols prefixed `_rjem_`).
pub const SETTINGS_VARIABLE: &str = "_RJEM_MALLOC_CONF";

/// The allocator's settings in force.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Settings {
    pub name: &'static str,
    /// Milliseconds before freed dirty pages go back to the system; `None` when the allocator does not say.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dirty_decay_ms: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub muzzy_decay_ms: Option<i64>,
    /// Whether a thread of the allocator's own purges freed pages on a timer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub background_thread: Option<bool>,
}

/// What the running process's allocator has, read from jemalloc itself (its statistics report's options).
#[cfg(feature = "jemalloc")]
pub fn settings() -> Settings {
    let mut report = Vec::new();
    let mut options = tikv_jemalloc_ctl::stats_print::Options::default();
    options.json_format = true;
    options.skip_merged_arenas = true;
    options.skip_per_arena = true;
    options.skip_bin_size_classes = true;
    options.skip_large_size_classes = true;
    options.skip_mutex_statistics = true;
    let parsed = tikv_jemalloc_ctl::stats_print::stats_print(&mut report, options)
        .ok()
        .and_then(|()| serde_json::from_slice::<serde_json::Value>(&report).ok());
    let opt = parsed.as_ref().and_then(|report| report.get("jemalloc")?.get("opt"));
    let number = |name: &str| opt.and_then(|opt| opt.get(name)?.as_i64());
    Settings {
        name: "jemalloc",
        dirty_decay_ms: number("dirty_decay_ms"),
        muzzy_decay_ms: number("muzzy_decay_ms"),
        background_thread: tikv_jemalloc_ctl::background_thread::read().ok(),
    }
}

/// A build without jemalloc: the system's allocator (or mimalloc), whose settings are not read.
#[cfg(not(feature = "jemalloc"))]
pub fn settings() -> Settings {
    Settings {
        name: if cfg!(feature = "mimalloc") {
            "mimalloc"
        } else {
            "system"
        },
        dirty_decay_ms: None,
        muzzy_decay_ms: None,
        background_thread: None,
    }
}
