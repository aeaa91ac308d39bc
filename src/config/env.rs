//! The environment layer: `FLOODGATE__` variables read as configuration keys, and which variable set a key.

use std::collections::BTreeMap;

use super::{one_line, ConfigError};

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

/// The environment layer as configuration values keyed like the file's (`upstreams.api.max_connections`).
#[derive(Debug, Clone)]
pub(super) struct EnvLayer(config::Map<String, config::Value>);

impl config::Source for EnvLayer {
    fn clone_into_box(&self) -> Box<dyn config::Source + Send + Sync> {
        Box::new(self.clone())
    }

    fn collect(&self) -> Result<config::Map<String, config::Value>, config::ConfigError> {
        Ok(self.0.clone())
    }
}

impl EnvLayer {
    /// Reads the variables once; problems the layer itself finds go to `problems` and their variables are left
    /// out, so the rest of the configuration is still checked.
    pub(super) fn read(env: &Env, problems: &mut Vec<ConfigError>) -> EnvLayer {
        let prefix = ENV_PREFIX.trim_end_matches(ENV_SEPARATOR);
        let source = config::Environment::with_prefix(prefix)
            .prefix_separator(ENV_SEPARATOR)
            .separator(ENV_SEPARATOR);
        let source = match env {
            Env::Process => source,
            Env::Vars(vars) => source.source(Some(vars.clone().into_iter().collect())),
        };
        let mut values = match config::Source::collect(&source) {
            Ok(values) => values,
            Err(err) => {
                problems.push(ConfigError::new("environment", one_line(&err.to_string())));
                config::Map::new()
            }
        };
        // Routes and the listener's extra certificates are lists of tables, and a variable's name has no way to
        // say which entry it means.
        let mut list_variables = Vec::new();
        values.retain(|key, _| {
            let list = FILE_ONLY_LISTS.iter().find(|list| {
                key == *list
                    || key
                        .strip_prefix(*list)
                        .is_some_and(|rest| rest.starts_with('.') || rest.starts_with('['))
            });
            if let Some(list) = list {
                list_variables.push((*list, env_var(key)));
            }
            list.is_none()
        });
        list_variables.sort();
        problems.extend(list_variables.into_iter().map(|(list, variable)| {
            ConfigError::new(
                list,
                format!("cannot be set from the environment ({variable}); give [[{list}]] in the file"),
            )
        }));
        // The one list of plain values: in a variable, comma-separated.
        if let Some(value) = values.get_mut("trusted_proxies") {
            if let Ok(text) = value.clone().into_string() {
                let origin = "the environment".to_string();
                let items: Vec<config::Value> = text
                    .split(',')
                    .map(str::trim)
                    .filter(|item| !item.is_empty())
                    .map(|item| config::Value::new(Some(&origin), item))
                    .collect();
                *value = config::Value::new(Some(&origin), items);
            }
        }
        EnvLayer(values)
    }

    /// Names the variable behind a bad value: the key alone would send an operator looking in the file.
    pub(super) fn annotate(&self, problem: &mut ConfigError) {
        let key = problem.key.split('[').next().unwrap_or(&problem.key);
        if self.0.contains_key(key) {
            problem.message = format!("{} (from {})", problem.message, env_var(key));
        }
    }
}
