//! The environment layer's names: which `FLOODGATE__` variables set configuration keys, and which variable sets a
//! key. [`super::layers`] lays their values over the file.

use std::collections::BTreeMap;

/// Variables whose names start with this set configuration keys: the rest of the name is the key's path with
/// [`ENV_SEPARATOR`] between its parts, case-insensitive (`FLOODGATE__UPSTREAMS__API__MAX_CONNECTIONS`).
/// Kubernetes injects `FLOODGATE_PORT=tcp://…`, `FLOODGATE_SERVICE_HOST`, `FLOODGATE_PORT_8080_TCP_ADDR`… into
/// every pod of a namespace with a Service named floodgate; a single underscore never matches, so those never
/// reach the configuration.
pub const ENV_PREFIX: &str = "FLOODGATE__";
pub const ENV_SEPARATOR: &str = "__";

/// Lists of tables, which only the file can give.
pub(super) const FILE_ONLY_LISTS: [&str; 2] = ["routes", "tls_certificates"];

/// The variables the environment layer reads.
#[derive(Debug, Clone)]
pub enum Env {
    /// The process's environment.
    Process,
    /// Exactly these variables instead (tests, the fuzz targets, the demo).
    Vars(BTreeMap<String, String>),
}

impl Env {
    /// No variables at all: the file and the flags alone.
    pub fn none() -> Env {
        Env::Vars(BTreeMap::new())
    }

    /// The names of the variables that set keys, sorted, so that `floodgate check` can say where values came
    /// from.
    pub fn variables(&self) -> Vec<String> {
        let mut names: Vec<String> = match self {
            Env::Process => std::env::vars_os()
                .filter_map(|(name, _)| name.into_string().ok())
                .collect(),
            Env::Vars(vars) => vars.keys().cloned().collect(),
        };
        names.retain(|name| {
            name.get(..ENV_PREFIX.len())
                .is_some_and(|prefix| prefix.eq_ignore_ascii_case(ENV_PREFIX))
        });
        names.sort();
        names
    }
}

/// The variable that sets `key` (`upstreams.api.url` → `FLOODGATE__UPSTREAMS__API__URL`).
pub fn env_var(key: &str) -> String {
    format!("{ENV_PREFIX}{}", key.replace('.', ENV_SEPARATOR).to_ascii_uppercase())
}
