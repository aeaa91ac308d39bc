//! What a refused configuration says: one problem per key, all of them at once, each with the value it is about
//! and where that value was given.

use std::fmt;

use super::layers::Origin;

/// A configuration problem, always naming the key it is about; where the layers gave the value, it shows the
/// value (a secret's redacted) and its origin: `upstreams.api.max_connections = "8": expected an integer, not a
/// string (write it without quotes) (floodgate.toml, line 7)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub key: String,
    pub message: String,
    /// The offending value as the file would write it.
    pub value: Option<String>,
    /// Where it was given: `floodgate.toml, line 7`, `from FLOODGATE__LISTEN`, `from --max-connections`.
    pub origin: Option<String>,
}

impl ConfigError {
    pub fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            key: key.into(),
            message: message.into(),
            value: None,
            origin: None,
        }
    }

    pub(super) fn with_value(mut self, value: impl Into<String>) -> Self {
        self.value = Some(value.into());
        self
    }

    pub(super) fn given_at(mut self, origin: Origin) -> Self {
        self.origin = Some(origin.to_string());
        self
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.key)?;
        if let Some(value) = &self.value {
            write!(f, " = {value}")?;
        }
        write!(f, ": {}", self.message)?;
        if let Some(origin) = &self.origin {
            write!(f, " ({origin})")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

/// Every problem found in one configuration, each naming its key; never empty. Displayed on one line (`; `
/// between problems); the binary prints [`ConfigErrors::problems`] one per line.
#[derive(Debug, thiserror::Error)]
#[error("{}", join_problems(.0))]
pub struct ConfigErrors(pub(super) Vec<ConfigError>);

impl From<ConfigError> for ConfigErrors {
    fn from(problem: ConfigError) -> Self {
        ConfigErrors(vec![problem])
    }
}

impl ConfigErrors {
    pub fn problems(&self) -> &[ConfigError] {
        &self.0
    }
}

pub(super) fn join_problems(problems: &[ConfigError]) -> String {
    problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}
