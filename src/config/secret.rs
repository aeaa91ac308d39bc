//! A value that is never shown: redacted wherever a configuration is printed or logged.

use serde::{Deserialize, Serialize, Serializer};

/// What [`Secret`] values are shown as.
pub const REDACTED: &str = "<redacted>";

/// A configuration value that must never be shown. It serializes (what `floodgate check` prints) and debug-prints
/// (what logs show) as [`REDACTED`], so a key declared with this type, such as a future admin bearer token or
/// TLS private key, is redacted everywhere without each place remembering to.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    /// The value itself, for the one place that uses it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(REDACTED)
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(REDACTED)
    }
}
