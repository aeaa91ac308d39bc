//! What a refused configuration says: one problem per key, all of them at once.

/// A configuration problem, always naming the key it is about.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{key}: {message}")]
pub struct ConfigError {
    pub key: String,
    pub message: String,
}

impl ConfigError {
    pub fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            key: key.into(),
            message: message.into(),
        }
    }
}

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
